"""A lost tokenizer replica, from the gateway's side (real sockets, fake tokenizers and scheduler:
tests/gateway_harness.py): its requests go again, under new ids and with what each client has had,
to a live replica (the restarted one too); replies under the old ids reach no client; the streams
go on unbroken. The tokenizer's side: tests/unit/test_tokenizer_resume.py; whole processes:
tests/integration/test_mesh_tokenizer_replicas.py."""

from __future__ import annotations

import asyncio

from pagemesh.common import transport as t
from pagemesh.common.messages import (
    AbortRequest,
    GenerateRequest,
    Ping,
    Pong,
    ResumedText,
    TextDelta,
    TextDeltaBatch,
)
from pagemesh.common.sampling import SamplingParams
from pagemesh.gateway import mesh as gateway_mesh
from pagemesh.gateway import tokenizer_routes
from pagemesh.gateway.tokenizer_routes import Route, TokenizerLink, pick
from pagemesh.tests.gateway_harness import FakeMesh, run, sse_payloads


def delta(request: GenerateRequest, text: str, ids: list[int], count: int, finish: str | None = None):
    return TextDeltaBatch(
        deltas=[
            TextDelta(
                request_id=request.request_id,
                index=0,
                text=text,
                token_ids=ids,
                logprobs=None,
                finish_reason=finish,
                prompt_tokens=4,
                completion_tokens=count,
            )
        ]
    )


def stream_text(body: str) -> str:
    events = sse_payloads(body)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


def test_a_restarted_tokenizer_gets_its_requests_again_and_their_streams_go_on(tmp_path):
    async def test(fake: FakeMesh):
        streaming = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
        waiting = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Ho"}))
        first, second = await fake.next_request(), await fake.next_request()
        if first.prompt_text != "Hi":
            first, second = second, first
        await fake.reply(first, delta(first, "A", [5], 1))
        await asyncio.sleep(0.3)  # the delta reaches the client before the restart is seen
        fake.tokenizer_instance = "second"  # the next pong comes from a new process
        came = [(await fake.from_tokenizer())[1] for _ in range(4)]
        aborts = {m for m in came if isinstance(m, AbortRequest)}
        assert aborts == {  # each names the id it goes on under: a prefill worker's kept pages follow it
            AbortRequest(request_id=r.request_id, reason="its tokenizer was lost", moved_to=r.request_id + "~1")
            for r in (first, second)
        }
        moved = {m.prompt_text: m for m in came if isinstance(m, GenerateRequest)}
        assert moved["Hi"].request_id == first.request_id + "~1" and moved["Ho"].request_id == second.request_id + "~1"
        assert moved["Hi"].resume == [ResumedText(index=0, output_token_ids=[5], text_chars=1, finished=False)]
        assert moved["Ho"].resume == []  # nothing reached its client: it starts as a new request
        await fake.reply(first, delta(first, "X", [6], 2))  # late text of the lost process: no client's
        await fake.reply(moved["Hi"], delta(moved["Hi"], "B", [7], 2, finish="length"))
        await fake.reply(moved["Ho"], delta(moved["Ho"], "C", [8], 1, finish="length"))
        assert stream_text(await (await streaming).text()) == "AB"
        answer = await (await waiting).json()
        assert answer["choices"][0]["text"] == "C" and answer["usage"]["completion_tokens"] == 1
        at_scheduler = {(await fake.scheduler.recv())[1] for _ in range(3)}
        assert aborts | {AbortRequest(request_id=first.request_id, reason="no client at this gateway")} == at_scheduler

    run(tmp_path, test, request_timeout=8.0)


def test_a_request_whose_tokenizer_keeps_restarting_fails_after_the_last_move(tmp_path, monkeypatch):
    monkeypatch.setattr(gateway_mesh, "MAX_TOKENIZER_MOVES", 1)

    async def test(fake: FakeMesh):
        streaming = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
        request = await fake.next_request()
        await fake.reply(request, delta(request, "A", [5], 1))
        await asyncio.sleep(0.3)
        fake.tokenizer_instance = "second"
        came = [(await fake.from_tokenizer())[1] for _ in range(2)]  # the old id's abort, and the request again
        assert {m.request_id for m in came} == {request.request_id, request.request_id + "~1"}
        fake.tokenizer_instance = "third"
        pending = asyncio.create_task(fake.from_tokenizer())  # answers pings until the abort comes
        events = sse_payloads(await (await streaming).text())
        assert events[0]["choices"][0]["text"] == "A"
        assert events[1]["error"]["code"] == "service_restarted" and events[2] == "[DONE]"
        assert (await pending)[1].request_id == request.request_id + "~1"  # its last id is aborted

    run(tmp_path, test, request_timeout=8.0)


