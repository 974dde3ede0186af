"""`pagemesh bench --endpoint /v1/images/generations`: load for any OpenAI-compatible image server.

Each request is one `POST /v1/images/generations` (not streamed) with OpenAI's fields (`prompt`,
`n`, `size` when given, `response_format`, `model` when given); the extras vLLM-Omni and SGLang
users pass (`num_inference_steps`, `sampler`, `guidance_scale`, `negative_prompt`, `seed`) go
only when their flag is given, so a server that knows none of them is measured as it is.
Arrivals, the concurrency cap and the bounds are the text mode's (`runner.launch_at_arrivals`).

    pagemesh bench --base-url http://127.0.0.1:8000 --endpoint /v1/images/generations \\
        --num-inference-steps 50 --max-concurrency 16 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pagemesh.bench.loadgen.client import new_session
from pagemesh.bench.loadgen.metrics import summarize_images
from pagemesh.bench.loadgen.progress import progress_bar
from pagemesh.bench.loadgen.report import format_image_summary, plot_sweep, write_json
from pagemesh.bench.loadgen.runner import BenchError, LoadPoint, launch_at_arrivals

IMAGES_ENDPOINT = "/v1/images/generations"
DIGIT_TEMPLATE = "a handwritten {digit}"
RESPONSE_FORMATS = ("b64_json", "url", "none")


def add_image_arguments(add) -> None:
    """The images mode's own flags (`add(flag, default, ...)` as main's)."""
    add("--image-prompt", DIGIT_TEMPLATE, help="prompt template; {digit} cycles 0-9 (a seeded shuffle per ten)")
    add("--image-prompt-file", None, help="prompts, one a line, cycled in order (instead of --image-prompt)")
    add("--n", 1, type=int, help="images per request")
    add("--size", None, help="WIDTHxHEIGHT (default: the server's)")
    add("--response-format", "b64_json", choices=RESPONSE_FORMATS, help="none: leave the field out")
    add("--num-inference-steps", None, help="steps, or a comma list cycled per request (an extra)")
    add("--sampler", None, help="an extra, e.g. ddim; a comma list is cycled by request index")
    add("--guidance-scale", None, type=float, help="an extra")
    add("--negative-prompt", None, help="an extra")
    add("--image-seed", None, type=int, help="the k-th request sent (warm-ups first) gets seed IMAGE_SEED+k")


def image_prompts(template: str = DIGIT_TEMPLATE, prompt_file: str | None = None, seed: int = 0) -> Iterator[str]:
    """Endless prompts: a file's non-blank lines in order, cycled; else `template` with `{digit}`
    filled, each ten prompts a seeded shuffle of 0-9 (so every digit comes equally often)."""
    if prompt_file is not None:
        lines = [line.strip() for line in Path(prompt_file).read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"image-prompt-file: {prompt_file} has no prompts")
        return itertools.cycle(lines)
    try:
        template.format(digit=0)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"image-prompt: {template!r}: only {{digit}} can be filled in ({e})") from None
    rng = random.Random(seed)

    def prompts() -> Iterator[str]:
        while True:
            digits = list(range(10))
            rng.shuffle(digits)
            yield from (template.format(digit=d) for d in digits)

    return prompts()


def parse_steps(text: str | None) -> tuple[int, ...]:
    """'50' -> (50,); '10,50' -> (10, 50); None -> () (the server's default)."""
    if text is None:
        return ()
    try:
        steps = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"num-inference-steps: {text!r}: expected integers, comma-separated") from None
    if not steps or min(steps) < 1:
        raise ValueError(f"num-inference-steps: {text!r}: each must be >= 1")
    return steps


@dataclass(frozen=True)
class ImageTarget:
    """The server and what each image request asks of it. None / () leaves a field out."""

    url: str  # base URL + /v1/images/generations
    model: str | None = None
    n: int = 1
    size: str | None = None
    response_format: str | None = "b64_json"
    num_inference_steps: tuple[int, ...] = ()  # cycled by request index
    sampler: str | None = None  # a comma list is cycled by request index
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None  # request k gets seed + k
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    fresh_connection: bool = False
    timeout_s: float = 600.0
    warmup: int = 1
    progress: bool = True


def image_request_body(target: ImageTarget, prompt: str, index: int) -> dict:
    """The JSON body of the `index`-th request sent (warm-ups count from 0 too)."""
    body: dict = {"prompt": prompt, "n": target.n}
    optional = {
        "model": target.model,
        "size": target.size,
        "response_format": target.response_format,
        "sampler": _cycled(target.sampler.split(","), index) if target.sampler else None,
        "guidance_scale": target.guidance_scale,
        "negative_prompt": target.negative_prompt,
        "seed": None if target.seed is None else target.seed + index,
        "num_inference_steps": _cycled(target.num_inference_steps, index) if target.num_inference_steps else None,
    }
    body |= {k: v for k, v in optional.items() if v is not None}
    return body | target.extra_body


def _cycled(values, index: int):
    return values[index % len(values)]


@dataclass
class ImageResult:
    """What one image request measured. `status` 0: no HTTP answer (connection error, timeout).
    The server's queue and compute times come from `usage` when it sends them."""

    success: bool = False
    status: int = 0
    error: str = ""
    start: float = 0.0  # perf_counter at send
    latency: float = 0.0  # to the last byte of the answer
    images: int = 0
    queue_time_s: float | None = None
    compute_time_s: float | None = None
    batched_with: int | None = None


