"""The LoRA flags, in vLLM's spellings, and their checks. No torch (`pagemesh up` parses them)."""

from __future__ import annotations

from pagemesh.common.lora import lora_modules  # noqa: F401 - the flag's parser, re-exported

MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices


def add_lora_arguments(parser) -> None:
    from pagemesh.common.cli_args import add

    add(
        parser,
        "--enable-lora",
        False,
        action="store_true",
        help="serve LoRA adapters: a request's `model` may name one (--lora-modules, POST /v1/load_lora_adapter)",
    )
    add(
        parser,
        "--lora-modules",
        None,
        nargs="+",
        metavar="NAME=PATH",
        help="adapters loaded at start: name=path of a peft folder (adapter_config.json, "
        'adapter_model.safetensors), or vLLM\'s JSON form \'{"name": ..., "path": ...}\'',
    )
    add(parser, "--max-loras", 1, type=int, help="adapters that may run in one step (adapter slots on each worker)")
    add(parser, "--max-lora-rank", 16, type=int, choices=MAX_LORA_RANKS, help="largest adapter rank served")
    add(
        parser,
        "--max-cpu-loras",
        None,
        type=int,
        help="adapters kept in host memory once read, for slots to reload from (default: --max-loras)",
    )


def check_lora_config(config) -> None:
    """ValueError naming the field of an EngineConfig whose LoRA settings do not hold together."""
    if not config.enable_lora:
        if config.lora_modules:
            raise ValueError("lora_modules: give --enable-lora too")
        return
    if config.max_loras < 1:
        raise ValueError("max_loras: must be >= 1")
    if config.max_lora_rank not in MAX_LORA_RANKS:
        raise ValueError(f"max_lora_rank: must be one of {list(MAX_LORA_RANKS)}")
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ValueError("max_cpu_loras: must be at least max_loras")
    if config.pipeline_parallel_size > 1:
        raise ValueError("enable_lora: not served by pipeline stages yet (pipeline_parallel_size 1)")
