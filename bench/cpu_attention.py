"""The C decode attention (`pagemesh.kernels.cpu.paged_attention`) on K/V that comes from memory.

    python bench/cpu_attention.py [--batch 32] [--context 137] [--layers 30] [--threads 2]

One decode row per sequence (SmolLM2-135M's shape: 9 query heads, 3 KV heads, head_dim 64,
bf16, pages of 16 tokens in a shuffled order). `--layers` KV pools are visited in turn, as a
step visits its layers, so with the default 30 the K/V of a call is no longer in cache when its
turn comes back; `--layers 1` measures the same call with its data cached. Prints the best of 7
passes per call and the K/V bytes read per second.
"""

from __future__ import annotations

import argparse
import time

import torch

import pagemesh.kernels.cpu

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=137)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not pagemesh.kernels.cpu.available():
        raise SystemExit(f"C kernels unavailable: {pagemesh.kernels.cpu.load_error()}")
    pages_per_seq = -(-args.context // PAGE)
    num_pages = max(600, args.batch * pages_per_seq + 8)
    gen = torch.Generator().manual_seed(0)
    pools = [
        torch.randn(num_pages, 2, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        for _ in range(args.layers)
    ]
    tables = torch.randperm(num_pages, generator=gen)[: args.batch * pages_per_seq].view(args.batch, -1)
    tables = tables.to(torch.int32).contiguous()
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    starts = torch.arange(args.batch + 1, dtype=torch.int32)
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)

    def one_pass():
        for kv in pools:
            pagemesh.kernels.cpu.paged_attention(q, kv, tables, seq_lens, starts, HEAD_DIM**-0.5)

    for _ in range(3):
        one_pass()
    reps = max(1, 300 // args.layers)
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(reps):
            one_pass()
        best = min(best, (time.perf_counter() - t0) / reps / args.layers)
    kv_bytes = args.batch * args.context * 2 * KV_HEADS * HEAD_DIM * 2
    print(
        f"batch {args.batch} x {args.context} tokens, {args.layers} pools, {torch.get_num_threads()} threads: "
        f"{best * 1e6:.1f} us per call, {kv_bytes / best / 1e9:.1f} GB/s of K/V"
    )


if __name__ == "__main__":
    main()
