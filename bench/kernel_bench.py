"""Kernel benchmarks on one CUDA GPU; prints a markdown report (scripts/gpu_check.sh keeps it).

1. Device copy bandwidth (large `copy_`), the yardstick for the memory-bound decode.
2. Decode paged attention, bf16, 32 query / 8 kv heads, head_dim 128, page 16, over batch x
   context: achieved GB/s = (K/V bytes read + q + out) / time, as % of copy bandwidth; with the
   split-KV heuristic and with split-KV off.
3. Mixed prefill + decode batches (and a prefill-only one) against torch SDPA's flash backend on
   the same data laid out contiguously (prefills in one causal call, decodes in another), plus a
   small sweep of tile configurations to guide `choose_config`.

Timing: CUDA events around each call, L2 flushed (256 MB write) before each, warm-up first,
median of the repetitions. Usage: PYTHONPATH=. python bench/kernel_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [512, 2048, 4096, 8192, 16384, 32768]


class Timer:
    """Median milliseconds of `fn()` with a cold L2 before every call."""

    def __init__(self, warmup: int, reps: int):
        self.warmup, self.reps = warmup, reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
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


def copy_bandwidth(timer: Timer) -> float:
    """GB/s of a 4 GiB device-to-device copy (bytes read + bytes written)."""
    src = torch.empty(2 * 2**30, dtype=DTYPE, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    return nbytes / ms / 1e6


def paged_inputs(pool, query_lens, seq_lens, gen):
    """Block tables over random pool pages (fragmented like a long-running server)."""
    num_pages = pool.shape[0]
    pages_per_seq = [-(-s // PAGE) for s in seq_lens]
    pages = torch.randperm(num_pages - 1, generator=gen, device=DEVICE)[: sum(pages_per_seq)] + 1
    table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32, device=DEVICE)
    used = 0
    for s, n in enumerate(pages_per_seq):
        table[s, :n] = pages[used: used + n].to(torch.int32)
        used += n
    starts = torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    return q, table, seq_lens_t, starts


def bench_decode(timer: Timer, copy_gbs: float, batches, contexts, pool, gen) -> list[str]:
    from kernels.attention import choose_num_splits, paged_attention
    from kernels._util import sm_count

    rows = ["| batch | context | splits | ms | GB/s | % copy BW | no-split ms | no-split % |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    kv_token_bytes = 2 * KV_HEADS * HEAD_DIM * pool.element_size()
    for batch in batches:
        for ctx in contexts:
            if (batch * ctx) // PAGE >= pool.shape[0]:
                continue
            q, table, lens, starts = paged_inputs(pool, [1] * batch, [ctx] * batch, gen)
            args = (q, pool, table, lens, starts, HEAD_DIM**-0.5, 1, ctx)
            splits = choose_num_splits(batch, KV_HEADS, ctx, sm_count(q.device))
            ms = timer(lambda: paged_attention(*args))
            ms1 = ms if splits == 1 else timer(lambda: paged_attention(*args, num_splits=1))
            nbytes = batch * ctx * kv_token_bytes + 2 * q.numel() * q.element_size()
            gbs, gbs1 = nbytes / ms / 1e6, nbytes / ms1 / 1e6
            rows.append(f"| {batch} | {ctx} | {splits} | {ms:.3f} | {gbs:.0f} | "
                        f"{100 * gbs / copy_gbs:.0f}% | {ms1:.3f} | {100 * gbs1 / copy_gbs:.0f}% |")
    return rows


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


def flash_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def mixed_case(pool, num_decodes, decode_ctx, num_prefills, prefill_len, gen):
    """Paged inputs for the batch and, for SDPA, the same K/V laid out contiguously."""
    from kernels.kv_write import write_kv

    query_lens = [1] * num_decodes + [prefill_len] * num_prefills
    seq_lens = [decode_ctx] * num_decodes + [prefill_len] * num_prefills
    q, table, lens, starts = paged_inputs(pool, query_lens, seq_lens, gen)
    dense = {}
    for name, count, length in (("decode", num_decodes, decode_ctx),
                                ("prefill", num_prefills, prefill_len)):
        if count:
            dense[name] = torch.randn(2, count, length, KV_HEADS, HEAD_DIM, device=DEVICE,
                                      dtype=DTYPE, generator=gen)
    # Scatter the contiguous K/V into the sequences' pages with write_kv.
    for s, seq_len in enumerate(seq_lens):
        name, idx = ("decode", s) if s < num_decodes else ("prefill", s - num_decodes)
        kv = dense[name][:, idx]
        pos = torch.arange(seq_len, device=DEVICE)
        slots = table[s, pos // PAGE].long() * PAGE + pos % PAGE
        write_kv(kv[0], kv[1], pool, slots)
    return query_lens, seq_lens, (q, pool, table, lens, starts, HEAD_DIM**-0.5,
                                  max(query_lens), max(seq_lens)), dense


# (label, decodes, decode context, prefills, prefill length); prefills are fresh prompts so
# SDPA's top-left causal mask is the right one.
MIXED_CASES = [("128 decodes @ 2k + 4 prefills x 1024", 128, 2048, 4, 1024),
               ("32 decodes @ 8k + 1 prefill x 4096", 32, 8192, 1, 4096),
               ("64 decodes @ 4k + 2 prefills x 2048", 64, 4096, 2, 2048),
               ("prefill only: 8 x 2048", 0, 0, 8, 2048)]


def bench_mixed(timer: Timer, pool, gen, sweep: bool) -> list[str]:
    from kernels.attention import AttentionConfig, paged_attention

    configs = [AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 3),
               AttentionConfig(128, 64, 8, 2), AttentionConfig(128, 32, 8, 3),
               AttentionConfig(64, 32, 4, 3)]
    cases = MIXED_CASES
    rows = ["| batch | ours ms | SDPA flash ms | ours / SDPA | max abs diff | SDPA GQA |",
            "| --- | ---: | ---: | ---: | ---: | --- |"]
    sweep_rows = ["| batch | " + " | ".join(
        f"m{c.block_m} n{c.tile_n} w{c.num_warps} s{c.num_stages}" for c in configs) + " |",
        "| --- |" + " ---: |" * len(configs)]
    for label, n_dec, dec_ctx, n_pre, pre_len in cases:
        query_lens, _, args, dense = mixed_case(pool, n_dec, dec_ctx, n_pre, pre_len, gen)
        q = args[0]
        calls, reference = [], []
        if n_dec:
            qd = q[:n_dec].unsqueeze(2)  # [B, H, 1, D]
            kd, vd = (dense["decode"][i].transpose(1, 2) for i in (0, 1))  # [B, KVH, L, D]
            fn, gqa = sdpa_flash(qd, kd, vd, causal=False)
            calls.append(fn)
            reference.append(lambda fn=fn: fn().squeeze(2))
        if n_pre:
            qp = q[n_dec:].view(n_pre, pre_len, HEADS, HEAD_DIM).transpose(1, 2)
            kp, vp = (dense["prefill"][i].transpose(1, 2) for i in (0, 1))
            fn, gqa = sdpa_flash(qp, kp, vp, causal=True)
            calls.append(fn)
            reference.append(lambda fn=fn: fn().transpose(1, 2).reshape(-1, HEADS, HEAD_DIM))
        ours_ms = timer(lambda: paged_attention(*args))
        with flash_only():
            sdpa_ms = timer(lambda: [c() for c in calls])
            expect = torch.cat([r() for r in reference])
        diff = (paged_attention(*args).float() - expect.float()).abs().max().item()
        rows.append(f"| {label} | {ours_ms:.3f} | {sdpa_ms:.3f} | {ours_ms / sdpa_ms:.2f}x | "
                    f"{diff:.2e} | {gqa} |")
        if sweep:
            cells = [f"{timer(lambda c=c: paged_attention(*args, config=c)):.3f}"
                     for c in configs]
            sweep_rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows + ([""] + ["Tile sweep (ms) for the same batches:", ""] + sweep_rows
                   if sweep else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller grid, fewer repetitions")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "nothing measured.", file=sys.stderr)
        return 2

    started = time.time()
    timer = Timer(warmup=3, reps=10 if opts.quick else 30)
    batches = [1, 32, 256] if opts.quick else BATCHES
    contexts = [512, 4096, 32768] if opts.quick else CONTEXTS
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    copy_gbs = copy_bandwidth(timer)

    max_tokens = max(b * c for b in batches for c in contexts)
    pool = torch.empty(max_tokens // PAGE + 1, 2, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE,
                       device=DEVICE).normal_(generator=gen)
    out = [f"Device copy bandwidth (4 GiB `copy_`, read + write): **{copy_gbs:.0f} GB/s**", "",
           f"### Decode attention (bf16, {HEADS} q / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
           f"page {PAGE}; target >= 80% of copy BW at context >= 4k, batch >= 32)", ""]
    out += bench_decode(timer, copy_gbs, batches, contexts, pool, gen)
    out += ["", "### Mixed prefill + decode vs torch SDPA flash (target <= 1.3x)", ""]
    out += bench_mixed(timer, pool, gen, sweep=not opts.quick)
    out += ["", f"_kernel_bench ran in {time.time() - started:.0f} s._"]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
