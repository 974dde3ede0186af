"""All the linear layers of one decode step, oneDNN against pagemesh's AMX kernel.

    python bench/linears.py [--rows 32] [--layers 30]

SmolLM2-135M's shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536 per layer, and the
49152x576 LM head), random bf16 weights packed both ways; each pass walks every weight once, so
the weights come from memory as in a served step. Prints the best of 7 passes and the bandwidth
that is (weight bytes / time).
"""

from __future__ import annotations

import argparse
import time

import torch

import pagemesh.kernels.cpu

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def best_of(fn, passes: int = 7, reps: int = 5) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    if not pagemesh.kernels.cpu.amx_available():
        raise SystemExit(
            f"no AMX here: {pagemesh.kernels.cpu.load_error() or 'the CPU or Linux does not grant AMX-BF16'}"
        )
    torch.manual_seed(0)
    dense = [torch.randn(n, k).to(torch.bfloat16) for _ in range(args.layers) for n, k in SHAPES]
    dense.append(torch.randn(*HEAD).to(torch.bfloat16))
    weight_bytes = sum(w.numel() * 2 for w in dense)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in dense]
    amx = [pagemesh.kernels.cpu.amx_pack(w) for w in dense]
    inputs = {k: torch.randn(args.rows, k).to(torch.bfloat16) for k in {k for _, k in SHAPES + [HEAD]}}
    shapes = [(w.shape[0], w.shape[1]) for w in dense]
    del dense

    def run_onednn():
        for (_, k), w in zip(shapes, onednn):
            torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")

    def run_amx():
        for (_, k), w in zip(shapes, amx):
            pagemesh.kernels.cpu.amx_linear(inputs[k], w)

    base = best_of(run_onednn)
    ours = best_of(run_amx)
    print(f"{args.rows} rows, {len(shapes)} matmuls, {weight_bytes / 1e6:.0f} MB of bf16 weights")
    print(f"  oneDNN (packed)  {base * 1e3:6.2f} ms  {weight_bytes / base / 1e9:5.1f} GB/s")
    print(f"  AMX (pagemesh)   {ours * 1e3:6.2f} ms  {weight_bytes / ours / 1e9:5.1f} GB/s  ({base / ours:.2f}x)")


if __name__ == "__main__":
    main()
