"""Speculative decoding against the same engine without it, on the embedded model.

    python bench/speculative.py [--max-tokens 128] [--repeats 2] [--streams 8 32] [--k 4]
    python bench/speculative.py --methods none ngram draft_quantized   # the arms (default: none ngram)
    python bench/speculative.py --methods none ngram suffix --workloads quoting "agentic repeat" "free chat" \
        --streams 8 32 --stream-workloads quoting "agentic repeat" "free chat"   # issue 36's goals
    python bench/speculative.py --sweep 1 2 4 8 16 32      # where speculation stops paying
    python bench/speculative.py --methods draft_quantized --forward-costs   # what a pass costs

Single streams: quoting a paragraph, summarizing it, free chat (greedy, chat template), each
run with every arm in turn (none = no `--speculative-config`; ngram; draft_quantized = the
model's own GGUF 4-bit weights propose, `--draft-quantization`), A-B-C-A-B-C `--repeats` times
on one engine (the machine's speed drifts); output tok/s of each arm, its ratio to none, and
the acceptance rate and mean accepted length (tokens per verifying pass). Then `--streams`
concurrent requests cycling through the three workloads (or, with `--stream-workloads`, each
workload alone), the draft-length policy deciding per step and sequence how many drafts to verify
(`--max-decode-rows N` restores a fixed cut-off). "agentic repeat" is a request this server has
answered before (an agent asking the same thing again): every arm runs it once untimed before each
timed run, so the suffix method's cache holds that earlier output. `--sweep` runs the mixed
workload at each batch size. Figures are wall time on this machine: quote `uptime`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.engine.speculative import SpeculationStats, SpeculativeConfig, use_speculation

PARAGRAPH = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He lit the great lamp, "
    "wound the clockwork that turned the lens, and wrote the weather in a leather book. Ships passed "
    "the rocks safely for forty years, and nobody in the village ever learned his name. When he "
    "retired, the council replaced the lamp with an electric beacon that needed no keeper at all, "
    "and the leather books went to the museum, where children still read about the storms."
)
WORKLOADS = {
    "quoting": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "summarizing": f"Summarize the following paragraph in a few sentences, reusing its words:\n\n{PARAGRAPH}",
    "free chat": "Write a short story about a robot who learns to paint.",
    "agentic repeat": "Plan the steps to deploy a small web service, as a numbered list of tool calls in JSON.",
}
PRIMED = {"agentic repeat"}  # run once, untimed, before each timed run (in every arm)


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(seconds, output tokens) of running `prompts` together to completion."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(r.token_ids[0]) for r in results)


def compare(engine, prompts, max_tokens, repeats, configs, prime=False) -> list[tuple[str, float, SpeculationStats]]:
    """Per arm (name -> config, None = no speculation): median tok/s over `repeats` rounds in which
    every arm runs once in turn, and its speculating runs' stats (`prime`: the prompts run once,
    untimed and uncounted, before each timed run)."""
    speeds: dict[str, list[float]] = {name: [] for name in configs}
    totals = {name: SpeculationStats() for name in configs}
    for _ in range(repeats):
        for name, config in configs.items():
            stats = use_speculation(engine, config)
            if prime:
                run(engine, prompts, max_tokens)
                if stats is not None:
                    stats.passes = stats.proposed = stats.accepted = 0
            seconds, tokens = run(engine, prompts, max_tokens)
            speeds[name].append(tokens / seconds)
            if stats is not None:
                totals[name].passes += stats.passes
                totals[name].proposed += stats.proposed
                totals[name].accepted += stats.accepted
    use_speculation(engine, None)
    return [(name, statistics.median(speeds[name]), totals[name]) for name in configs]


def rows(workload, results) -> list[str]:
    """A table row per arm: tok/s, ratio to the first arm (none), acceptance, tokens/pass."""
    base = results[0][1]
    return [
        f"| {workload} | {name} | {speed:.1f} | {speed / base:.2f}x | "
        + (f"{stats.acceptance_rate:.2f} | {stats.mean_accepted_length:.2f} |" if stats.passes else "- | - |")
        for name, speed, stats in results
    ]


def forward_costs(engine, k: int, context: int = 160, repeats: int = 20) -> dict[str, float]:
    """CPU milliseconds (all threads; median of `repeats`) of the forwards a speculating single stream pays for, at
    `context` tokens of context: the target's plain decode (1 row), its verifying pass (K+1 rows)
    and one draft forward (1 row). A pass of the draft method costs verify + K x draft and yields
    `tokens/pass` tokens, so its speed-up over plain decode is at most
    tokens/pass / (verify / decode + K x draft / decode)."""
    import torch

    from pagemesh.workers.engine.model_input import ModelInput

    pages = list(range(1, -(-(context + k + 1) // engine.config.page_size) + 1))

    def timed(runner, rows: int) -> float:
        step = ModelInput(
            [1] * rows, [1] * rows, [context + j for j in range(rows)], [pages] * rows, list(range(rows)), [], rows
        )
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 2):
                start = time.process_time()  # CPU time of all threads: less at the mercy of the load
                runner.execute(step)
                times.append(time.process_time() - start)
        return statistics.median(times[2:]) * 1000

    out = {"decode": timed(engine.runner, 1), f"verify (K+1={k + 1} rows)": timed(engine.runner, k + 1)}
    if getattr(engine, "drafter", None) is not None:
        out["draft forward (1 row)"] = timed(engine.drafter.runner, 1)
    return out


def arms(methods: list[str], k: int, draft_quantization: str, max_decode_rows: int | None = None) -> dict:
    """The arms to compare, by name: None for `none`, else the method's config."""
    out: dict[str, SpeculativeConfig | None] = {}
    for method in methods:
        if method == "none":
            out[method] = None
            continue
        config = SpeculativeConfig(method=method, num_speculative_tokens=k, quantization=draft_quantization)
        out[method] = (
            config if max_decode_rows is None else dataclasses.replace(config, max_decode_rows=max_decode_rows)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--sweep", type=int, nargs="*", default=[])
    parser.add_argument("--no-single", action="store_true", help="skip the single streams")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument(
        "--methods", nargs="+", default=["none", "ngram"], choices=["none", "ngram", "suffix", "draft_quantized"]
    )
    parser.add_argument("--stream-workloads", nargs="+", default=["mixed"], choices=["mixed", *WORKLOADS])
    parser.add_argument("--max-decode-rows", type=int, default=None, help="a fixed cut-off (default: none)")
    parser.add_argument("--draft-quantization", default="gguf", choices=["gguf", "int8"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS)[:3], choices=list(WORKLOADS))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--forward-costs", action="store_true", help="only time the forwards a pass is made of")
    args = parser.parse_args()
    if args.methods[0] != "none":
        args.methods.insert(0, "none")  # the ratios are to it
    engine = Engine(EngineConfig(dtype=args.dtype, max_num_seqs=max([64, *args.streams, *args.sweep])))
    chat = {
        name: engine.tokenizer.encode_chat([{"role": "user", "content": WORKLOADS[name]}])
        for name in {*args.workloads, *(w for w in args.stream_workloads if w != "mixed")}
    }
    configs = arms(args.methods, args.k, args.draft_quantization, args.max_decode_rows)
    for config in configs.values():  # load a draft before timing anything
        use_speculation(engine, config)
    if args.forward_costs:
        for name, ms in forward_costs(engine, args.k).items():
            print(f"{name}: {ms:.1f} CPU ms")
        return
    run(engine, list(chat.values()), 8)  # warm up (and fill the prefix cache: every arm hits it alike)
    header = (
        "| workload | arm | tok/s | vs none | acceptance | tokens/pass |\n| --- | --- | ---: | ---: | ---: | ---: |"
    )
    print(f"k={args.k}, max_tokens={args.max_tokens}, dtype {engine.runner.dtype}, repeats {args.repeats}")
    mixed = [chat[name] for name in args.workloads if name in chat]
    if not args.sweep:
        print(header)
        for name in args.workloads if not args.no_single else ():
            results = compare(engine, [chat[name]], args.max_tokens, args.repeats, configs, name in PRIMED)
            print("\n".join(rows(f"1 stream, {name}", results)), flush=True)
        for n in args.streams:
            for name in args.stream_workloads:
                source = mixed if name == "mixed" else [chat[name]]
                prompts = [source[i % len(source)] for i in range(n)]
                results = compare(engine, prompts, args.max_tokens, args.repeats, configs, name in PRIMED)
                print("\n".join(rows(f"{n} streams, {name}", results)), flush=True)
        return
    print("sweep: the mixed workload at each batch size")
    print(header)
    for n in args.sweep:
        prompts = [mixed[i % len(mixed)] for i in range(n)]
        results = compare(engine, prompts, args.max_tokens, args.repeats, configs)
        print("\n".join(rows(f"{n} streams, mixed", results)), flush=True)


if __name__ == "__main__":
    main()
