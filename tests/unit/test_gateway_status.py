"""The status page's data: rates from counters, request timings, the JSON document, and the two
routes on the real gateway app (a fake scheduler answers its StatusRequest)."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from pagemesh.common.messages import (
    ClusterStatus,
    KVPoolLoad,
    RequestFailed,
    StatusRequest,
    TextDelta,
    TextDeltaBatch,
    WorkerStatus,
)
from pagemesh.gateway import app as gateway_app
from pagemesh.gateway.status import RateMeter, RequestTrace, status_document
from pagemesh.tests.gateway_harness import FakeMesh, run


def delta(token_ids, index=0, request_id="r", prompt_tokens=4) -> TextDelta:
    return TextDelta(
        request_id=request_id,
        index=index,
        text="x",
        token_ids=token_ids,
        logprobs=None,
        finish_reason=None,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(token_ids),
    )


def worker(worker_id, kind="llm", role="decode", alive=True, running=0, waiting=0, produced=0, kv=True, ranks=1):
    return WorkerStatus(
        worker_id=worker_id,
        kind=kind,
        role=role,
        alive=alive,
        running=running,
        waiting=waiting,
        requests_finished=3,
        kv=KVPoolLoad(free_pages=75, used_pages=25, total_pages=100, bytes_sent=10, bytes_received=20) if kv else None,
        model="m",
        produced=produced,
        ranks=ranks,
    )


def test_rate_is_the_slope_over_the_window_and_restarts_when_the_counter_drops():
    meter = RateMeter(window=5.0)
    assert meter.observe("w", 0.0, 100) == 0.0  # one sample: no slope yet
    assert meter.observe("w", 1.0, 150) == 50.0
    assert meter.observe("w", 2.0, 150) == 25.0  # (150 - 100) / 2
    for t in range(3, 9):
        meter.observe("w", float(t), 150 + 10 * (t - 2))
    # samples older than the window went, except the one at its start: (t=3, 160) .. (t=8, 210)
    assert meter.samples["w"][0] == (3.0, 160)
    assert meter.observe("w", 9.0, 220) == pytest.approx((220 - 170) / 5)
    assert meter.observe("w", 10.0, 5) == 0.0  # a restarted worker counts from zero again
    assert meter.observe("w", 11.0, 25) == 20.0
    meter.keep_only({"other"})
    assert meter.samples == {}


def test_trace_gives_ttft_tpot_of_the_longest_choice_and_prompt_tokens_once_per_prompt():
    trace = RequestTrace("cmpl-1", "completion", arrival=10.0)
    trace.on_delta(delta([], index=0), 10.1)  # an empty delta is no token
    trace.on_delta(delta([1], index=0), 10.5)
    trace.on_delta(delta([2], index=1), 10.6)
    trace.on_delta(delta([3, 4], index=0), 10.9)
    trace.on_delta(delta([5], index=0, request_id="r2", prompt_tokens=6), 11.1)
    record = trace.record(11.5)
    assert record.ttft_s == pytest.approx(0.5)
    assert record.tpot_s == pytest.approx((11.1 - 10.5) / 3)  # choice 0: 4 tokens
    assert (record.prompt_tokens, record.completion_tokens) == (10, 5)
    assert record.e2e_s == pytest.approx(1.5) and record.outcome == "ok"
    one = RequestTrace("cmpl-2", "chat", arrival=0.0)
    one.on_delta(delta([1]), 0.2)
    assert one.record(0.3).tpot_s is None  # one token: no time per output token
    assert RequestTrace("cmpl-3", "chat", 0.0).record(0.1, "worker_failure").ttft_s is None


def test_document_lists_workers_by_pool_with_state_kv_and_rates():
    status = ClusterStatus(
        ready=True,
        workers=[
            worker("d0", running=2, produced=100),
            worker("p0", role="prefill", waiting=1, produced=10),
            worker("img0", kind="diffusion", role="mixed", kv=False, produced=4),
            worker("d1", alive=False),
        ],
        queued=7,
    )
    rates = RateMeter()
    status_document(status, rates, deque(), "m", now=0.0)
    later = ClusterStatus(
        ready=True,
        workers=[
            worker("d0", running=2, produced=300, ranks=3),
            worker("p0", role="prefill", waiting=1, produced=10),
            worker("img0", kind="diffusion", role="mixed", kv=False, produced=8),
        ],
        queued=7,
    )
    doc = status_document(later, rates, deque(), "m", now=2.0)
    assert [(w["pool"], w["id"], w["state"]) for w in doc["workers"]] == [
        ("decode", "d0", "busy"),
        ("diffusion", "img0", "idle"),
        ("prefill", "p0", "busy"),
    ]
    by_id = {w["id"]: w for w in doc["workers"]}
    assert by_id["d0"]["rate_per_s"] == 100.0 and by_id["d0"]["unit"] == "tokens"
    assert by_id["d0"]["ranks"] == 3 and "ranks" not in by_id["p0"]  # a tensor-parallel worker's processes
    assert by_id["img0"]["rate_per_s"] == 2.0 and by_id["img0"]["unit"] == "images" and by_id["img0"]["kv"] is None
    assert by_id["p0"]["kv"] == {
        "used_pages": 25,
        "total_pages": 100,
        "usage": 0.25,
        "bytes_sent": 10,
        "bytes_received": 20,
    }
    assert (doc["tokens_per_s"], doc["images_per_s"], doc["queued"], doc["ready"]) == (100.0, 2.0, 7, True)
    assert "d1" not in rates.samples  # a worker gone from the registry is forgotten
    first = status_document(status, RateMeter(), deque(), "m", now=0.0)
    assert {w["id"]: w["state"] for w in first["workers"]}["d1"] == "lost"


def test_document_without_a_scheduler_shows_no_stale_workers():
    doc = status_document(None, RateMeter(), deque(), "m", now=0.0)
    assert (doc["scheduler"], doc["ready"], doc["queued"], doc["workers"]) == (False, False, None, [])


def test_page_and_status_routes_on_the_gateway(tmp_path, monkeypatch):
    monkeypatch.setattr(gateway_app, "STATUS_TIMEOUT_S", 0.5)

    async def answer_status(fake: FakeMesh, status: ClusterStatus) -> None:
        identity, msg = await fake.scheduler.recv()
        assert isinstance(msg, StatusRequest)
        await fake.scheduler.send(identity, status)

    async def test(fake: FakeMesh):
        page = await fake.client.get("/")
        assert page.status == 200 and page.content_type == "text/html"
        html = await page.text()
        assert 'fetch("status"' in html and "<script src" not in html  # one file, nothing from elsewhere

        post = asyncio.create_task(fake.client.post("/v1/completions", json={"model": "smol", "prompt": "Hi"}))
        await fake.answer(await fake.next_request(), "a", "b", "c")
        assert (await post).status == 200
        body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        post = asyncio.create_task(fake.client.post("/v1/chat/completions", json=body))
        request = await fake.next_request()
        await fake.reply(request, TextDeltaBatch(deltas=[delta([7], request_id=request.request_id)]))
        failure = RequestFailed(
            request_id=request.request_id,
            status=503,
            error_type="service_unavailable",
            message="worker lost",
            param=None,
            code="worker_failure",
        )
        await fake.reply(request, failure)
        assert "worker lost" in await (await post).text()  # the error event, after a token

        answering = asyncio.create_task(
            answer_status(fake, ClusterStatus(ready=True, workers=[worker("w0", role="mixed", running=1)], queued=2))
        )
        response = await fake.client.get("/status")
        await answering
        doc = await response.json()
        assert [(w["id"], w["pool"], w["running"]) for w in doc["workers"]] == [("w0", "mixed", 1)]
        assert (doc["ready"], doc["queued"], doc["model"]) == (True, 2, "smol")
        failed, recent = doc["recent_requests"]  # newest first
        assert recent["kind"] == "completion" and recent["completion_tokens"] == 3 and recent["prompt_tokens"] == 4
        assert recent["ttft_s"] >= 0 and recent["tpot_s"] >= 0 and recent["outcome"] == "ok"
        assert (failed["kind"], failed["completion_tokens"], failed["outcome"]) == ("chat", 1, "worker_failure")

    run(tmp_path, test)