async def serve_pings(router: t.Router, instance: str, inbox: asyncio.Queue) -> None:
    """A fake tokenizer replica: answers pings, queues everything else."""
    while True:
        identity, msg = await router.recv()
        if isinstance(msg, Ping):
            await router.send(identity, Pong(service="tokenizer", instance=instance))
        else:
            inbox.put_nowait(msg)


async def next_generate(inbox: asyncio.Queue) -> GenerateRequest:
    while not isinstance(msg := await inbox.get(), GenerateRequest):
        pass
    return msg


def test_a_silent_replica_loses_its_streams_to_a_live_one_and_gets_no_new_requests(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_routes, "TOKENIZER_SILENT_S", 2.5)  # pings go every second
    addresses = ",".join(t.ipc_address(str(tmp_path), name) for name in ("tok", "tok2"))

    async def test(fake: FakeMesh):
        inboxes = [asyncio.Queue(), asyncio.Queue()]
        servers = [asyncio.create_task(serve_pings(r, f"i{n}", inboxes[n])) for n, r in enumerate(fake.tokenizers)]
        await asyncio.sleep(1.5)  # both answered a ping
        streaming = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
        gets = [asyncio.create_task(next_generate(inbox)) for inbox in inboxes]
        done, _ = await asyncio.wait(gets, return_when=asyncio.FIRST_COMPLETED)
        holder = gets.index(done.pop())
        other = 1 - holder
        gets[other].cancel()
        request = gets[holder].result()
        await fake.reply(request, delta(request, "A", [5], 1))
        await asyncio.sleep(0.3)
        servers[holder].cancel()  # it stops answering (a SIGSTOPped or hung process)
        moved = await next_generate(inboxes[other])
        assert moved.request_id == request.request_id + "~1"
        assert moved.resume == [ResumedText(index=0, output_token_ids=[5], text_chars=1, finished=False)]
        await fake.reply(moved, delta(moved, "B", [7], 2, finish="length"))
        assert stream_text(await (await streaming).text()) == "AB"
        later = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Ho"}))
        new = await next_generate(inboxes[other])  # the silent one is not picked
        await fake.reply(new, delta(new, "C", [8], 1, finish="length"))
        assert (await (await later).json())["choices"][0]["text"] == "C"
        servers[other].cancel()

    run(tmp_path, test, tokenizer_address=addresses, request_timeout=8.0)


def test_pick_takes_the_live_replica_with_the_fewest_requests_and_avoids_a_lost_one_if_it_can():
    a, b, c = (TokenizerLink(name, socket=None) for name in "abc")
    assert pick([a, b, c]) is None  # none answered yet
    for link, instance in ((a, "1"), (b, "2")):
        assert not link.answered(instance, now=0.0)
    a.requests |= {"r1", "r2"}
    b.requests |= {"r3"}
    assert pick([a, b, c]) is b and pick([a, b, c], avoid=b) is a
    assert pick([a], avoid=a) is a  # a restarted replica alone takes its requests back
    assert a.answered("1b", now=1.0) and not a.silent(now=1.0 + tokenizer_routes.TOKENIZER_SILENT_S)
    assert a.silent(now=1.1 + tokenizer_routes.TOKENIZER_SILENT_S)


def test_a_route_counts_what_each_choice_had_and_moves_under_a_new_id_each_time():
    request = GenerateRequest(
        request_id="r",
        model="m",
        prompt_text="Hi",
        prompt_token_ids=None,
        messages=None,
        sampling=SamplingParams(n=2).validate(),
        stream=True,
        reply_to="ipc:///tmp/x",
        arrival_time=0.0,
        include_stop_str_in_output=False,
    )
    route = Route(request, None)
    batch = delta(request, "ab", [1, 2], 2)
    route.record(batch.deltas)
    route.record(
        [
            TextDelta(
                request_id="r",
                index=1,
                text="é",
                token_ids=[3],
                logprobs=None,
                finish_reason="stop",
                prompt_tokens=4,
                completion_tokens=1,
            )
        ]
    )
    first = route.moved()
    assert first.request_id == "r~1" and route.current_id == "r~1"
    assert first.resume == [
        ResumedText(index=0, output_token_ids=[1, 2], text_chars=2, finished=False),
        ResumedText(index=1, output_token_ids=[3], text_chars=1, finished=True),
    ]
    assert route.moved().request_id == "r~2" and route.own_id == "r"
