"""An fp8 KV cache against the model dtype's: quality, pages per GiB, decode speed.

    python bench/fp8_kv.py quality [--dtype bfloat16] [--positions 192]
    python bench/fp8_kv.py speed [--streams 1 8 32] [--prompt-len 128] [--steps 32]

`quality`: fixed prompts (varied: prose, code, lists, chat) are continued greedily by the model-
dtype engine; then each engine (auto, fp8_e4m3, fp8_e5m2, on the same loaded model) is
teacher-forced through the same tokens *as decode steps* (`decode_logits`: every position after
a 16-token first chunk is a query of length 1 reading all earlier K/V from the pool, which is
where fp8 matters). Reported: greedy-token agreement (argmax equal to the reference's) and the
mean next-token KL(reference || fp8) over every position.

`speed`: decode tokens per second of the in-process engine at each stream count: `streams`
requests of `prompt-len` random tokens are prefilled, then `steps` decode steps are timed
(median step time; tok/s = streams / median).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from common.sampling import SamplingParams
from workers.engine.attention import AttentionMetadata
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.model.llama import ForwardContext

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def quicksort(items):\n    ",
    "Here is a list of ten fruits:\n1.",
    "<|im_start|>user\nHow do I make a good cup of tea?<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "SELECT name, COUNT(*) FROM orders",
    "Dear hiring manager, I am writing to apply for",
    "The three laws of motion state that",
]
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
FIRST_CHUNK = 16


def decode_logits(engine: Engine, sequences: list[list[int]]) -> torch.Tensor:
    """Teacher-force equal-length `sequences` through `engine`'s runner, all at once: a first
    chunk of FIRST_CHUNK tokens each, then one decode step per position. Returns fp32 logits
    [num_seqs, len - FIRST_CHUNK, vocab], row j predicting token FIRST_CHUNK + j. Writes pool pages
    from 1 directly, past the block manager: use an idle engine whose prefix cache is off or
    thrown away after."""
    runner, size = engine.runner, engine.config.page_size
    n = len(sequences[0])
    per_seq = -(-n // size)
    tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(len(sequences))]
    ids = torch.tensor(sequences, dtype=torch.int64)
    out = []

    def run(query_len: int, seq_len: int, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        md = AttentionMetadata.build(
            [query_len] * len(sequences),
            [seq_len] * len(sequences),
            [t[: -(-seq_len // size)] for t in tables],
            size,
            runner.device,
            for_cpu=runner.attention.builds_cpu_indices,
            decode_gather=runner.attention.decode_gather,
        )
        ctx = ForwardContext(runner.kv_cache, md, runner.attention, runner.ops)
        return runner.model(tokens.reshape(-1).to(runner.device), ctx, rows.to(runner.device)).float().cpu()

    with torch.inference_mode():
        first = torch.arange(len(sequences)) * FIRST_CHUNK + FIRST_CHUNK - 1
        out.append(run(FIRST_CHUNK, FIRST_CHUNK, ids[:, :FIRST_CHUNK], first))
        for pos in range(FIRST_CHUNK, n - 1):
            out.append(run(1, pos + 1, ids[:, pos], torch.arange(len(sequences))))
    return torch.stack(out, dim=1)


def agreement_and_kl(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(share of positions whose argmax agrees, mean KL(reference || other) in nats)."""
    agree = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    ref_lp, other_lp = reference.log_softmax(-1), other.log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - other_lp)).sum(-1).mean().item()
    return agree, kl


def quality(args) -> None:
    base = Engine(EngineConfig(dtype=args.dtype, num_pages=2048, max_model_len=1024, enable_prefix_caching=False))
    tok = base.tokenizer
    prompts = [tok.encode(p)[:FIRST_CHUNK] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=args.positions, ignore_eos=True)
    sequences = [p + r.token_ids[0] for p, r in zip(prompts, base.generate(prompts, params))]
    n = min(len(s) for s in sequences)
    sequences = [s[:n] for s in sequences]
    reference = decode_logits(base, sequences)
    print(f"{len(sequences)} sequences x {reference.shape[1]} positions = {reference.numel() // reference.shape[-1]}")
    print("| kv cache dtype | pages in 1 GiB | greedy agreement | mean KL (nats) |\n| --- | ---: | ---: | ---: |")
    for kv in KV_DTYPES:
        engine = base
        if kv != "auto":
            config = dataclasses.replace(base.config, kv_cache_dtype=kv)
            engine = Engine(config, model=base.runner.model, tokenizer=tok)
        agree, kl = agreement_and_kl(reference, decode_logits(engine, sequences))
        pages = 2**30 // engine.runner.page_bytes
        print(f"| {kv} ({engine.runner.kv_cache.dtype}) | {pages} | {agree:.4f} | {kl:.5f} |")


def speed(args) -> None:
    base = None
    gen = torch.Generator().manual_seed(0)
    print("| kv cache dtype | " + " | ".join(f"{s} streams tok/s" for s in args.streams) + " |")
    print("| --- |" + " ---: |" * len(args.streams))
    for kv in KV_DTYPES:
        config = EngineConfig(dtype=args.dtype, num_pages=4096, max_num_seqs=max(args.streams), kv_cache_dtype=kv)
        engine = Engine(config) if base is None else Engine(config, model=base.runner.model, tokenizer=base.tokenizer)
        base = base or engine
        cells = []
        for streams in args.streams:
            params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
            for i in range(streams):
                prompt = torch.randint(100, 20000, (args.prompt_len,), generator=gen).tolist()
                engine.add_request(f"{kv}-{streams}-{i}", prompt, params)
            while any(s.is_prefilling for s in engine.scheduler.live_sequences):
                engine.step()  # the prompts' prefill
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            while engine.has_unfinished():
                engine.step()
            cells.append(f"{streams / statistics.median(times):.0f}")
        attention = engine.runner.attention
        kernels = (
            attention.kernels if isinstance(getattr(attention, "kernels", None), str) else type(attention).__name__
        )
        print(f"| {kv} ({kernels}) | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    q.add_argument("--positions", type=int, default=192)
    s = sub.add_parser("speed")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    s.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    quality(args) if args.what == "quality" else speed(args)


if __name__ == "__main__":
    main()
