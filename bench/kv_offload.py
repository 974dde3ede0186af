"""TTFT of a long shared prefix: computed, hit in the pool, loaded from host memory, from disk.

    python -m pagemesh.bench.kv_offload [--prefix 2048] [--rounds 3] [--dtype auto]

One in-process engine of the embedded model as `pagemesh up` serves it (its GGUF blocks; or
--dtype), a pool of `--prefix` tokens' pages and a few more, and an offload tier: host memory
(--kv-offload-gb) or a disk folder alone (--kv-offload-dir, a temporary one). Each round asks for
the prefix with a fresh 16-token suffix and one output token, four ways:

    cold   a prefix the engine never saw (a new one each round): every token computed
    pool   the same prefix again: its pages are still in the pool
    host   after two other prompts of the same length pushed it out of the pool into host memory
    disk   the same with a disk tier only; and `restart`: a new engine on the same folder

TTFT is the time from `add_request` to the first token out of `step`. The order of the ways
alternates between rounds where it can (pool and host need cold first). Prints each way's
median and range, and its ratio to cold. The disk's files are read through the OS's page cache
(written seconds before); a disk that has to read them adds a page's bytes (printed) at its
read speed per page.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

PAGE = 16
SUFFIX = 16


def prompt(seed: int, length: int) -> list[int]:
    return [(1000 + 7919 * seed + 37 * i) % 40000 + 100 for i in range(length)]


def ttft(engine: Engine, rid: str, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens the prefix cache gave."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(rid, ids, params)
    first, cached = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].new_token_ids:
                first, cached = time.perf_counter() - started, out.num_cached_tokens
    return first, cached


def engine_for(args, **offload) -> Engine:
    pages = 2 * -(-(args.prefix + SUFFIX) // PAGE) + 4  # the prefix's pages and one other prompt's
    return Engine(
        EngineConfig(
            dtype=args.dtype,
            page_size=PAGE,
            num_pages=pages,
            max_model_len=args.prefix + 2 * SUFFIX,
            max_num_batched_tokens=args.prefix + SUFFIX,
            max_prefill_chunk=args.prefix + SUFFIX,
            **offload,
        )
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {k: [] for k in ("cold", "pool", "host", "disk", "restart")}
    folder = tempfile.mkdtemp(prefix="pagemesh-kv-offload-")
    host = engine_for(args, kv_offload_gb=1.0)
    disk = engine_for(args, kv_offload_dir=folder)
    page_bytes = host.runner.page_bytes
    n = 0

    def ask(engine: Engine, seed: int, want_cached: int) -> float:
        nonlocal n
        n += 1
        seconds, cached = ttft(engine, f"r{n}", prompt(seed, args.prefix) + prompt(10_000 + n, SUFFIX))
        assert cached >= want_cached, f"expected {want_cached} cached tokens, got {cached}"
        return seconds

    full = args.prefix // PAGE * PAGE
    for r in range(args.rounds):
        base = 100 * (r + 1)
        engines = [(host, "host"), (disk, "disk")] if r % 2 == 0 else [(disk, "disk"), (host, "host")]
        for engine, way in engines:
            seed = base + (way == "disk")
            times["cold"].append(ask(engine, seed, 0))
            times["pool"].append(ask(engine, seed, full))
            ask(engine, seed + 50, 0)  # two other prompts push the prefix out of the pool
            ask(engine, seed + 60, 0)
            times[way].append(ask(engine, seed, full))
        ask(disk, base + 70, 0)  # one more prefix to find after the restart, pushed out to disk
        for other in (71, 72, 73):  # the last pages of 70 are the last to go
            ask(disk, base + other, 0)
        disk.close()
        disk = engine_for(args, kv_offload_dir=folder)
        times["restart"].append(ask(disk, base + 70, full))
    host.close()
    disk.close()
    cold = statistics.median(times["cold"])
    print(f"prefix {args.prefix} tokens (+{SUFFIX}), {args.rounds} rounds, page {page_bytes / 2**10:.0f} KiB")
    print("| prefix from | TTFT median (ms) | range (ms) | × cold |")
    print("| --- | ---: | ---: | ---: |")
    for way, values in times.items():
        med = statistics.median(values)
        print(f"| {way} | {med * 1e3:.1f} | {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f} | {med / cold:.3f} |")


if __name__ == "__main__":
    main()
