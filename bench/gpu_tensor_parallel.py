"""Tensor parallel across GPUs (scripts/gpu_check.sh runs it when two or more GPUs are visible):
the engine at `-tp N` against the same engine at `-tp 1`, on one model; prints a markdown report.

The model is bench/gpu_engine.py's Llama-3-8B shape cut to a few layers (the weights per rank,
the all-reduces per layer and the KV heads per rank are those of the whole model, layer for
layer), random bf16 weights written once as a safetensors folder: the follower ranks load their
shards from a path, as a worker's do. Each engine runs greedy batches as a worker runs them (rank
0 is this process, ranks 1..N-1 its children, one GPU each, NCCL between them):

1. Agreement: the first token of each of 32 prompts at `-tp N` equals `-tp 1`'s wherever `-tp 1`'s
   top-2 log-probability margin exceeds MARGIN (bf16 sums in another order may flip a near tie).
   A disagreement fails the run (exit 1).
2. Decode tokens/s at batch 1 and 32 (prompts of PROMPT_LEN, DECODE_TOKENS generated; eager: no
   CUDA graphs across ranks), weight bytes and KV bytes per token on each rank.

Usage: PYTHONPATH=. python bench/gpu_tensor_parallel.py [--tp 2] [--layers 4]; `--device cpu
--tiny` runs the same code on a tiny model over gloo (to check the script, not to measure).
Exits 2 when fewer GPUs are visible than --tp. Needs no pyzmq, structlog or gguf.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagemesh.common.sampling import SamplingParams  # noqa: E402
from pagemesh.workers.engine.config import EngineConfig  # noqa: E402
from pagemesh.workers.engine.engine import Engine  # noqa: E402

PROMPT_LEN, DECODE_TOKENS, BATCHES, AGREEMENT_PROMPTS = 128, 64, (1, 32), 32
MARGIN = 0.1  # nats between the top two log-probabilities: above it, the choice is not a near tie
PAGE = 16


def write_model(folder: Path, layers: int, tiny: bool, device: str) -> dict:
    """A random Llama written as a Hugging Face safetensors folder; returns its shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        shape = dict(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4
        )
    else:  # bench/gpu_engine.py's LLAMA3_8B (its rope scaling aside)
        shape = dict(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8
        )
    cfg = LlamaConfig(
        **shape,
        num_hidden_layers=layers,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,  # wide logits: most greedy choices are clear, so agreement is a real check
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds, not minutes
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    return {**shape, "layers": layers}


def make_engine(folder: Path, tp: int, device: str) -> Engine:
    per_seq = -(-(PROMPT_LEN + DECODE_TOKENS + 1) // PAGE)
    return Engine(
        EngineConfig(
            model=str(folder),
            device=device,
            dtype="bfloat16",
            tensor_parallel_size=tp,
            page_size=PAGE,
            num_pages=max(max(BATCHES), AGREEMENT_PROMPTS) * per_seq + 16,
            max_model_len=1024,
            max_num_seqs=max(max(BATCHES), AGREEMENT_PROMPTS),
            max_num_batched_tokens=4096,
            enable_prefix_caching=False,
            cuda_graphs=False,  # not across ranks: the same eager steps on both sides
        )
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(engine: Engine, prompts: list[list[int]], device: str) -> dict:
    """First tokens (with top-2 logprobs) of every prompt, then decode tokens/s per batch."""
    first = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=2))
    out = {
        "first": [(r.token_ids[0][0], r.logprobs[0][0].top_logprobs) for r in first],
        "weight_bytes": sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()),
        "kv_bytes": engine.model_config.kv_bytes_per_token(2, engine.runner.model.tp.world_size),
        "tok_s": {},
    }
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    for batch in BATCHES:
        sync(device)
        t0 = time.perf_counter()
        engine.generate(prompts[:batch], params)
        sync(device)
        out["tok_s"][batch] = batch * DECODE_TOKENS / (time.perf_counter() - t0)
    return out


def disagreements(single: list, parallel: list) -> tuple[int, int]:
    """(decisive prompts, those whose first token differs): decisive = `single`'s top-2 margin >
    MARGIN."""
    decisive = differ = 0
    for (token, top), (other, _) in zip(single, parallel):
        if top[0] - top[1] > MARGIN:
            decisive += 1
            differ += token != other
    return decisive, differ


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (to check the script on a CPU)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        print(
            f"gpu_tensor_parallel: -tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible",
            file=sys.stderr,
        )
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="pagemesh-tp-bench-") as tmp:
        folder = Path(tmp)
        shape = write_model(folder, args.layers, args.tiny, args.device)
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, shape["vocab_size"], (PROMPT_LEN,), generator=gen).tolist()
            for _ in range(max(max(BATCHES), AGREEMENT_PROMPTS))
        ]
        results = {}
        for tp in (1, args.tp):
            engine = make_engine(folder, tp, args.device)
            try:
                results[tp] = measure(engine, prompts, args.device)
            finally:
                engine.close()
            if tp > 1:
                torch.distributed.destroy_process_group()
            del engine
            if args.device == "cuda":
                torch.cuda.empty_cache()
    decisive, differ = disagreements(results[1]["first"], results[args.tp]["first"])
    lines = [
        f"Model: {shape['layers']} layers of a {shape['hidden_size']}-wide Llama "
        f"({shape['num_attention_heads']} q / {shape['num_key_value_heads']} kv heads, vocab {shape['vocab_size']}), "
        f"random bf16 weights; `-tp {args.tp}` on {args.device} against `-tp 1`; prompts of {PROMPT_LEN} tokens, "
        f"{DECODE_TOKENS} generated, eager.",
        "",
        "| tp | weights per rank (GB) | KV bytes per token per rank | "
        + " | ".join(f"tok/s at batch {b}" for b in BATCHES)
        + " |",
        "| ---: | ---: | ---: |" + " ---: |" * len(BATCHES),
    ]
    for tp, r in results.items():
        speeds = " | ".join(f"{r['tok_s'][b]:.0f}" for b in BATCHES)
        lines.append(f"| {tp} | {r['weight_bytes'] / 1e9:.2f} | {r['kv_bytes']} | {speeds} |")
    verdict = "PASS" if differ == 0 else "**FAIL**"
    lines += [
        "",
        f"First tokens: {verdict}: {decisive} of {len(prompts)} prompts decisive (top-2 margin > {MARGIN}), "
        f"{differ} of them differ between `-tp 1` and `-tp {args.tp}`.",
        "",
        f"_gpu_tensor_parallel ran in {time.time() - started:.0f} s._",
    ]
    print("\n".join(lines))
    return 0 if differ == 0 and decisive > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
