"""N-gram speculative decoding against the same engine without it, on the embedded model.

    python bench/speculative.py [--max-tokens 128] [--repeats 2] [--streams 8 32] [--k 4]
    python bench/speculative.py --sweep 1 2 4 8 16 32      # where speculation stops paying

Single streams: quoting a paragraph, summarizing it, free chat (greedy, chat template), each
run without and with `--speculative-config` alternately (A-B-A-B, `--repeats` times: the
machine's speed drifts) on one engine; output tok/s of each, their ratio, and the acceptance
rate and mean accepted length (tokens per verifying pass). Then `--streams` concurrent
requests cycling through the three workloads, the engine's default `max_decode_rows` deciding
per step. `--sweep` runs the mixed workload at each batch size with speculation allowed at
any size, for picking that default. Figures are wall time on this machine: quote `uptime`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from common.sampling import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.speculative import SpeculationStats, SpeculativeConfig, use_speculation

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
}


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(seconds, output tokens) of running `prompts` together to completion."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(r.token_ids[0]) for r in results)


def compare(engine, prompts, max_tokens, repeats, config) -> tuple[float, float, SpeculationStats]:
    """Median tok/s without and with speculation (alternating), and the speculating runs' stats."""
    plain, spec = [], []
    total = SpeculationStats()
    for _ in range(repeats):
        use_speculation(engine, None)
        seconds, tokens = run(engine, prompts, max_tokens)
        plain.append(tokens / seconds)
        stats = use_speculation(engine, config)
        seconds, tokens = run(engine, prompts, max_tokens)
        spec.append(tokens / seconds)
        total.passes += stats.passes
        total.proposed += stats.proposed
        total.accepted += stats.accepted
    use_speculation(engine, None)
    return statistics.median(plain), statistics.median(spec), total


def row(name, plain, spec, stats) -> str:
    return (
        f"| {name} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x | "
        f"{stats.acceptance_rate:.2f} | {stats.mean_accepted_length:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--sweep", type=int, nargs="*", default=[])
    parser.add_argument("--no-single", action="store_true", help="skip the single streams")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine = Engine(EngineConfig(dtype=args.dtype, max_num_seqs=max([64, *args.streams, *args.sweep])))
    chat = {name: engine.tokenizer.encode_chat([{"role": "user", "content": text}]) for name, text in WORKLOADS.items()}
    config = SpeculativeConfig(num_speculative_tokens=args.k)
    run(engine, list(chat.values()), 8)  # warm up (and fill the prefix cache: both arms hit it alike)
    header = (
        "| workload | plain tok/s | speculative tok/s | ratio | acceptance | tokens/pass |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: |"
    )
    print(f"k={args.k}, max_tokens={args.max_tokens}, dtype {engine.runner.dtype}, repeats {args.repeats}")
    if not args.sweep:
        print(header)
        for name, prompt in chat.items() if not args.no_single else ():
            print(
                row(f"1 stream, {name}", *compare(engine, [prompt], args.max_tokens, args.repeats, config)), flush=True
            )
        mixed = list(chat.values())
        for n in args.streams:
            prompts = [mixed[i % len(mixed)] for i in range(n)]
            print(
                row(f"{n} streams, mixed", *compare(engine, prompts, args.max_tokens, args.repeats, config)), flush=True
            )
        return
    print("sweep: speculation allowed at every batch size (max_decode_rows unlimited)")
    print(header)
    unlimited = dataclasses.replace(config, max_decode_rows=1 << 20)
    mixed = list(chat.values())
    for n in args.sweep:
        prompts = [mixed[i % len(mixed)] for i in range(n)]
        print(
            row(f"{n} streams, mixed", *compare(engine, prompts, args.max_tokens, args.repeats, unlimited)), flush=True
        )


if __name__ == "__main__":
    main()
