"""What JSON mode costs: building the token masks, and a decoding run with and without it.

    python bench/json_mode.py [--prompts 8] [--tokens 64]

Prints, on the default model's vocabulary:
- the time to build the vocabulary tables, and a first (uncached) mask per kind of automaton
  state, then a cached one;
- the engine's decode throughput on the same chat prompts (bf16, greedy, the same number of
  tokens forced with min_tokens) without JSON mode, with `json_object` and with a `json_schema`,
  and the ratio to the run without.
"""

from __future__ import annotations

import argparse
import json
import time

from pagemesh.common.json_schema import compile_schema  # noqa: E402
from pagemesh.common.sampling import SamplingParams  # noqa: E402
from pagemesh.workers.engine.config import EngineConfig  # noqa: E402
from pagemesh.workers.engine.engine import Engine  # noqa: E402
from pagemesh.workers.engine.json_mode import JsonMasks  # noqa: E402

STATES = ["", "{", '{"na', '{"name": ', '{"name": "Al', '{"name": "Al", "age": 4', '{"a": [1, {"b": tr']
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["black", "white", "ginger"]},
    },
    "required": ["name", "age", "color"],
}


def bench_masks(tokenizer) -> None:
    started = time.perf_counter()
    masks = JsonMasks.for_tokenizer(tokenizer, tokenizer.vocab_size, set(tokenizer.eos_token_ids))
    print(f"vocabulary tables ({tokenizer.vocab_size} tokens): {1000 * (time.perf_counter() - started):.0f} ms")
    print("| after | first mask (ms) | cached (µs) | tokens allowed |\n| --- | ---: | ---: | ---: |")
    for prefix in STATES:
        cursor = masks.start()
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            cursor = masks.advance(cursor, token)
        started = time.perf_counter()
        mask = masks.allowed(cursor)
        first = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(100):
            masks.allowed(cursor)
        cached = (time.perf_counter() - started) / 100
        print(f"| `{prefix}` | {1000 * first:.1f} | {1e6 * cached:.1f} | {int(mask.sum())} |")
    started = time.perf_counter()
    compile_schema(SCHEMA)
    print(f"compiling the benchmark's schema: {1e6 * (time.perf_counter() - started):.0f} µs")


def bench_engine(engine: Engine, prompts: list[list[int]], tokens: int) -> None:
    modes = {"plain": {}, "json_object": {"json_object": True}, "json_schema": {"json_schema": json.dumps(SCHEMA)}}
    baseline = None
    print(f"\n| mode | {len(prompts)} x {tokens} tokens (s) | tok/s | x plain |\n| --- | ---: | ---: | ---: |")
    for name, extra in modes.items():
        params = SamplingParams(temperature=0, max_tokens=tokens, **extra)
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, **extra))  # warm-up: masks, kernels
        started = time.perf_counter()
        results = engine.generate(prompts, params)
        seconds = time.perf_counter() - started
        generated = sum(len(r.token_ids[0]) for r in results)
        rate = generated / seconds
        baseline = baseline or rate
        print(f"| {name} | {seconds:.2f} | {rate:.0f} | {rate / baseline:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    opts = parser.parse_args()
    engine = Engine(EngineConfig(dtype="bfloat16", num_pages=1024))
    bench_masks(engine.tokenizer)
    asks = [
        "Describe a cat.",
        "Give me a JSON object about a city.",
        "Describe your favourite book.",
        "List facts about the moon.",
    ]
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": f"{asks[i % len(asks)]} ({i})"}])
        for i in range(opts.prompts)
    ]
    bench_engine(engine, prompts, opts.tokens)


if __name__ == "__main__":
    main()
