"""pagemesh's engine vs Hugging Face `generate` (static batches), same weights, same run.

    python bench/engine_vs_hf.py [--dtype bfloat16] [--quick]

(a) 32 prompts x 128 tokens, 128 new tokens each: static batching's best case.
(b) 128 requests, prompts 32-512 tokens, 16-256 new tokens (seeded), at most 32 at once:
    HF runs static batches of 32 in arrival order, each until its longest member is done.
Also single-stream decode tokens/s. Greedy, EOS ignored. Prints every figure; the last line is
`ratio: X` = engine / HF output tokens/s on (b).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagemesh.common.model_files import default_model_path
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

LOW_ID, HIGH_ID = 100, 49000  # ordinary tokens of SmolLM2's vocabulary


def workload_a(rng: random.Random) -> list[tuple[list[int], int]]:
    return [([rng.randrange(LOW_ID, HIGH_ID) for _ in range(128)], 128) for _ in range(32)]


def workload_b(rng: random.Random, count: int) -> list[tuple[list[int], int]]:
    return [
        ([rng.randrange(LOW_ID, HIGH_ID) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(count)
    ]


def run_engine(engine: Engine, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    started = time.perf_counter()
    results = engine.generate(
        [p for p, _ in work], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    )
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(r.token_ids[0]) for r in results)


def run_hf(model, work: list[tuple[list[int], int]], batch: int) -> tuple[float, int]:
    """Static batching: left-padded batches of `batch` in order, each run to its longest output."""
    started = time.perf_counter()
    useful = 0
    for i in range(0, len(work), batch):
        group = work[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, (p, _) in enumerate(group):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(n for _, n in group)
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        useful += sum(n for _, n in group)
    return time.perf_counter() - started, useful


def single_stream(engine: Engine, model, tokens: int) -> tuple[float, float]:
    prompt = list(range(1000, 1032))
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    ours = tokens / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    run_hf(model, [(prompt, tokens)], 1)
    theirs = tokens / (time.perf_counter() - t0)
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="(b) with 32 requests instead of 128")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    engine = Engine(
        EngineConfig(
            dtype=args.dtype,
            max_num_seqs=32,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
        )
    )
    print(f"model {path.name}, dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    run_hf(hf, [([5, 6, 7, 8], 8)], 1)

    rng = random.Random(0)
    a = workload_a(rng)
    t_e, n_e = run_engine(engine, a)
    t_h, n_h = run_hf(hf, a, 32)
    ratio_a = (n_e / t_e) / (n_h / t_h)
    print(
        f"(a) 32x128 -> 128: pagemesh {n_e / t_e:.1f} tok/s ({t_e:.1f}s), HF {n_h / t_h:.1f} tok/s ({t_h:.1f}s), "
        f"ratio {ratio_a:.2f}"
    )

    b = workload_b(random.Random(1), 32 if args.quick else 128)
    t_e, n_e = run_engine(engine, b)
    print(
        f"(b) pagemesh {n_e / t_e:.1f} tok/s ({n_e} tokens in {t_e:.1f}s), mean KV utilization "
        f"{engine.stats.mean_kv_utilization:.3f}"
    )
    t_h, n_h = run_hf(hf, b, 32)
    print(f"(b) HF static batches of 32: {n_h / t_h:.1f} useful tok/s ({n_h} tokens in {t_h:.1f}s)")
    ours, theirs = single_stream(engine, hf, 64)
    print(f"single stream decode: pagemesh {ours:.1f} tok/s, HF {theirs:.1f} tok/s")
    print(f"ratio: {(n_e / t_e) / (n_h / t_h):.2f}")


if __name__ == "__main__":
    main()
