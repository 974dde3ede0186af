"""An fp8 KV cache against the model dtype's: quality, pages per GiB, decode speed.

    python bench/fp8_kv.py quality [--dtype bfloat16] [--positions 192]
    python bench/fp8_kv.py speed [--streams 1 8 32] [--prompt-len 128] [--steps 32] [--dtype auto]
                                 [--quantization auto] [--num-pages 4096]
    python bench/fp8_kv.py attention [--seqs 32] [--context 160] [--layers 1 30] [--repeats 30]
                                     [--query-dtype bfloat16]

`quality`: fixed prompts (varied: prose, code, lists, chat) are continued greedily by the model-
dtype engine; then each engine (auto, fp8_e4m3, fp8_e5m2, on the same loaded model) is
teacher-forced through the same tokens *as decode steps* (`decode_logits`: every position after
a 16-token first chunk is a query of length 1 reading all earlier K/V from the pool, which is
where fp8 matters). Reported: greedy-token agreement (argmax equal to the reference's) and the
mean next-token KL(reference || fp8) over every position.

`speed`: decode tokens per second of the in-process engine at each stream count: `streams`
requests of `prompt-len` random tokens are prefilled, then `steps` decode steps are timed
(median step time; tok/s = streams / median).

`attention`: the C attention kernel alone on SmolLM2's shapes (9 query heads of 64 over 3 KV
heads, pages of 16 in shuffled order), one decode query per sequence, bf16 queries: the bf16 pool
against fp8_e4m3, alternated (A-B-A-B). With 1 layer the pool stays in cache (the kernels'
arithmetic); with 30 distinct layers it streams from memory, as a decode step's does.
`--query-dtype float32`: fp32 queries, the fp32 pool against fp8_e4m3 (what a CPU without
AVX512-BF16 serves: fp32 activations and, by default, an fp32 pool).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.model.llama import ForwardContext

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
        config = EngineConfig(
            dtype=args.dtype,
            quantization=args.quantization,
            num_pages=args.num_pages,
            max_num_seqs=max(args.streams),
            max_model_len=max(args.prompt_len + args.steps + 8, 512),
            kv_cache_dtype=kv,
        )
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


def attention(args) -> None:
    import os

    import pagemesh.kernels.cpu as ck

    if not ck.available():
        raise SystemExit(f"C kernels did not build: {ck.load_error()}")
    gen = torch.Generator().manual_seed(0)
    seqs, heads, kv_heads, dim, page = args.seqs, 9, 3, 64, 16
    pages_per = -(-args.context // page)
    tables = (torch.randperm(seqs * pages_per, generator=gen) + 1).reshape(seqs, pages_per).int()
    seq_lens = torch.full((seqs,), args.context, dtype=torch.int32)
    starts = torch.arange(seqs + 1, dtype=torch.int32)
    dtype = getattr(torch, args.query_dtype)
    pool_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    for layers in args.layers:
        pools: dict[str, list] = {pool_name: [], "fp8_e4m3": []}
        for _ in range(layers):
            kv = torch.randn(seqs * pages_per + 1, 2, page, kv_heads, dim, generator=gen).to(dtype)
            scales = (kv.float().abs().amax(dim=(0, 2, 4)) / 112).contiguous()  # amax -> fp8 max / 4
            fp8 = (kv.float() / scales[None, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            pools[pool_name].append((kv, None))
            pools["fp8_e4m3"].append((fp8.contiguous(), scales))
        times: dict[str, list[float]] = {name: [] for name in pools}
        for _ in range(args.repeats):
            for name, pool in pools.items():
                t = time.perf_counter()
                for layer, scales in pool:
                    ck.paged_attention(q, layer, tables, seq_lens, starts, dim**-0.5, kv_scales=scales)
                times[name].append((time.perf_counter() - t) / layers)
        for name, ts in times.items():
            print(
                f"{name:8s} {seqs} seqs x {args.context} tokens, {layers} layer(s): "
                f"median {statistics.median(ts) * 1e3:.3f} ms per layer, best {min(ts) * 1e3:.3f}"
            )
    load = os.getloadavg()
    print(f"threads {torch.get_num_threads()}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    q.add_argument("--positions", type=int, default=192)
    s = sub.add_parser("speed")
    s.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"])
    s.add_argument("--quantization", default="auto", help="as the engine's (--dtype auto --quantization auto: gguf)")
    s.add_argument("--num-pages", type=int, default=4096)
    s.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--steps", type=int, default=32)
    a = sub.add_parser("attention")
    a.add_argument("--seqs", type=int, default=32)
    a.add_argument("--context", type=int, default=160)
    a.add_argument("--layers", type=int, nargs="+", default=[1, 30])
    a.add_argument("--repeats", type=int, default=30)
    a.add_argument("--query-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="queries, pool")
    args = parser.parse_args()
    {"quality": quality, "speed": speed, "attention": attention}[args.what](args)


if __name__ == "__main__":
    main()
