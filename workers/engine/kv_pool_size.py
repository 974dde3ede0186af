"""How many KV pages an engine's pool gets: a page's bytes in one rank's pool (its KV heads of
its stage's layers, in the pool's dtype) and the memory budget they come out of."""

from __future__ import annotations

import torch

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.kv_quant import kv_storage_dtype
from pagemesh.workers.model.causal_lm import CausalLM

DEFAULT_CPU_KV_GB = 2.0
GPU_FREE_SHARE = 0.9  # of the memory free when the pool is sized: the rest is for activations


def gpu_kv_budget(free: int, total: int, reserved: int, fraction: float) -> float:
    """Bytes for the KV pool of a worker on a GPU, sized after its weights are loaded: its share
    of the GPU (`fraction` of `total`) less what it holds already (`reserved`: the weights), and
    never more than GPU_FREE_SHARE of what is free now (other processes, activations)."""
    return max(0.0, min(fraction * total - reserved, GPU_FREE_SHARE * free))


def kv_dtype(config: EngineConfig, model: CausalLM) -> torch.dtype:
    return kv_storage_dtype(config.kv_cache_dtype, model.embed_tokens.weight.dtype)


def page_bytes(config: EngineConfig, model_config: ModelConfig, model: CausalLM) -> int:
    """Bytes of a page in one rank's pool: its KV heads of its stage's layers (stage 0, this
    one, has the most layers where the stages are uneven), in the pool's dtype (an fp8 pool:
    half of bf16's, twice the pages)."""
    dtype_bytes = kv_dtype(config, model).itemsize
    per_token = model_config.kv_bytes_per_token(dtype_bytes, model.tp.world_size)
    return per_token * len(model.layers) // model_config.num_layers * config.page_size


def pages_from_budget(config: EngineConfig, model_config: ModelConfig, model: CausalLM, device: torch.device) -> int:
    """The pool's pages: the configured KV budget (CPU: 2 GiB by default; GPU: its share of
    what is free after the weights) over a page's bytes (with a quantized draft's mirror)."""
    spec = config.speculative_config
    size = page_bytes(config, model_config, model)
    if spec is not None and spec.method == "draft_quantized":
        # a quantized draft's pool mirrors the target's page for page, on rank 0: every KV
        # head of every layer in the model dtype (workers/engine/draft_model.py), whatever
        # the target's sharding and KV dtype; the budget holds both
        dtype_bytes = model.embed_tokens.weight.element_size()
        size += model_config.kv_bytes_per_token(dtype_bytes) * config.page_size
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_kv_budget(free, total, torch.cuda.memory_reserved(device), config.gpu_memory_fraction)
    else:
        budget = DEFAULT_CPU_KV_GB * 2**30
    return max(2, int(budget // size))
