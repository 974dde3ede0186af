"""Engine benchmark on one CUDA GPU; prints a markdown report (scripts/gpu_check.sh keeps it).

A randomly initialised Llama-3-8B-shaped model in bf16 (nothing to download), run through
`Engine.step` exactly as a worker runs it:

1. Decode at batch 1, 32 and 128: prompts of 512 random tokens, prefilled, 3 warm-up decode
   steps, then 128 timed decode steps (the engine captured its CUDA graphs when it was built).
   Reported: end-to-end tokens/s (scheduler, forward, greedy argmax, ids to the host) and the
   forward alone (graph replay timed with CUDA events), against the roofline of a step: (weight
   bytes + K/V bytes read) / the device copy bandwidth measured in this run (bench/kernel_bench.py's
   4 GiB `copy_`). Batch 1 also runs eagerly (graphs off) to show what the graphs save.
2. TTFT of a 2048-token prompt (one prefill step), median of 3 after a warm-up, and the
   achieved TFLOP/s of that step.

Usage: PYTHONPATH=. python bench/gpu_engine.py. Exits 2 when there is no CUDA device.
Imports nothing that needs pyzmq, structlog or gguf (tests/unit/test_gpu_imports.py).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pagemesh.common.model_config import ModelConfig  # noqa: E402
from pagemesh.common.sampling import SamplingParams  # noqa: E402
from pagemesh.workers.engine.config import EngineConfig  # noqa: E402
from pagemesh.workers.engine.cuda_graphs import bucket_for  # noqa: E402
from pagemesh.workers.engine.engine import Engine  # noqa: E402
from pagemesh.workers.model.loader import build_random_model  # noqa: E402

LLAMA3_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    rope_scaling=(
        ("factor", 8.0),
        ("high_freq_factor", 4.0),
        ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 8192),
        ("rope_type", "llama3"),
    ),
)
BATCHES = (1, 32, 128)
PROMPT_LEN, DECODE_STEPS, WARMUP_STEPS, TTFT_LEN = 512, 128, 3, 2048
PAGE = 16


def make_engine(model, max_batch: int, prompt_len: int, steps: int, ttft_len: int) -> Engine:
    per_seq = -(-(prompt_len + WARMUP_STEPS + steps + 2) // PAGE)
    config = EngineConfig(
        device=model.embed_tokens.weight.device.type,
        dtype="bfloat16",
        page_size=PAGE,
        num_pages=max_batch * per_seq + -(-ttft_len // PAGE) + 16,
        max_model_len=4096,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(16384, ttft_len),
        max_prefill_chunk=ttft_len,
        max_num_partial_prefills=max_batch,
        enable_prefix_caching=False,
    )
    return Engine(config, model=model)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompt(length: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def decode_run(engine: Engine, batch: int, prompt_len: int, steps: int, gen: torch.Generator) -> dict:
    """Prefill `batch` prompts, warm up, time `steps` decode steps; returns the measurements."""
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=WARMUP_STEPS + steps + 2, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, random_prompt(prompt_len, engine.model_config.vocab_size, gen), params)
    started: set[str] = set()
    while len(started) < batch:
        started |= {out.request_id for out in engine.step()}
    for _ in range(WARMUP_STEPS):
        engine.step()
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    step_s = (time.perf_counter() - t0) / steps
    forward_s = time_graph_replay(engine, batch)
    for rid in ids:
        engine.abort(rid)
    mean_context = prompt_len + 1 + WARMUP_STEPS + steps / 2
    return {"step_s": step_s, "forward_s": forward_s, "mean_context": mean_context}


def time_graph_replay(engine: Engine, batch: int, reps: int = 20) -> float | None:
    """Seconds per replay of the decode graph of this batch (it recomputes the last step)."""
    graphs = engine.runner.graphs
    captured = graphs.graphs.get(bucket_for(batch, graphs.sizes)) if graphs is not None else None
    if captured is None:
        return None
    replay, _ = captured
    for _ in range(3):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def weight_bytes_per_step(model) -> int:
    """Every weight is read once per step, except the input embedding (only the batch's rows)."""
    embed = model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not model.embed_tokens:
        total -= embed.numel() * embed.element_size()
    return total


def ttft_run(engine: Engine, prompt_len: int, gen: torch.Generator) -> float:
    rid = f"ttft-{time.monotonic_ns()}"
    engine.add_request(
        rid,
        random_prompt(prompt_len, engine.model_config.vocab_size, gen),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    )
    sync(engine.device)
    t0 = time.perf_counter()
    while not any(out.request_id == rid and out.outputs for out in engine.step()):
        pass
    sync(engine.device)
    engine.abort(rid)
    return time.perf_counter() - t0


def prefill_flops(cfg: ModelConfig, weights_bytes: int, dtype_bytes: int, tokens: int) -> float:
    matmul = 2 * weights_bytes / dtype_bytes * tokens
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens / 2  # causal
    return matmul + attention


def run(
    model, copy_gbs: float | None, batches=BATCHES, prompt_len=PROMPT_LEN, steps=DECODE_STEPS, ttft_len=TTFT_LEN
) -> list[str]:
    """All measurements on `model`; returns the markdown lines."""
    cfg = model.config
    dtype_bytes = model.embed_tokens.weight.element_size()
    engine = make_engine(model, max(batches), prompt_len, steps, ttft_len)
    gen = torch.Generator().manual_seed(0)
    weights = weight_bytes_per_step(model)
    kv_per_token = cfg.kv_bytes_per_token(dtype_bytes)
    out = [
        f"Model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} q / {cfg.num_kv_heads} kv "
        f"heads, vocab {cfg.vocab_size}, random {model.embed_tokens.weight.dtype} weights "
        f"({weights / 1e9:.2f} GB read per decode step); page {PAGE}; prompts of {prompt_len} tokens, "
        f"{steps} timed decode steps after {WARMUP_STEPS} warm-up; device copy bandwidth "
        f"**{copy_gbs or 0:.0f} GB/s**.",
        "",
        "| batch | mode | end-to-end tok/s | ms/step | forward ms (graph replay) | roofline ms | "
        "forward % of roofline | roofline tok/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    runs = [(b, True) for b in batches] + [(1, False)]
    for batch, graphs_on in runs:
        saved = engine.runner.graphs
        if not graphs_on:
            engine.runner.graphs = None
        mode = "eager" if engine.runner.graphs is None else "CUDA graphs"
        r = decode_run(engine, batch, prompt_len, steps, gen)
        engine.runner.graphs = saved
        roof_s = (weights + batch * r["mean_context"] * kv_per_token) / (copy_gbs * 1e9) if copy_gbs else None
        fwd = f"{r['forward_s'] * 1e3:.2f}" if r["forward_s"] else "—"
        pct = f"{100 * roof_s / r['forward_s']:.0f}%" if r["forward_s"] and roof_s else "—"
        roof_ms = f"{roof_s * 1e3:.2f}" if roof_s else "—"
        roof_tps = f"{batch / roof_s:.0f}" if roof_s else "—"
        out.append(
            f"| {batch} | {mode} | {batch / r['step_s']:.0f} | "
            f"{r['step_s'] * 1e3:.2f} | {fwd} | {roof_ms} | {pct} | {roof_tps} |"
        )
    ttft_run(engine, ttft_len, gen)  # warm-up: compiles the prefill kernels at this shape
    ttft = statistics.median(ttft_run(engine, ttft_len, gen) for _ in range(3))
    tflops = prefill_flops(cfg, weights, dtype_bytes, ttft_len) / ttft / 1e12
    out += [
        "",
        f"TTFT of a {ttft_len}-token prompt (one prefill step, in the engine): "
        f"**{ttft * 1e3:.1f} ms** ({ttft_len / ttft:.0f} tok/s, {tflops:.0f} TFLOP/s achieved).",
        "",
        "End-to-end includes the scheduler and greedy sampling (argmax on the GPU, ids to the host); "
        "roofline = (weight bytes + K/V bytes read at the mean context) / copy bandwidth.",
    ]
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_engine: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.", file=sys.stderr)
        return 2
    from pagemesh.bench.kernel_bench import Timer, copy_bandwidth

    started = time.time()
    copy_gbs = copy_bandwidth(Timer(warmup=3, reps=10))
    torch.cuda.empty_cache()
    model = build_random_model(LLAMA3_8B, torch.bfloat16, torch.device("cuda"))
    lines = run(model, copy_gbs)
    lines += [
        "",
        f"_gpu_engine ran in {time.time() - started:.0f} s "
        f"(peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)._",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
