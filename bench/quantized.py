"""Quantized weights (`--quantization`): quality against the dense model, and decode speed.

    python bench/quantized.py quality [--positions 512] [--out docs/perf/quantization.md]
    python bench/quantized.py speed [--prompt-len 128] [--tokens 128] [--repeats 2] [--streams 1]
    python bench/quantized.py linears [--rows 1] [--repeats 20]
    python bench/quantized.py prefill [--prompt-len 128] [--repeats 5]
    python bench/quantized.py llama-positions --base-logits FILE [--dtypes bfloat16 float32]
        [--gguf LABEL=PATH] [--llama-log LABEL=PATH] [--out F]   (after bench/peers/llama_cpp.sh perplexity)
    python bench/quantized.py texts --out FILE

`quality` runs the default model (the shipped Q4_1 GGUF) dense in bf16 (`none`, the reference),
then `int8` and `gguf`, over fixed texts that ship with the dependencies (a license, Python
source, package descriptions, a chat exchange), teacher-forced: every position's next-token
distribution. Per format: mean KL(none || format) and greedy-token agreement over all
positions, and perplexity of each on numpy's LICENSE.txt. `--out` writes the table. Every
quantized linear takes the int8-activation kernel (the path of decode steps, where quantization
costs quality; prefill rows from `layers.DEQUANTIZE_MIN_ROWS` widen W to bf16 and match `none`
exactly): `--served` keeps the row threshold instead.
`speed`: decode tok/s of an in-process engine per format (A-B-C repeated), one stream or
`--streams` concurrent ones, after the prefills; the machine's load average is printed beside
the figures.
`linears`: the linears of one decode step alone (every layer's own random weights in the default
model's shapes, so they stream from memory as in a real step, and the LM head), per format:
bf16 packed for oneDNN (the `none` path without AMX), int8 and Q4_1 as served
(`layers.quantized_linear`: the tiled C GEMM, or W widened to bf16 from DEQUANTIZE_MIN_ROWS rows;
`--untiled` adds Q4_1 through the plain C kernel, the path before the tiled one).
`llama-positions`: our formats scored on exactly the positions llama.cpp's llama-perplexity
scores, against our bf16 and against its F16 log-probabilities, beside its own rows
(bench/llama_cpp_positions.py). `texts`: the quality texts as one file (what it reads).
`prefill`: one prompt's prefill (a single forward of --prompt-len tokens) per format, A-B-C
repeated, median ms: the TTFT of one stream without the gateway.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

from pagemesh.common.model_files import default_model_path  # noqa: E402
from pagemesh.common.quantization import QUANTIZATIONS  # noqa: E402
from pagemesh.common.sampling import SamplingParams  # noqa: E402
from pagemesh.workers.attention.metadata import AttentionMetadata  # noqa: E402
from pagemesh.workers.engine.config import EngineConfig  # noqa: E402
from pagemesh.workers.engine.model_runner import ModelRunner  # noqa: E402
from pagemesh.workers.model import layers  # noqa: E402
from pagemesh.workers.model.llama import ForwardContext, LlamaForCausalLM  # noqa: E402
from pagemesh.workers.model.loader import load_model  # noqa: E402

PAGE = 16
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat are three good reasons to learn a second language?<|im_end|>\n"
    "<|im_start|>assistant\nLearning a second language opens doors to new cultures, improves memory and "
    "problem solving, and makes travel and work abroad far easier.<|im_end|>\n"
    "<|im_start|>user\nWrite a short poem about the sea at night.<|im_end|>\n"
    "<|im_start|>assistant\nThe tide comes in beneath the moon, the waves repeat a silver tune, "
    "and every star that lights the foam is one more lantern guiding home.<|im_end|>\n"
)


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    return Path(spec.origin).parent.joinpath(*parts)


def quality_texts() -> dict[str, str]:
    """Fixed, varied texts that ship with the dependencies (no downloads)."""
    import json.decoder

    site = Path(importlib.util.find_spec("numpy").origin).parents[1]
    license_file = next(site.glob("numpy-*.dist-info/licenses/LICENSE.txt"), None) or next(
        site.glob("numpy-*.dist-info/LICENSE.txt")
    )
    aiohttp_meta = next(site.glob("aiohttp-*.dist-info/METADATA"))
    return {
        "license": license_file.read_text(),
        "python": Path(json.decoder.__file__).read_text(),
        "prose": aiohttp_meta.read_text().split("\n\n", 1)[1],
        "chat": CHAT * 4,
    }


def write_texts(args: argparse.Namespace) -> None:
    """The quality texts as one file (in `quality_texts` order, a blank line between them): the
    text llama.cpp's llama-perplexity reads (bench/peers/llama_cpp.sh perplexity)."""
    Path(args.out).write_text("\n\n".join(quality_texts().values()))


