"""What serving LoRA adapters costs (issue 31).

    python bench/lora.py kernels [--rounds 5] [--adapters 8] [--rank 16] [--dtype bfloat16]
    python bench/lora.py engine  [--streams 32] [--adapters 8] [--tokens 64] [--rounds 3]
    python bench/lora.py load    [--rounds 5]

`kernels`: one adapted linear of the default model's shapes (q/k/v: 576 -> 3 x (576, 192, 192)
fused; gate/up: 576 -> 2 x 1536; down: 1536 -> 576) with `--adapters` adapters of rank `--rank`
in their slots, rows spread evenly over them, at 1, 8 and 32 rows: the delta computed
  c          one call of the C kernel (kernels/cpu/lora.c: rows grouped by adapter once a step,
             each adapter's weights read once for its rows), what workers/model/lora.py runs on a CPU
  masked     every slot's A and B in two GEMMs, a row's other slots masked to zero (its fallback)
  grouped    rows grouped by slot and padded, one batched GEMM pair over the slots in use
  gather     each row's own A and B gathered, one batched GEMV pair (BGMV)
  loop       a Python loop over the adapters in use, one GEMM pair each (the baseline the issue
             names: what batching must beat)
and the base linear alone for scale. `engine`: decode tok/s of the in-process engine (default
dtype) at `--streams` streams spread over `--adapters` adapters, against the same streams on the
base model alone, alternating, `--rounds` rounds (median). `load`: seconds to read, check and
load one adapter into a slot. Every figure is printed with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {"qkv": (576, [576, 192, 192]), "gate_up": (576, [1536, 1536]), "down": (1536, [576])}


def _timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def kernels(args) -> None:
    import pagemesh.kernels.cpu
    from pagemesh.workers.model.lora import LoRABatch, LoRAWeights

    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"# one adapted linear, {args.adapters} adapters of rank {args.rank}, {args.dtype}; load {_load()}")
    print("| linear | rows | base ms | c ms | masked ms | grouped ms | gather ms | loop ms | loop / c | loop / best |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (fan_in, parts) in SHAPES.items():
        out = sum(parts)
        base = torch.randn(out, fan_in, generator=gen).to(dtype)
        batch = LoRABatch(args.adapters)
        lora = LoRAWeights(batch, fan_in, parts, args.rank, dtype)
        lora.a.data.normal_(generator=gen)
        lora.b.data.normal_(generator=gen)
        width = len(parts) * args.rank
        a = lora.a.data.view(args.adapters, width, fan_in)  # per slot
        b = lora.b.data.view(args.adapters, width, out)
        for rows in (1, 8, 32):
            x = torch.randn(rows, fan_in, generator=gen).to(dtype)
            slots = torch.arange(rows) % args.adapters
            batch.set_rows(slots)
            y = x @ base.T

            def grouped():
                used, counts = torch.unique(slots, return_counts=True)
                order = torch.argsort(slots, stable=True)
                g = int(counts.max())
                xs = x.new_zeros(len(used), g, fan_in)
                pos = torch.arange(rows) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
                xs[torch.repeat_interleave(torch.arange(len(used)), counts), pos] = x[order]
                h = torch.bmm(xs, a[used].transpose(1, 2))
                d = torch.bmm(h, b[used])
                out_rows = torch.empty_like(y)
                out_rows[order] = d[torch.repeat_interleave(torch.arange(len(used)), counts), pos]
                return y + out_rows

            def gather():
                h = torch.bmm(a[slots], x[:, :, None])  # [rows, width, 1]
                return y + torch.bmm(h.transpose(1, 2), b[slots])[:, 0]

            def loop():
                out_rows = y.clone()
                for s in torch.unique(slots).tolist():
                    rows_s = (slots == s).nonzero()[:, 0]
                    out_rows[rows_s] += (x[rows_s] @ a[s].T) @ b[s]
                return out_rows

            def masked():
                h = (x @ lora.a.T) * batch.mask(lora.width, dtype)
                return y + h @ lora.b

            segments = pagemesh.kernels.cpu.lora_segments(slots)  # once a step in the engine, for every linear

            def c_kernel():
                return pagemesh.kernels.cpu.lora_add_grouped_(y.clone(), x, lora.a, lora.b, segments, lora.width)

            reference = loop()
            for fn in (grouped, gather, masked, c_kernel):
                torch.testing.assert_close(fn(), reference, rtol=0, atol=2e-2 * reference.abs().max().item())
            times = {}
            modes = {"base": lambda: x @ base.T, "c": c_kernel, "masked": masked, "grouped": grouped}
            modes |= {"gather": gather, "loop": loop}
            for _ in range(args.rounds):
                for mode, fn in modes.items():
                    times.setdefault(mode, []).append(_timed(fn, 50))
            ms = {m: statistics.median(t) * 1e3 for m, t in times.items()}
            best = min(ms["c"], ms["masked"], ms["grouped"], ms["gather"])
            print(
                f"| {name} | {rows} | {ms['base']:.3f} | {ms['c']:.3f} | {ms['masked']:.3f} | {ms['grouped']:.3f} | "
                f"{ms['gather']:.3f} | {ms['loop']:.3f} | {ms['loop'] / ms['c']:.2f} | {ms['loop'] / best:.2f} |"
            )


def _adapter_folders(root: Path, count: int, rank: int) -> list[str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pagemesh.common.model_files import default_model_path

    path = default_model_path()
    base = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=rank, target_modules=targets, init_lora_weights=False), "a0")
    for i in range(1, count):
        model.add_adapter(f"a{i}", LoraConfig(r=rank, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)
    model.save_pretrained(root)
    return [str(root / f"a{i}") for i in range(count)]


def engine(args) -> None:
    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    with tempfile.TemporaryDirectory() as tmp:
        folders = _adapter_folders(Path(tmp), args.adapters, 16)
        modules = tuple((f"a{i}", f) for i, f in enumerate(folders))
        eng = Engine(EngineConfig(enable_lora=True, lora_modules=modules, max_loras=args.adapters, max_num_seqs=64))
        prompt = eng.tokenizer.encode("Write a long story about a lighthouse keeper and the sea.")
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

        def run(loras) -> float:
            for i, lora in enumerate(loras):
                eng.add_request(
                    f"r{time.monotonic_ns()}-{i}",
                    prompt,
                    params
                    if lora is None
                    else SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, lora=lora),
                )
            while eng.scheduler.waiting or any(s.is_prefilling for s in eng.scheduler.running):
                eng.step()  # prompts in: then time the decode steps only
            tokens, start = 0, time.perf_counter()
            while eng.has_unfinished():
                tokens += sum(len(so.new_token_ids) for out in eng.step() for so in out.outputs)
            return tokens / (time.perf_counter() - start)

        base_loras = [None] * args.streams
        mixed = [f"a{i % args.adapters}" for i in range(args.streams)]
        rates: dict[str, list[float]] = {"base": [], "adapters": []}
        for _ in range(args.rounds):
            rates["base"].append(run(base_loras))
            rates["adapters"].append(run(mixed))
        base, adapted = statistics.median(rates["base"]), statistics.median(rates["adapters"])
        print(
            f"# engine decode, {args.streams} streams, {args.tokens} tokens each, "
            f"dtype {eng.runner.model.dtype}; load {_load()}"
        )
        print(f"base model alone: {base:.1f} tok/s (rounds {[round(r, 1) for r in rates['base']]})")
        print(f"over {args.adapters} adapters: {adapted:.1f} tok/s (rounds {[round(r, 1) for r in rates['adapters']]})")
        print(f"ratio adapters / base: {adapted / base:.2f} (goal >= 0.8)")


def load(args) -> None:
    from pagemesh.common.lora import read_adapter_spec
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine
    from pagemesh.workers.model.lora import load_adapter

    with tempfile.TemporaryDirectory() as tmp:
        (folder,) = _adapter_folders(Path(tmp), 1, 16)
        eng = Engine(EngineConfig(enable_lora=True, max_loras=1))
        times = []
        for i in range(args.rounds):
            start = time.perf_counter()
            eng.adapters.add(f"x{i}", folder)  # read and check
            load_adapter(eng.runner.model, 0, read_adapter_spec(folder, 16))  # into the slot
            times.append(time.perf_counter() - start)
            eng.adapters.remove(f"x{i}")
        print(f"# rank-16 adapter on every linear of the default model; load {_load()}")
        print(f"read + check + load into a slot: median {statistics.median(times) * 1e3:.1f} ms over {args.rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--rounds", type=int, default=5)
    k.add_argument("--adapters", type=int, default=8)
    k.add_argument("--rank", type=int, default=16)
    k.add_argument("--dtype", default="bfloat16")
    k.add_argument("--threads", type=int, default=None, help="torch and OpenMP threads (default: torch's)")
    e = sub.add_parser("engine")
    e.add_argument("--streams", type=int, default=32)
    e.add_argument("--adapters", type=int, default=8)
    e.add_argument("--tokens", type=int, default=64)
    e.add_argument("--rounds", type=int, default=3)
    ld = sub.add_parser("load")
    ld.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    {"kernels": kernels, "engine": engine, "load": load}[args.part](args)


if __name__ == "__main__":
    main()
