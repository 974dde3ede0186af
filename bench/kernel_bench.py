"""Kernel benchmarks on one CUDA GPU; prints a markdown report (scripts/gpu_check.sh keeps it).

1. Device copy bandwidth (large `copy_`), the yardstick for the memory-bound decode.
2. Decode paged attention, bf16, 32 query / 8 kv heads, head_dim 128, page 16, over batch x
   context: achieved GB/s = (K/V bytes read + q + out) / time, as % of copy bandwidth; with the
   split-KV heuristic and with split-KV off.
3. Mixed prefill + decode batches (and a prefill-only one) against torch SDPA's flash backend on
   the same data laid out contiguously (prefills in one causal call, decodes in another), plus a
   small sweep of tile configurations to guide `choose_config`.
4. A decode sweep at the target's batch x context points: tile configurations x split counts,
   with the best cell and the heuristic's time, to guide `choose_config` / `choose_num_splits`.

Each section (each decode-sweep case) is printed as soon as it is measured, so a run cut short
keeps what it measured; past `--deadline-at` the sweeps time nothing more.
Timing: CUDA events around each call, L2 flushed (256 MB write) before each, warm-up first,
median of the repetitions. Usage: PYTHONPATH=. python bench/kernel_bench.py [--quick]

The functions take their sizes as arguments: tests/kernels/test_kernel_bench.py runs them at toy
sizes on CPU under the Triton interpreter, so a GPU session does not find this file's bugs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pagemesh.kernels.attention import AttentionConfig  # noqa: E402  (no kernel is built at import)


@dataclass(frozen=True)
class Geometry:
    """The attention shape every section measures."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page: int = 16
    dtype: torch.dtype = torch.bfloat16

    def kv_token_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype.itemsize


LLAMA3_8B = Geometry()
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [512, 2048, 4096, 8192, 16384, 32768]
# (label, decodes, decode context, prefills, prefill length); prefills are fresh prompts so
# SDPA's top-left causal mask is the right one.
MIXED_CASES = [
    ("128 decodes @ 2k + 4 prefills x 1024", 128, 2048, 4, 1024),
    ("32 decodes @ 8k + 1 prefill x 4096", 32, 8192, 1, 4096),
    ("64 decodes @ 4k + 2 prefills x 2048", 64, 4096, 2, 2048),
    ("prefill only: 8 x 2048", 0, 0, 8, 2048),
]
MIXED_CONFIGS = [
    AttentionConfig(64, 64, 4, 2),
    AttentionConfig(64, 64, 4, 3),
    AttentionConfig(128, 64, 8, 2),
    AttentionConfig(128, 32, 8, 3),
    AttentionConfig(64, 32, 4, 3),
]
# (batch, context) points of the decode target, and the tile shapes and split counts to try.
DECODE_SWEEP_CASES = [(1, 32768), (32, 4096), (32, 16384), (128, 4096), (256, 4096)]
DECODE_CONFIGS = [
    AttentionConfig(16, 32, 4, 3),
    AttentionConfig(16, 64, 4, 3),
    AttentionConfig(16, 64, 4, 4),
    AttentionConfig(16, 128, 4, 2),
    AttentionConfig(16, 64, 8, 3),
]
SPLIT_COUNTS = [1, 2, 4, 8, 16]


class Timer:
    """Median milliseconds of `fn()` with a cold L2 before every call (CUDA events on a GPU,
    the wall clock on CPU)."""

    def __init__(self, warmup: int, reps: int, device: str = "cuda", flush_mb: int = 256):
        self.warmup, self.reps, self.device = warmup, reps, torch.device(device)
        self.flush = torch.empty(flush_mb * 2**20, dtype=torch.uint8, device=self.device)

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.reps):
                self.flush.zero_()
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize()
        events = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_bandwidth(timer: Timer, gib: float = 4.0) -> float:
    """GB/s of a device-to-device copy of `gib` GiB in all (bytes read + bytes written)."""
    src = torch.empty(int(gib * 2**29), dtype=torch.bfloat16, device=timer.device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))  # noqa: F821 - ruff misreads the `del` below as preceding the call
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    return nbytes / ms / 1e6