def prompt_logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] at every position of one sequence, in one forward pass."""
    n = len(token_ids)
    pages = list(range(1, (n + PAGE - 1) // PAGE + 1))
    md = AttentionMetadata.build(
        [n], [n], [pages], PAGE, runner.device, for_cpu=runner.attention.builds_cpu_indices,
        decode_gather=runner.attention.decode_gather,
    )  # fmt: skip
    ctx = ForwardContext(runner.kv_cache, md, runner.attention, runner.ops)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=runner.device)
    return runner.model(ids, ctx, torch.arange(n, device=runner.device)).float().cpu()


def make_runner(model: LlamaForCausalLM, max_tokens: int) -> ModelRunner:
    return ModelRunner(model, max_tokens // PAGE + 2, PAGE, torch.device("cpu"), cuda_graphs=False)


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, int]:
    """(sum over rows of KL(reference || other), rows whose argmax agrees)."""
    p_log, q_log = reference.log_softmax(-1), other.log_softmax(-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return float(kl.sum()), int((reference.argmax(-1) == other.argmax(-1)).sum())


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> tuple[float, int]:
    """(summed negative log-likelihood of tokens 1.., how many)."""
    targets = torch.tensor(token_ids[1:])
    nll = -logits[:-1].log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    return float(nll.sum()), len(targets)


def quality(args: argparse.Namespace) -> None:
    from pagemesh.tests.default_model import tokenizer

    if not args.served:
        layers.DEQUANTIZE_MIN_ROWS = 1 << 30
    tok = tokenizer()
    windows = {name: tok.encode(text)[: args.positions] for name, text in quality_texts().items()}
    ppl_ids = windows["license"]
    results: dict[str, dict[str, float]] = {}
    reference: dict[str, torch.Tensor] = {}
    for fmt in QUANTIZATIONS:
        model = load_model(default_model_path(), torch.bfloat16, torch.device("cpu"), quantization=fmt)
        runner = make_runner(model, args.positions)
        kl = agree = rows = 0.0
        for name, ids in windows.items():
            logits = prompt_logits(runner, ids)
            if fmt == "none":
                reference[name] = logits
            k, a = compare(reference[name], logits)
            kl, agree, rows = kl + k, agree + a, rows + len(ids)
        nll, count = perplexity(prompt_logits(runner, ppl_ids), ppl_ids)
        results[fmt] = {"kl": kl / rows, "agree": agree / rows, "ppl": float(torch.tensor(nll / count).exp())}
        results[fmt]["positions"] = rows
        print(fmt, results[fmt], flush=True)
    table = quality_table(results, args.positions)
    print(table)
    if args.out:
        Path(args.out).write_text(table)


def llama_positions(args: argparse.Namespace) -> None:
    """Our formats on llama-perplexity's positions (bench/llama_cpp_positions.py), beside llama.cpp."""
    from pagemesh.bench import llama_cpp_positions as lcp
    from pagemesh.tests.default_model import tokenizer

    if not args.served:
        layers.DEQUANTIZE_MIN_ROWS = 1 << 30
    base = lcp.read_base_logits(args.base_logits)
    tok = tokenizer()
    ours_ids = tok.encode("\n\n".join(quality_texts().values()))[: len(base.tokens)]
    same = sum(a == b for a, b in zip(ours_ids, base.tokens.tolist()))
    print(f"our tokenizer gives llama.cpp's token at {same}/{len(base.tokens)} places (we score its tokens)")
    formats = [("Q4_1 dequantized", "none"), ("int8 blocks of 32", "int8"), ("gguf: Q4_1 (Q8_0 LM head)", "gguf")]
    runners, references = {}, {}
    for dtype in args.dtypes:
        rows = [(f"{dtype} {label}", default_model_path(), q) for label, q in formats]
        rows += [(f"{dtype} gguf: {label}", Path(path), "gguf") for label, path in (g.split("=", 1) for g in args.gguf)]
        for label, path, q in rows:
            model = load_model(path, getattr(torch, dtype), torch.device("cpu"), quantization=q)
            runners[label], references[label] = make_runner(model, base.n_ctx), rows[0][0]
    bos = tok.bos_token_id if tok.add_bos else None
    ours = lcp.score(base, runners, references, prompt_logits, bos, args.chunks)
    theirs = lcp.llama_rows(dict(g.split("=", 1) for g in args.llama_log))
    text = lcp.table(ours, theirs, base)
    load = os.getloadavg()
    print(text + f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.out:
        Path(args.out).write_text(text)


def quality_table(results: dict[str, dict[str, float]], positions: int) -> str:
    lines = [
        "| --quantization | weights | mean KL(bf16 ‖ q) | greedy agreement | perplexity (numpy LICENSE) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    kinds = {"none": "bf16 (Q4_1 dequantized)", "int8": "int8 blocks of 32", "gguf": "Q4_1 (Q8_0 LM head)"}
    for fmt, r in results.items():
        lines.append(f"| {fmt} | {kinds[fmt]} | {r['kl']:.4f} | {r['agree']:.2%} | {r['ppl']:.3f} |")
    return "\n".join(lines) + f"\n\n{int(results['none']['positions'])} positions ({positions} per text).\n"


def speed(args: argparse.Namespace) -> None:
    from pagemesh.workers.engine.engine import Engine

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    pages = args.streams * ((args.prompt_len + args.tokens) // PAGE + 2)
    engines = {
        fmt: Engine(
            EngineConfig(
                dtype="bfloat16",
                quantization=fmt,
                num_pages=max(64, pages),
                enable_prefix_caching=False,
                max_num_seqs=max(8, args.streams),
            )
        )
        for fmt in args.formats
    }
    figures: dict[str, list[float]] = {fmt: [] for fmt in engines}
    for repeat in range(args.repeats):
        for fmt, engine in engines.items():
            for i in range(args.streams):  # distinct prompts: nothing shared between the streams
                prompt = [1000 + (7 * i + j) % 5000 for j in range(args.prompt_len)]
                engine.add_request(f"{fmt}-{repeat}-{i}", prompt, params)
            while any(r.seqs[0].num_output_tokens == 0 for r in engine.requests.values()):
                engine.step()  # the prefills and first tokens
            t0, tokens = time.perf_counter(), 0
            while engine.requests:
                tokens += len(engine.requests)
                engine.step()
            figures[fmt].append(tokens / (time.perf_counter() - t0))
    load = os.getloadavg()
    for fmt, tps in figures.items():
        runs = ", ".join(f"{t:.1f}" for t in tps)
        print(f"{fmt:5s} decode {statistics.median(tps):6.1f} tok/s, {args.streams} stream(s) (runs: {runs})")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")


def linears(args: argparse.Namespace) -> None:
    import gguf
    from gguf.quants import quantize as gguf_quantize

    from pagemesh.common.model_config import read_model_config
    from pagemesh.kernels.quantized import from_gguf_blocks, quantize_int8, with_tiles

    cfg = read_model_config(default_model_path())
    h, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    shapes = [(h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter)] * cfg.num_layers + [(cfg.vocab_size, h)]
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=gen) * 0.05 for n, k in shapes]
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    weights = {
        "bf16": [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 32) for w in dense],
        "int8": [with_tiles(quantize_int8(w)) for w in dense],
        "q4_1": [with_tiles(from_gguf_blocks("Q4_1", gguf_quantize(w.numpy(), q4_1))) for w in dense],
    }
    if args.untiled:  # the path before the tiled GEMM: the plain integer kernel below the threshold
        weights["q4_1-untiled"] = [dataclasses.replace(w, tiles=None) for w in weights["q4_1"]]
    del dense
    xs = {k: torch.randn(args.rows, k).bfloat16() for k in {k for _, k in shapes}}

    def one_pass(fmt: str) -> None:
        for w in weights[fmt]:
            if fmt == "bf16":
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], w, None, "none", [], "")
            else:
                layers.quantized_linear(xs[w.shape[1]], w, None, None)

    times: dict[str, list[float]] = {fmt: [] for fmt in weights}
    for _ in range(args.repeats):  # A-B-C, repeated
        for fmt in weights:
            t0 = time.perf_counter()
            one_pass(fmt)
            times[fmt].append(time.perf_counter() - t0)
    for fmt, ts in times.items():
        mb = sum(_nbytes(w) for w in weights[fmt]) / 1e6
        print(f"{fmt:5s} {args.rows} row(s): {statistics.median(ts) * 1e3:6.2f} ms per step's linears ({mb:.0f} MB)")
    load = os.getloadavg()
    print(f"threads {torch.get_num_threads()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def prefill(args: argparse.Namespace) -> None:
    from pagemesh.workers.engine.engine import Engine

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engines = {
        fmt: Engine(EngineConfig(dtype="bfloat16", quantization=fmt, num_pages=64, enable_prefix_caching=False))
        for fmt in args.formats
    }
    figures: dict[str, list[float]] = {fmt: [] for fmt in engines}
    for repeat in range(args.repeats + 1):  # the first round warms up, not counted
        for fmt, engine in engines.items():
            prompt = [1000 + (7 * i + repeat) % 5000 for i in range(args.prompt_len)]
            engine.add_request(f"{fmt}-{repeat}", prompt, params)
            t0 = time.perf_counter()
            while engine.requests:
                engine.step()
            if repeat:
                figures[fmt].append(time.perf_counter() - t0)
    load = os.getloadavg()
    base = statistics.median(figures[args.formats[0]])
    for fmt, ts in figures.items():
        med = statistics.median(ts)
        runs = ", ".join(f"{t * 1e3:.0f}" for t in ts)
        print(f"{fmt:5s} prefill {args.prompt_len} tokens: {med * 1e3:7.1f} ms ({base / med:.2f}x; runs {runs})")
    print(f"threads {torch.get_num_threads()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def _nbytes(w) -> int:
    return w.nbytes if hasattr(w, "codes") else w.numel() * w.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--positions", type=int, default=512, help="tokens per text")
    q.add_argument("--out", default=None)
    q.add_argument("--served", action="store_true", help="prefill rows widen W to bf16, as served")
    s = sub.add_parser("speed")
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=2)
    s.add_argument("--streams", type=int, default=1, help="concurrent requests (decode batch rows)")
    s.add_argument("--formats", nargs="+", default=list(QUANTIZATIONS), choices=list(QUANTIZATIONS))
    li = sub.add_parser("linears")
    li.add_argument("--rows", type=int, default=1)
    li.add_argument("--repeats", type=int, default=20)
    li.add_argument("--untiled", action="store_true", help="also Q4_1 without its tiles (the plain kernel)")
    p = sub.add_parser("prefill")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--formats", nargs="+", default=list(QUANTIZATIONS), choices=list(QUANTIZATIONS))
    lp = sub.add_parser("llama-positions", help="llama-perplexity's positions (bench/peers/llama_cpp.sh perplexity)")
    lp.add_argument("--base-logits", required=True, help="llama-perplexity --kl-divergence-base FILE (its F16 run)")
    lp.add_argument("--gguf", action="append", default=[], help="LABEL=PATH: one more GGUF served with gguf")
    lp.add_argument("--llama-log", action="append", default=[], help="LABEL=PATH: a --kl-divergence log")
    lp.add_argument("--chunks", type=int, default=None)
    lp.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    lp.add_argument("--served", action="store_true", help="prefill rows widen W to bf16, as served")
    lp.add_argument("--out", default=None)
    t = sub.add_parser("texts")
    t.add_argument("--out", required=True)
    args = parser.parse_args()
    {
        "texts": write_texts,
        "llama-positions": llama_positions,
        "quality": quality,
        "speed": speed,
        "linears": linears,
        "prefill": prefill,
    }[args.command](args)


if __name__ == "__main__":
    main()
