"""`pagemesh bench`: drive streaming load against any OpenAI-compatible server and report
TTFT, TPOT, ITL and end-to-end latency, throughputs and goodput (vLLM's serving-benchmark
definitions). One load point, or a sweep of request rates or concurrencies with a plot.
`--endpoint /v1/images/generations` loads an image server instead: images/s, latencies, and the
server's queue/compute times when its `usage` has them.

    pagemesh bench --base-url http://127.0.0.1:8000 --dataset random --random-input-len 128 \\
        --random-output-len 128 --prompt-as-token-ids --max-concurrency 8 --num-prompts 64
    pagemesh bench --base-url http://127.0.0.1:8000 --endpoint /v1/images/generations \\
        --num-inference-steps 50 --max-concurrency 16 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
import urllib.request
from pathlib import Path

from pagemesh.bench.loadgen.datasets import DATASETS, DatasetSpec, conversations
from pagemesh.bench.loadgen.images import IMAGES_ENDPOINT, add_image_arguments, image_target, run_images
from pagemesh.bench.loadgen.metrics import DEFAULT_PERCENTILES, parse_goodput, summarize
from pagemesh.bench.loadgen.report import format_summary, plot_sweep, write_json
from pagemesh.bench.loadgen.runner import BenchError, LoadPoint, Target, run_point
from pagemesh.common.model_files import resolve_model_path
from pagemesh.common.tokenizer import Tokenizer

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", IMAGES_ENDPOINT)


def _adder(parser: argparse.ArgumentParser):
    """`add(flag, default, ...)`. Plain flags, no PAGEMESH_* defaults: the bench is a client, and
    names like PAGEMESH_MODEL mean something else to the services."""

    def add(flag: str, default=None, **kwargs) -> None:
        parser.add_argument(flag, default=default, **kwargs)

    return add


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pagemesh bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = _adder(p)
    add("--base-url", None, required=False, help="server URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    add("--endpoint", "/v1/completions", choices=ENDPOINTS)
    add("--model", None, help="model name to request (default: the first of GET /v1/models; images: the server's)")
    add("--tokenizer", None, help="GGUF file or HF folder for datasets and token counts (default model)")
    add("--dataset", "random", choices=DATASETS)
    add("--random-input-len", 128, type=int)
    add("--random-output-len", 128, type=int)
    add("--random-range-ratio", 0.0, type=float, help="lengths uniform in [L*(1-r), L*(1+r)]")
    add("--shared-prefix-len", 256, type=int, help="shared-prefix: tokens of the common system prompt")
    add("--turns", 3, type=int, help="multi-turn: user turns per conversation")
    add(
        "--prompt-as-token-ids",
        False,
        action="store_true",
        help="send prompts as token ids (/v1/completions) so every server sees the same tokens",
    )
    add("--num-prompts", None, type=int, help="conversations to send (default 100 unless --duration)")
    add("--duration", None, type=float, help="stop launching new requests after this many seconds")
    add("--request-rate", math.inf, type=float, help="requests per second (inf: all at once)")
    add("--burstiness", 1.0, type=float, help="gamma shape of arrival gaps (1 = Poisson)")
    add("--max-concurrency", None, type=int)
    add("--sweep-rates", None, help="comma-separated request rates: one point each, and a plot")
    add("--sweep-concurrency", None, help="comma-separated concurrency caps: one point each, and a plot")
    p.add_argument(
        "--ignore-eos",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="force output lengths: ignore_eos + min_tokens (default on)",
    )
    add("--temperature", 0.0, type=float)
    add("--extra-body", "{}", help="JSON object merged into every request, e.g. '{\"cache_prompt\": false}'")
    add("--goodput", None, nargs="+", help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    add("--percentiles", ",".join(f"{x:g}" for x in DEFAULT_PERCENTILES))
    add("--seed", 0, type=int)
    add("--warmup", 1, type=int, help="unmeasured requests sent first")
    add("--fresh-connection", False, action="store_true", help="one TCP connection per request")
    add("--request-timeout", 600.0, type=float)
    add("--api-key", None, help="sent as a Bearer token")
    add("--label", None, help="name of the system under test, kept in the JSON")
    add("--result-json", None, help="write the results here")
    add("--plot", None, help="sweep plot PNG (default: next to --result-json, else bench_sweep.png)")
    add("--no-progress", False, action="store_true")
    add_image_arguments(_adder(p.add_argument_group(f"images ({IMAGES_ENDPOINT})")))
    args = p.parse_args(argv)
    if not args.base_url:
        p.error("--base-url is required")
    if args.sweep_rates and args.sweep_concurrency:
        p.error("give one of --sweep-rates and --sweep-concurrency")
    if args.num_prompts is None and args.duration is None:
        args.num_prompts = 100
    return args


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def server_root(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def first_model(root: str, headers: dict) -> str:
    request = urllib.request.Request(f"{root}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def sweep_points(args: argparse.Namespace) -> tuple[str | None, list[tuple[float | None, LoadPoint]]]:
    def point(rate: float, concurrency: int | None) -> LoadPoint:
        return LoadPoint(
            request_rate=rate,
            burstiness=args.burstiness,
            max_concurrency=concurrency,
            num_prompts=args.num_prompts,
            duration_s=args.duration,
            seed=args.seed,
        )

    if args.sweep_rates:
        return "rate", [(r, point(r, args.max_concurrency)) for r in _floats(args.sweep_rates)]
    if args.sweep_concurrency:
        return "concurrency", [(c, point(args.request_rate, int(c))) for c in _floats(args.sweep_concurrency)]
    return None, [(None, point(args.request_rate, args.max_concurrency))]


def run(args: argparse.Namespace) -> dict:
    """Every point of the run; returns what is written to --result-json."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    root = server_root(args.base_url)
    extra_body = json.loads(args.extra_body)
    if not isinstance(extra_body, dict):
        raise ValueError("extra-body: must be a JSON object")
    goodput = parse_goodput(args.goodput or [])
    percentiles = sorted(set(_floats(args.percentiles)) | {50.0, 99.0})
    if args.endpoint == IMAGES_ENDPOINT:
        return run_images(args, image_target(args, root, headers, extra_body), *sweep_points(args), percentiles)
    tokenizer = Tokenizer.from_path(resolve_model_path(args.tokenizer))
    model = args.model or first_model(root, headers)
    target = Target(
        url=root + args.endpoint,
        model=model,
        prompt_as_token_ids=args.prompt_as_token_ids,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=extra_body,
        headers=headers,
        fresh_connection=args.fresh_connection,
        timeout_s=args.request_timeout,
        warmup=args.warmup,
        progress=not args.no_progress,
    )
    spec = DatasetSpec(
        args.dataset,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.shared_prefix_len,
        args.turns,
        args.seed,
    )
    sweep_name, points = sweep_points(args)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    config |= {"model": model, "url": target.url, "date": datetime.datetime.now().isoformat(timespec="seconds")}
    out: dict = {"label": args.label, "config": config, "points": []}
    for value, load in points:
        desc = f"{sweep_name}={value:g}" if sweep_name else "bench"
        results, duration = asyncio.run(run_point(target, load, conversations(spec, tokenizer), tokenizer, desc))
        summary = summarize(
            results,
            duration,
            count_tokens=lambda text: len(tokenizer.encode(text, False)),
            goodput_ms=goodput or None,
            percentiles=percentiles,
        )
        title = f"{args.label or model} {desc}" if sweep_name else (args.label or "Serving benchmark result")
        print(format_summary(summary, title), flush=True)
        errors = sorted({r.error for r in results if not r.success})
        out["points"].append(
            {
                "sweep_value": value,
                "request_rate": load.request_rate,
                "max_concurrency": load.max_concurrency,
                "summary": summary,
                "errors": errors[:20],
                "requests": {
                    # send times from the point's first request: with the lengths, a trace that
                    # `pagemesh simulate --trace` replays
                    "starts": [r.start - min(x.start for x in results) for r in results],
                    # the first send on the system-wide perf_counter clock, which the workers'
                    # step traces (PAGEMESH_STEP_TRACE) also use: puts the two side by side
                    "clock_origin": min((r.start for r in results), default=0.0),
                    "input_lens": [r.prompt_len for r in results],
                    "output_lens": [r.output_tokens for r in results],
                    "ttfts": [r.ttft for r in results],
                    "latencies": [r.latency for r in results],
                    "itls": [r.itl for r in results],
                    "chunks": [r.chunks for r in results],
                    "errors": [r.error for r in results],
                },
            }
        )
    if args.result_json:
        write_json(args.result_json, out)
    if sweep_name:
        plot = args.plot or (str(Path(args.result_json).with_suffix(".png")) if args.result_json else "bench_sweep.png")
        plot_sweep(
            out["points"],
            plot,
            sweep_name,
            f"{args.label or model}: {args.dataset} {args.random_input_len} in / {args.random_output_len} out",
        )
        out["plot"] = plot
        print(f"plot: {plot}")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except (BenchError, ValueError, OSError) as e:
        print(f"pagemesh bench: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