def read_image_answer(result: ImageResult, status: int, text: str) -> ImageResult:
    """Fills `result` from an HTTP answer: 200 with a `data` list of images is a success."""
    result.status = status
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if status != 200:
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        result.error = f"HTTP {status}: {message if isinstance(message, str) else text[:500]}"
        return result
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data:
        result.error = "HTTP 200 without images (no `data` list)"
        return result
    if not all(isinstance(d, dict) and (d.get("b64_json") or d.get("url")) for d in data):
        result.error = "HTTP 200 with an entry of `data` that has neither b64_json nor url"
        return result
    result.success, result.images = True, len(data)
    usage = body.get("usage")
    if isinstance(usage, dict):
        result.queue_time_s = _number(usage.get("queue_time_s"))
        result.compute_time_s = _number(usage.get("compute_time_s"))
        batched = usage.get("batched_with")
        result.batched_with = batched if isinstance(batched, int) and not isinstance(batched, bool) else None
    return result


def _number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


async def post_image(session: aiohttp.ClientSession, target: ImageTarget, body: dict) -> ImageResult:
    """One request; errors are recorded in the result, not raised."""
    result = ImageResult(start=time.perf_counter())
    try:
        async with session.post(target.url, json=body, headers=target.headers) as response:
            text = await response.text()
            result.latency = time.perf_counter() - result.start
            return read_image_answer(result, response.status, text)
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        result.latency = time.perf_counter() - result.start
        result.error = f"{type(e).__name__}: {e}"
        return result


async def run_image_point(
    target: ImageTarget, load: LoadPoint, prompts: Iterator[str], desc: str = "bench"
) -> tuple[list[ImageResult], float]:
    """Warm-up requests, then the load; returns every measured request's result and the wall time."""
    sent = itertools.count()
    async with new_session(fresh_connection=target.fresh_connection, timeout_s=target.timeout_s) as session:

        async def one() -> ImageResult:
            return await post_image(session, target, image_request_body(target, next(prompts), next(sent)))

        for _ in range(target.warmup):
            warm = await one()
            if not warm.success:
                raise BenchError(f"warm-up request failed: {warm.error}")
        bar = progress_bar(load.num_prompts, desc, target.progress)

        async def measured() -> ImageResult:
            result = await one()
            bar.update(1)
            return result

        start = time.perf_counter()
        results = await launch_at_arrivals(load, start, measured)
        duration = time.perf_counter() - start
        bar.close()
    return results, duration


def image_target(args: argparse.Namespace, root: str, headers: dict, extra_body: dict) -> ImageTarget:
    if args.n < 1:
        raise ValueError("n: must be >= 1")
    return ImageTarget(
        url=root + IMAGES_ENDPOINT,
        model=args.model,
        n=args.n,
        size=args.size,
        response_format=None if args.response_format == "none" else args.response_format,
        num_inference_steps=parse_steps(args.num_inference_steps),
        sampler=args.sampler,
        guidance_scale=args.guidance_scale,
        negative_prompt=args.negative_prompt,
        seed=args.image_seed,
        extra_body=extra_body,
        headers=headers,
        fresh_connection=args.fresh_connection,
        timeout_s=args.request_timeout,
        warmup=args.warmup,
        progress=not args.no_progress,
    )


def run_images(
    args: argparse.Namespace,
    target: ImageTarget,
    sweep_name: str | None,
    points: list[tuple[float | None, LoadPoint]],
    percentiles: list[float],
) -> dict:
    """Every point of an images run; returns what is written to --result-json."""
    image_prompts(args.image_prompt, args.image_prompt_file, args.seed)  # a bad template fails before any load
    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    config |= {"url": target.url, "date": datetime.datetime.now().isoformat(timespec="seconds")}
    out: dict = {"label": args.label, "config": config, "points": []}
    name = args.label or args.model or "images"
    for value, load in points:
        desc = f"{sweep_name}={value:g}" if sweep_name else "bench"
        prompts = image_prompts(args.image_prompt, args.image_prompt_file, args.seed)  # the same work at each point
        results, duration = asyncio.run(run_image_point(target, load, prompts, desc))
        summary = summarize_images(results, duration, percentiles)
        title = f"{name} {desc}" if sweep_name else (args.label or "Image serving benchmark result")
        print(format_image_summary(summary, title), flush=True)
        out["points"].append(
            {
                "sweep_value": value,
                "request_rate": load.request_rate,
                "max_concurrency": load.max_concurrency,
                "summary": summary,
                "errors": sorted({r.error for r in results if not r.success})[:20],
                "requests": {
                    "statuses": [r.status for r in results],
                    "latencies": [r.latency for r in results],
                    "images": [r.images for r in results],
                    "queue_times": [r.queue_time_s for r in results],
                    "compute_times": [r.compute_time_s for r in results],
                    "batched_with": [r.batched_with for r in results],
                    "errors": [r.error for r in results],
                },
            }
        )
    if args.result_json:
        write_json(args.result_json, out)
    if sweep_name:
        plot = args.plot or (str(Path(args.result_json).with_suffix(".png")) if args.result_json else "bench_sweep.png")
        steps = f", {args.num_inference_steps} steps" if args.num_inference_steps else ""
        plot_sweep(
            out["points"],
            plot,
            sweep_name,
            f"{name}: n={args.n}{steps}",
            x=("image_throughput", "images/s"),
            metrics=("e2el",),
        )
        out["plot"] = plot
        print(f"plot: {plot}")
    return out
