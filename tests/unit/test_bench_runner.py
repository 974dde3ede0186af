"""pagemesh.bench.loadgen runner and main against a fake OpenAI-compatible server on loopback."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from pagemesh.bench.loadgen import main as bench_main
from pagemesh.bench.loadgen.datasets import DatasetSpec, Prompt, conversations
from pagemesh.bench.loadgen.runner import BenchError, LoadPoint, Target, request_body, run_point
from pagemesh.tests.default_model import tokenizer as default_tokenizer


class FakeServer:
    """Streams `max_tokens` one-character chunks per request, then a usage chunk; records every
    body and the most requests it held at once. `fail` answers HTTP 400 to every request."""

    def __init__(self, fail: bool = False, with_usage: bool = True):
        self.fail, self.with_usage = fail, with_usage
        self.bodies: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail:
            return web.json_response({"error": {"message": "no"}}, status=400)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = "messages" in body
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.01)
            choice = {"index": 0, "delta": {"content": "y"}} if chat else {"index": 0, "text": "y"}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if self.with_usage:
            usage = {"prompt_tokens": 1, "completion_tokens": body["max_tokens"]}
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return response

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def __enter__(self) -> str:
        self.thread.start()
        app = web.Application()
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app)

        async def start():
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _run(url, load, spec, **target):
    target = Target(url=url + target.pop("endpoint", "/v1/completions"), model="m", progress=False, **target)
    return asyncio.run(run_point(target, load, conversations(spec, default_tokenizer()), default_tokenizer()))


def test_request_body_forces_the_output_length_and_merges_extra_body():
    target = Target(url="u", model="m", extra_body={"cache_prompt": False, "temperature": 0.5})
    body = request_body(target, Prompt(None, [1, 2], None, 2), 16)
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": [1, 2],
        "max_tokens": 16,
        "min_tokens": 16,
        "ignore_eos": True,
        "temperature": 0.5,
        "cache_prompt": False,
    }
    messages = [{"role": "user", "content": "hi"}]
    body = request_body(Target(url="u", model="m", ignore_eos=False), Prompt(None, None, messages, 5), 4)
    assert body["messages"] == messages and "ignore_eos" not in body and "prompt" not in body


def test_concurrency_cap_and_counts():
    fake = FakeServer()
    with fake as url:
        results, duration = _run(
            url,
            LoadPoint(max_concurrency=3, num_prompts=12),
            DatasetSpec(input_len=8, output_len=5),
            prompt_as_token_ids=True,
            warmup=1,
        )
    assert len(results) == 12 and all(r.success for r in results) and duration > 0
    assert [r.output_tokens for r in results] == [5] * 12 and [r.prompt_len for r in results] == [8] * 12
    assert all(len(r.itl) == 4 for r in results)
    assert fake.most_in_flight == 3
    assert len(fake.bodies) == 13 and all(len(b["prompt"]) == 8 for b in fake.bodies)


def test_multi_turn_sends_replies_back_and_counts_tokens_without_usage():
    fake = FakeServer(with_usage=False)
    with fake as url:
        results, _ = _run(
            url,
            LoadPoint(num_prompts=2),
            DatasetSpec("multi-turn", input_len=6, output_len=3, turns=3),
            endpoint="/v1/chat/completions",
            warmup=0,
        )
    assert len(results) == 6 and all(r.success and r.text == "yyy" for r in results)
    assert all(r.output_tokens is None for r in results)  # summarize() counts them from the text
    third_turns = [b["messages"] for b in fake.bodies if len(b["messages"]) == 5]
    assert len(third_turns) == 2
    assert all(m[1] == m[3] == {"role": "assistant", "content": "yyy"} for m in third_turns)


def test_duration_bounds_the_run_and_failed_warmup_stops_it():
    with FakeServer() as url:
        results, duration = _run(
            url,
            LoadPoint(max_concurrency=2, num_prompts=None, duration_s=0.3),
            DatasetSpec(input_len=4, output_len=2),
            warmup=0,
            fresh_connection=True,
        )
    assert results and all(r.success for r in results) and duration < 5
    with FakeServer(fail=True) as url, pytest.raises(BenchError, match="HTTP 400"):
        _run(url, LoadPoint(num_prompts=2), DatasetSpec(input_len=4, output_len=2))


def test_load_point_checks():
    with pytest.raises(ValueError, match="num-prompts"):
        LoadPoint(num_prompts=None)
    with pytest.raises(ValueError, match="max-concurrency"):
        LoadPoint(num_prompts=None, duration_s=1.0)


def test_main_sweep_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    with FakeServer() as url:
        bench_main.main(
            [
                "--base-url",
                url + "/v1",
                "--num-prompts",
                "4",
                "--random-input-len",
                "8",
                "--random-output-len",
                "4",
                "--prompt-as-token-ids",
                "--sweep-concurrency",
                "1,2",
                "--goodput",
                "ttft:10000",
                "--result-json",
                str(out),
                "--no-progress",
                "--label",
                "fake",
            ]
        )
    data = json.loads(out.read_text())
    assert data["label"] == "fake" and data["config"]["model"] == "fake-model"
    assert [p["max_concurrency"] for p in data["points"]] == [1, 2]
    for point in data["points"]:
        s = point["summary"]
        assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (4, 0, 16, 32)
        assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert "Output token throughput" in capsys.readouterr().out


def test_server_root():
    assert bench_main.server_root("http://h:1/v1/") == "http://h:1"
    assert bench_main.server_root("http://h:1") == "http://h:1"
