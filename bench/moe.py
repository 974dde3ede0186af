"""Mixture-of-experts figures from one run (issue 30), on random-weight checkpoints made here:

  1. decode tok/s of a Mixtral-shaped MoE (8 experts, top 2) against a dense Llama with the same
     active parameters (its MLP as wide as two experts), at 1 and 32 streams, through the Engine;
  2. the grouped expert path (routes sorted by expert, one GEMM per expert) against a per-expert
     loop that finds each expert's routes by comparison (transformers' way), at 1, 32 and 512 rows;
  3. expert parallelism against tensor parallelism at -tp 2 (decode tok/s at 1 and 32 streams).

    python bench/moe.py [--dtype float32] [--steps 16]

Each engine runs in a child process of its own (a tensor-parallel engine's process group is one
per process); the parent prints every figure and the ratios. Weights are random (routing is
whatever random routers choose: near-uniform over the experts).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagemesh.common.python_command import python_module

SHAPE = dict(
    vocab_size=2048,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
EXPERTS, TOP_K, EXPERT_INTER = 8, 2, 512
PROMPT_LEN = 32


def make_checkpoints(root: Path) -> dict[str, Path]:
    """Random Mixtral and dense Llama folders with equal active parameters per token."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    folders = {}
    for name, model in (
        ("moe", MixtralForCausalLM(MixtralConfig(**SHAPE, intermediate_size=EXPERT_INTER, num_local_experts=EXPERTS))),
        ("dense", LlamaForCausalLM(LlamaConfig(**SHAPE, intermediate_size=TOP_K * EXPERT_INTER))),
    ):
        folders[name] = root / name
        model.save_pretrained(folders[name], safe_serialization=True)
    return folders


def decode_rate(folder: str, dtype: str, streams: int, steps: int, tp: int, expert_parallel: bool) -> float:
    """Decode tokens per second of `streams` sequences decoding together (their fastest step:
    the figure least disturbed by other load on a shared machine)."""
    import random

    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    engine = Engine(
        EngineConfig(
            model=folder,
            dtype=dtype,
            num_pages=512,
            max_num_seqs=streams,
            enable_prefix_caching=False,
            tensor_parallel_size=tp,
            enable_expert_parallel=expert_parallel,
        )
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(streams):
        engine.add_request(str(i), [rng.randrange(1, SHAPE["vocab_size"]) for _ in range(PROMPT_LEN)], params)
    while engine.stats.decode_tokens < streams:
        engine.step()
    for _ in range(2):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return streams / min(times)


# (experts, top k, expert intermediate) of the expert-path comparison: the bench model's (Mixtral's
# 8 x top 2) and Qwen3-30B-A3B's 128 x top 8 at the bench's width
EXPERT_SHAPES = ((EXPERTS, TOP_K, EXPERT_INTER), (128, 8, 192))


def expert_paths(
    dtype: torch.dtype, rows: int, experts: int, top_k: int, inter: int, iters: int = 20
) -> tuple[float, float]:
    """(grouped ms, per-expert loop ms) for `rows` tokens through `experts` experts."""
    from pagemesh.workers.model.moe import grouped_experts, per_expert_loop, route

    gen = torch.Generator().manual_seed(rows)
    hidden = SHAPE["hidden_size"]
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(dtype)
    weights, ids = route(torch.randn(rows, experts, generator=gen), top_k, True)
    paths = (grouped_experts, per_expert_loop)
    times: list[list[float]] = [[], []]
    for i in range(iters + 3):  # interleaved, so that a burst of other load hits both alike
        for path, spent in zip(paths, times):
            start = time.perf_counter()
            path(x, w13, w2, weights, ids)
            if i >= 3:
                spent.append(time.perf_counter() - start)
    return min(times[0]) * 1e3, min(times[1]) * 1e3


def child(args) -> None:
    torch.set_num_threads(args.threads)
    rate = decode_rate(args.folder, args.dtype, args.streams, args.steps, args.tp, args.expert_parallel)
    print("RESULT " + json.dumps({"tok_s": rate}), flush=True)


def run_child(
    folder: Path, dtype: str, streams: int, steps: int, threads: int, tp: int = 1, expert_parallel: bool = False
) -> float:
    argv = [*python_module("pagemesh.bench.moe"), "--child", "--folder", str(folder), "--dtype", dtype]
    argv += ["--streams", str(streams), "--steps", str(steps), "--tp", str(tp), "--threads", str(threads)]
    argv += ["--expert-parallel"] if expert_parallel else []
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the tp-1 engines and the expert paths (ranks: 1 each)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--expert-parallel", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    torch.set_num_threads(args.threads)
    print(
        f"shapes: hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, MoE {EXPERTS} experts top "
        f"{TOP_K} x intermediate {EXPERT_INTER}; dense intermediate {TOP_K * EXPERT_INTER}; {args.dtype}; "
        f"torch threads {args.threads} (each rank 1)"
    )
    with tempfile.TemporaryDirectory(prefix="pagemesh-moe-bench-") as root:
        folders = make_checkpoints(Path(root))
        print("\n1. decode tok/s (best step), MoE vs dense of equal active parameters (Engine, tp 1)")
        for streams in (1, 32):
            moe = run_child(folders["moe"], args.dtype, streams, args.steps, args.threads)
            dense = run_child(folders["dense"], args.dtype, streams, args.steps, args.threads)
            print(f"   {streams:2d} streams: MoE {moe:8.1f}  dense {dense:8.1f}  MoE/dense {moe / dense:.2f}")
        print("\n2. expert computation, grouped vs per-expert loop (ms, best of 20, interleaved)")
        dtype = getattr(torch, args.dtype)
        for experts, top_k, inter in EXPERT_SHAPES:
            for rows in (1, 32, 512):
                grouped, loop = expert_paths(dtype, rows, experts, top_k, inter)
                print(
                    f"   {experts:3d} experts top {top_k} x {inter}, {rows:3d} rows: grouped {grouped:7.3f}  "
                    f"loop {loop:7.3f}  loop/grouped {loop / grouped:.2f}"
                )
        print("\n3. -tp 2: expert parallel vs tensor parallel (decode tok/s, best step)")
        for streams in (1, 32):
            tp = run_child(folders["moe"], args.dtype, streams, args.steps, 1, tp=2)
            ep = run_child(folders["moe"], args.dtype, streams, args.steps, 1, tp=2, expert_parallel=True)
            print(f"   {streams:2d} streams: TP {tp:8.1f}  EP {ep:8.1f}  EP/TP {ep / tp:.2f}")


if __name__ == "__main__":
    sys.exit(main())