def make_pool(geo: Geometry, max_tokens: int, device: str, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(
        max_tokens // geo.page + 1, 2, geo.page, geo.kv_heads, geo.head_dim, dtype=geo.dtype, device=device
    ).normal_(generator=gen)


def paged_inputs(geo: Geometry, pool, query_lens, seq_lens, gen):
    """Block tables over random pool pages (fragmented like a long-running server)."""
    device = pool.device
    num_pages = pool.shape[0]
    pages_per_seq = [-(-s // geo.page) for s in seq_lens]
    pages = torch.randperm(num_pages - 1, generator=gen, device=device)[: sum(pages_per_seq)] + 1
    table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(pages_per_seq):
        table[s, :n] = pages[used : used + n].to(torch.int32)
        used += n
    starts = torch.tensor([0] + query_lens, device=device).cumsum(0).to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(query_lens), geo.heads, geo.head_dim, device=device, dtype=geo.dtype, generator=gen)
    return q, table, seq_lens_t, starts


def decode_args(geo: Geometry, pool, batch: int, ctx: int, gen) -> tuple:
    q, table, lens, starts = paged_inputs(geo, pool, [1] * batch, [ctx] * batch, gen)
    return (q, pool, table, lens, starts, geo.head_dim**-0.5, 1, ctx)


def decode_bytes(geo: Geometry, batch: int, ctx: int) -> int:
    """K/V read plus q read and the output written."""
    return batch * ctx * geo.kv_token_bytes() + 2 * batch * geo.heads * geo.head_dim * geo.dtype.itemsize


def fits(geo: Geometry, pool, batch: int, ctx: int) -> bool:
    return batch * -(-ctx // geo.page) < pool.shape[0]


def bench_decode(timer: Timer, copy_gbs: float, geo: Geometry, batches, contexts, pool, gen) -> list[str]:
    from pagemesh.kernels._util import sm_count
    from pagemesh.kernels.attention import choose_num_splits, paged_attention

    rows = [
        "| batch | context | splits | ms | GB/s | % copy BW | no-split ms | no-split % |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for batch in batches:
        for ctx in contexts:
            if not fits(geo, pool, batch, ctx):
                continue
            args = decode_args(geo, pool, batch, ctx, gen)
            splits = choose_num_splits(batch, geo.kv_heads, ctx, sm_count(pool.device))
            ms = timer(lambda: paged_attention(*args))
            ms1 = ms if splits == 1 else timer(lambda: paged_attention(*args, num_splits=1))
            nbytes = decode_bytes(geo, batch, ctx)
            gbs, gbs1 = nbytes / ms / 1e6, nbytes / ms1 / 1e6
            rows.append(
                f"| {batch} | {ctx} | {splits} | {ms:.3f} | {gbs:.0f} | "
                f"{100 * gbs / copy_gbs:.0f}% | {ms1:.3f} | {100 * gbs1 / copy_gbs:.0f}% |"
            )
    return rows


def config_label(c: AttentionConfig) -> str:
    return f"m{c.block_m} n{c.tile_n} w{c.num_warps} s{c.num_stages}"


def bench_decode_sweep(
    timer: Timer,
    copy_gbs: float,
    geo: Geometry,
    cases,
    configs,
    split_counts,
    pool,
    gen,
    deadline: float = float("inf"),
):
    """For each (batch, context), yields its lines: ms of every tile config x split count, the
    best cell, and the launcher's own choice (`choose_config` + `choose_num_splits`). Past
    `deadline` (time.time()) no cell is timed ("—") and no further case starts."""
    from pagemesh.kernels.attention import paged_attention

    for batch, ctx in cases:
        if not fits(geo, pool, batch, ctx):
            continue
        if time.time() > deadline:
            yield [f"_Sweep stopped before batch {batch} x {ctx}: out of time._", ""]
            return
        args = decode_args(geo, pool, batch, ctx, gen)
        nbytes = decode_bytes(geo, batch, ctx)
        heuristic = timer(lambda: paged_attention(*args))
        usable = [s for s in split_counts if s == 1 or ctx // s >= 64]
        rows = [
            f"| {batch} x {ctx} | " + " | ".join(f"splits {s}" for s in usable) + " |",
            "| --- |" + " ---: |" * len(usable),
        ]
        best = (float("inf"), "", 0)
        for cfg in configs:
            cells = []
            for s in usable:
                if time.time() > deadline:
                    cells.append("—")
                    continue
                ms = time_or_none(
                    timer,
                    lambda cfg=cfg, s=s: paged_attention(*args, num_splits=s, config=cfg),
                    f"{config_label(cfg)} splits {s}",
                )
                cells.append("err" if ms is None else f"{ms:.3f}")
                if ms is not None and ms < best[0]:
                    best = (ms, config_label(cfg), s)
            rows.append(f"| {config_label(cfg)} | " + " | ".join(cells) + " |")
        pct = lambda ms: f"{100 * nbytes / ms / 1e6 / copy_gbs:.0f}%"  # noqa: E731
        head = (
            f"Batch {batch}, context {ctx}: launcher's choice {heuristic:.3f} ms "
            f"({pct(heuristic)} of copy BW); best {best[1]} splits {best[2]} "
            f"{best[0]:.3f} ms ({pct(best[0])})."
            if best[1]
            else f"Batch {batch}, context {ctx}: launcher's choice {heuristic:.3f} ms; no sweep cell ran."
        )
        yield [head, ""] + rows + [""]


def flash_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def sdpa_flash(q, k, v, causal):
    """An SDPA call to run under `sdpa_kernel(FLASH_ATTENTION)`: GQA natively if the flash
    backend takes `enable_gqa`, else with K/V repeated per query head beforehand (untimed)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    with flash_only():
        try:
            sdpa(q, k, v, is_causal=causal, enable_gqa=True)
            return lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=True), "native GQA"
        except (RuntimeError, TypeError):
            group = q.shape[1] // k.shape[1]
            kr = k.repeat_interleave(group, 1).contiguous()
            vr = v.repeat_interleave(group, 1).contiguous()
            return lambda: sdpa(q, kr, vr, is_causal=causal), "K/V repeated per q head"


def mixed_case(geo: Geometry, pool, num_decodes, decode_ctx, num_prefills, prefill_len, gen):
    """Paged inputs for the batch and, for SDPA, the same K/V laid out contiguously."""
    from pagemesh.kernels.kv_write import write_kv

    device = pool.device
    query_lens = [1] * num_decodes + [prefill_len] * num_prefills
    seq_lens = [decode_ctx] * num_decodes + [prefill_len] * num_prefills
    q, table, lens, starts = paged_inputs(geo, pool, query_lens, seq_lens, gen)
    dense = {}
    for name, count, length in (("decode", num_decodes, decode_ctx), ("prefill", num_prefills, prefill_len)):
        if count:
            dense[name] = torch.randn(
                2, count, length, geo.kv_heads, geo.head_dim, device=device, dtype=geo.dtype, generator=gen
            )
    # Scatter the contiguous K/V into the sequences' pages with write_kv.
    for s, seq_len in enumerate(seq_lens):
        name, idx = ("decode", s) if s < num_decodes else ("prefill", s - num_decodes)
        kv = dense[name][:, idx]
        pos = torch.arange(seq_len, device=device)
        slots = table[s, pos // geo.page].long() * geo.page + pos % geo.page
        write_kv(kv[0], kv[1], pool, slots)
    return (
        query_lens,
        seq_lens,
        (q, pool, table, lens, starts, geo.head_dim**-0.5, max(query_lens), max(seq_lens)),
        dense,
    )


def bench_mixed(timer: Timer, geo: Geometry, cases, configs, pool, gen, deadline: float = float("inf")) -> list[str]:
    """Our one launch against SDPA flash per case; `configs` (may be empty): a tile sweep, whose
    cells past `deadline` (time.time()) are not timed ("—")."""
    from pagemesh.kernels.attention import paged_attention

    rows = [
        "| batch | ours ms | SDPA flash ms | ours / SDPA | max abs diff | SDPA GQA |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    sweep_rows = [
        "| batch | " + " | ".join(config_label(c) for c in configs) + " |",
        "| --- |" + " ---: |" * len(configs),
    ]
    for label, n_dec, dec_ctx, n_pre, pre_len in cases:
        query_lens, _, args, dense = mixed_case(geo, pool, n_dec, dec_ctx, n_pre, pre_len, gen)
        q = args[0]
        calls, reference = [], []
        if n_dec:
            qd = q[:n_dec].unsqueeze(2)  # [B, H, 1, D]
            kd, vd = (dense["decode"][i].transpose(1, 2) for i in (0, 1))  # [B, KVH, L, D]
            fn, gqa = sdpa_flash(qd, kd, vd, causal=False)
            calls.append(fn)
            reference.append(lambda fn=fn: fn().squeeze(2))
        if n_pre:
            qp = q[n_dec:].view(n_pre, pre_len, geo.heads, geo.head_dim).transpose(1, 2)
            kp, vp = (dense["prefill"][i].transpose(1, 2) for i in (0, 1))
            fn, gqa = sdpa_flash(qp, kp, vp, causal=True)
            calls.append(fn)
            reference.append(lambda fn=fn: fn().transpose(1, 2).reshape(-1, geo.heads, geo.head_dim))
        ours_ms = timer(lambda: paged_attention(*args))
        with flash_only():
            sdpa_ms = timer(lambda: [c() for c in calls])
            expect = torch.cat([r() for r in reference])
        diff = (paged_attention(*args).float() - expect.float()).abs().max().item()
        rows.append(f"| {label} | {ours_ms:.3f} | {sdpa_ms:.3f} | {ours_ms / sdpa_ms:.2f}x | {diff:.2e} | {gqa} |")
        if configs:
            cells = []
            for c in configs:
                if time.time() > deadline:
                    cells.append("—")
                    continue
                ms = time_or_none(timer, lambda c=c: paged_attention(*args, config=c), f"{label} {config_label(c)}")
                cells.append("err" if ms is None else f"{ms:.3f}")
            sweep_rows.append(f"| {label} | " + " | ".join(cells) + " |")
    if not configs:
        return rows
    return rows + ["", "Tile sweep (ms) for the same batches:", ""] + sweep_rows


def time_or_none(timer, fn, what: str) -> float | None:
    """`timer(fn)` in ms, or None for a tile config that does not compile or fit on this GPU and
    Triton (the error goes to stderr: it is a finding, not the end of the benchmark)."""
    try:
        return timer(fn)
    except Exception as exc:
        print(f"kernel_bench: {what}: {exc!r}"[:400], file=sys.stderr)
        return None


def emit(lines: list[str]) -> None:
    print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller grid, fewer repetitions, no sweeps")
    parser.add_argument(
        "--deadline-at",
        type=float,
        default=float("inf"),
        help="a time (seconds since the epoch, as `date +%%s`) after which the sweeps time nothing more",
    )
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.", file=sys.stderr)
        return 2

    started = time.time()
    geo = LLAMA3_8B
    timer = Timer(warmup=3, reps=10 if opts.quick else 30)
    batches = [1, 32, 256] if opts.quick else BATCHES
    contexts = [512, 4096, 32768] if opts.quick else CONTEXTS
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth(timer)
    pool = make_pool(geo, max(b * c for b in batches for c in contexts), "cuda", gen)
    emit(
        [
            f"Device copy bandwidth (4 GiB `copy_`, read + write): **{copy_gbs:.0f} GB/s**",
            "",
            f"### Decode attention (bf16, {geo.heads} q / {geo.kv_heads} kv heads, head_dim "
            f"{geo.head_dim}, page {geo.page}; target >= 80% of copy BW at context >= 4k, batch >= 32)",
            "",
        ]
    )
    emit(bench_decode(timer, copy_gbs, geo, batches, contexts, pool, gen))
    emit(["", "### Mixed prefill + decode vs torch SDPA flash (target <= 1.3x)", ""])
    emit(bench_mixed(timer, geo, MIXED_CASES, [] if opts.quick else MIXED_CONFIGS, pool, gen, opts.deadline_at))
    if opts.quick:
        emit(["", "_--quick: no tile sweeps._"])
    else:
        emit(["", "### Decode sweep: tile config x split count (ms; cold L2, median of 5)", ""])
        for lines in bench_decode_sweep(
            Timer(warmup=2, reps=5),
            copy_gbs,
            geo,
            DECODE_SWEEP_CASES,
            DECODE_CONFIGS,
            SPLIT_COUNTS,
            pool,
            gen,
            opts.deadline_at,
        ):
            emit(lines)
    emit(["", f"_kernel_bench ran in {time.time() - started:.0f} s._"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
