"""`pagemesh generate`: prompts through one in-process engine, no sockets (a smoke run)."""

from __future__ import annotations

import argparse
import time

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

DEFAULT_PROMPTS = ["What is paged attention, in one sentence?", "Write a haiku about GPUs."]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="pagemesh generate", description=__doc__)
    parser.add_argument("prompts", nargs="*", help="user messages (chat template applied)")
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    loaded = time.perf_counter()
    prompts = args.prompts or DEFAULT_PROMPTS
    token_prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    results = engine.generate(token_prompts, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    done = time.perf_counter()
    for prompt, result in zip(prompts, results):
        print(f"> {prompt}\n{result.texts[0].strip()}\n")
    tokens = sum(len(r.token_ids[0]) for r in results)
    print(
        f"[{engine.model_config.architecture}, {engine.runner.dtype}, {engine.device}] loaded in "
        f"{loaded - started:.1f}s; "
        f"{tokens} tokens in {done - loaded:.1f}s; KV pages {engine.blocks.num_usable_pages} x "
        f"{engine.config.page_size} tokens"
    )
