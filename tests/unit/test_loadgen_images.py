"""pagemesh.bench.loadgen.images: prompts, request bodies, answers and summaries with exact numbers; the
runner and `pagemesh bench --endpoint /v1/images/generations` against a fake image server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import pytest
from aiohttp import web

from pagemesh.bench.loadgen import main as bench_main
from pagemesh.bench.loadgen.images import (
    ImageResult,
    ImageTarget,
    image_prompts,
    image_request_body,
    parse_steps,
    read_image_answer,
    run_image_point,
)
from pagemesh.bench.loadgen.metrics import summarize_images
from pagemesh.bench.loadgen.report import format_image_summary
from pagemesh.bench.loadgen.runner import BenchError, LoadPoint


def _take(it, k):
    return [next(it) for _ in range(k)]


def test_digit_prompts_cover_each_digit_once_per_ten_and_repeat_with_the_seed():
    prompts = _take(image_prompts("a handwritten {digit}", seed=3), 30)
    for k in range(3):
        assert sorted(prompts[10 * k : 10 * k + 10]) == [f"a handwritten {d}" for d in range(10)]
    assert prompts[:10] != prompts[10:20]  # each ten is its own shuffle
    assert _take(image_prompts("a handwritten {digit}", seed=3), 30) == prompts
    assert _take(image_prompts("a handwritten {digit}", seed=4), 30) != prompts
    assert _take(image_prompts("a cat", seed=0), 3) == ["a cat"] * 3
    with pytest.raises(ValueError, match=r"only \{digit\}"):
        image_prompts("a {colour} {digit}")


def test_prompt_file_is_cycled_in_order(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a handwritten 1\n\n  the digit two \na 3\n")
    assert _take(image_prompts(prompt_file=str(path)), 5) == [
        "a handwritten 1",
        "the digit two",
        "a 3",
        "a handwritten 1",
        "the digit two",
    ]
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="no prompts"):
        image_prompts(prompt_file=str(tmp_path / "empty.txt"))


def test_parse_steps():
    assert parse_steps(None) == ()
    assert parse_steps("50") == (50,)
    assert parse_steps("10, 50") == (10, 50)
    for bad in ("0", "ten", ""):
        with pytest.raises(ValueError, match="num-inference-steps"):
            parse_steps(bad)


def test_body_has_only_openai_fields_unless_extras_are_asked_for():
    assert image_request_body(ImageTarget(url="u"), "a 7", 5) == {
        "prompt": "a 7",
        "n": 1,
        "response_format": "b64_json",
    }
    assert image_request_body(ImageTarget(url="u", response_format=None), "a 7", 0) == {"prompt": "a 7", "n": 1}
    target = ImageTarget(
        url="u",
        model="digits",
        n=2,
        size="64x64",
        num_inference_steps=(10, 50),
        sampler="ddim",
        guidance_scale=0.0,  # a zero is sent, not dropped
        negative_prompt="a 1",
        seed=100,
        extra_body={"n": 3, "eta": 0.5},
    )
    assert image_request_body(target, "a 7", 3) == {
        "prompt": "a 7",
        "n": 3,  # extra_body wins
        "model": "digits",
        "size": "64x64",
        "response_format": "b64_json",
        "sampler": "ddim",
        "guidance_scale": 0.0,
        "negative_prompt": "a 1",
        "seed": 103,
        "num_inference_steps": 50,
        "eta": 0.5,
    }
    assert [image_request_body(target, "p", k)["num_inference_steps"] for k in range(4)] == [10, 50, 10, 50]
    mixed = ImageTarget(url="u", sampler="ddim,euler,dpmsolver++")
    assert [image_request_body(mixed, "p", k)["sampler"] for k in range(4)] == ["ddim", "euler", "dpmsolver++", "ddim"]


def _answer(status, body):
    return read_image_answer(ImageResult(), status, body if isinstance(body, str) else json.dumps(body))


def test_reading_answers():
    ok = _answer(
        200,
        {
            "created": 1,
            "data": [{"b64_json": "iVBO"}, {"b64_json": "iVBO"}],
            "usage": {"queue_time_s": 0.25, "compute_time_s": 1, "batched_with": 3},
        },
    )
    assert (ok.success, ok.status, ok.images, ok.error) == (True, 200, 2, "")
    assert (ok.queue_time_s, ok.compute_time_s, ok.batched_with) == (0.25, 1.0, 3)
    plain = _answer(200, {"created": 1, "data": [{"url": "https://x/1.png"}]})  # OpenAI's own: no timings
    assert (plain.success, plain.images, plain.queue_time_s, plain.compute_time_s) == (True, 1, None, None)
    bad = _answer(400, {"error": {"message": "prompt: says no digit", "type": "invalid_request_error"}})
    assert (bad.success, bad.status, bad.error) == (False, 400, "HTTP 400: prompt: says no digit")
    full = _answer(503, "busy")
    assert (full.success, full.status, full.error) == (False, 503, "HTTP 503: busy")
    assert _answer(200, {"data": []}).error == "HTTP 200 without images (no `data` list)"
    assert not _answer(200, {"data": [{"revised_prompt": "x"}]}).success
    assert not _answer(200, "not json").success


def _result(latency, images=1, status=200, queue=None, compute=None):
    ok = status == 200
    return ImageResult(
        success=ok,
        status=status,
        latency=latency,
        images=images if ok else 0,
        queue_time_s=queue,
        compute_time_s=compute,
    )


def test_image_summary_numbers():
    results = [
        _result(0.1, 2, queue=0.0, compute=0.1),
        _result(0.2, 2, queue=0.1, compute=0.1),
        _result(0.3, 2),  # a request without usage timings
        _result(0.0, status=503),
        _result(0.0, status=503),
        _result(0.0, status=0),
    ]
    s = summarize_images(results, 2.0, percentiles=[50, 90, 99])
    assert (s["completed"], s["failed"], s["failed_by_status"], s["total_images"]) == (3, 3, {"0": 1, "503": 2}, 6)
    assert (s["request_throughput"], s["image_throughput"]) == pytest.approx((1.5, 3.0))
    # E2EL 100, 200, 300 ms: p90 at rank 1.8, p99 at 1.98.
    assert [s[f"{k}_e2el_ms"] for k in ("mean", "median", "p50", "p90", "p99")] == pytest.approx(
        [200, 200, 200, 280, 298]
    )
    # Queue/compute only over the two requests that reported them.
    assert [s[k] for k in ("mean_queue_ms", "p50_queue_ms", "p99_queue_ms")] == pytest.approx([50, 50, 99])
    assert s["mean_compute_ms"] == pytest.approx(100)
    text = format_image_summary(s, "digits")
    assert "HTTP 503" in text and "no answer" in text and "Image throughput (images/s)" in text
    assert "P99 QUEUE (ms)" in text and "P90 E2EL (ms)" in text
    bare = summarize_images([_result(0.1)], 1.0)
    assert "mean_queue_ms" not in bare and "Server queue time" not in format_image_summary(bare, "openai")
    with pytest.raises(ValueError, match="positive"):
        summarize_images(results, 0.0)


class FakeImageServer:
    """Answers each request after `delay` s with `n` images and usage timings; records the bodies
    and the most requests it held at once. Every `full_every`-th request gets a 503."""

    def __init__(self, delay: float = 0.02, full_every: int = 0):
        self.delay, self.full_every = delay, full_every
        self.bodies: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.full_every and len(self.bodies) % self.full_every == 0:
            error = {"error": {"message": "queue full", "type": "service_unavailable"}}
            return web.json_response(error, status=503, headers={"Retry-After": "1"})
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        usage = {"images": body["n"], "queue_time_s": 0.0, "compute_time_s": self.delay}
        return web.json_response({"created": 0, "data": [{"b64_json": "iVBO"}] * body["n"], "usage": usage})

    def __enter__(self) -> str:
        self.thread.start()
        app = web.Application()
        app.router.add_post("/v1/images/generations", self._generate)
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


def test_runner_caps_concurrency_sends_warmups_first_and_tallies_503s():
    fake = FakeImageServer(full_every=4)
    with fake as url:
        target = ImageTarget(url=url + "/v1/images/generations", n=2, seed=10, warmup=1, progress=False)
        results, duration = asyncio.run(
            run_image_point(target, LoadPoint(max_concurrency=3, num_prompts=12), image_prompts(seed=0))
        )
    assert len(results) == 12 and len(fake.bodies) == 13 and duration > 0
    assert fake.most_in_flight == 3
    # The k-th request sent (the warm-up first) has seed 10+k and the k-th prompt, whatever order
    # concurrent requests reach the server in.
    assert fake.bodies[0]["seed"] == 10
    expected = dict(zip(range(10, 23), _take(image_prompts(seed=0), 13)))
    assert {body["seed"]: body["prompt"] for body in fake.bodies} == expected
    assert Counter(r.status for r in results) == {200: 9, 503: 3}  # bodies 4, 8, 12 (the warm-up is body 1)
    assert all(r.images == 2 and r.compute_time_s == 0.02 for r in results if r.success)
    with FakeImageServer(full_every=1) as url, pytest.raises(BenchError, match="HTTP 503: queue full"):
        target = ImageTarget(url=url + "/v1/images/generations", progress=False)
        asyncio.run(run_image_point(target, LoadPoint(num_prompts=2), image_prompts()))


def test_main_images_sweep_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "images.json"
    fake = FakeImageServer()
    with fake as url:
        bench_main.main(
            [
                "--base-url",
                url + "/v1",
                "--endpoint",
                "/v1/images/generations",
                "--num-prompts",
                "4",
                "--num-inference-steps",
                "10",
                "--sweep-concurrency",
                "1,2",
                "--result-json",
                str(out),
                "--no-progress",
            ]
        )
    data = json.loads(out.read_text())
    assert [p["max_concurrency"] for p in data["points"]] == [1, 2]
    for point in data["points"]:
        s = point["summary"]
        assert (s["completed"], s["failed"], s["total_images"]) == (4, 0, 4) and s["image_throughput"] > 0
        assert point["requests"]["statuses"] == [200] * 4 and point["requests"]["compute_times"] == [0.02] * 4
    # No model, seed or sampler unless asked; the same prompts at each point (warm-up + 4 each).
    assert all(set(b) == {"prompt", "n", "response_format", "num_inference_steps"} for b in fake.bodies)
    assert sorted(b["prompt"] for b in fake.bodies[:5]) == sorted(b["prompt"] for b in fake.bodies[5:])
    assert (tmp_path / "images.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "Image throughput (images/s)" in printed and "Server compute time (usage)" in printed
