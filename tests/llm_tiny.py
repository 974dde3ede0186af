"""A tiny random Llama for the engine's unit tests (handoffs, prefix placement, resumes): 2 layers,
4 query and 2 KV heads of 16, a vocabulary of 256, fp32 on the CPU. Built in a blink; its
numbers mean nothing, only that two engines given the same seed hold the same weights."""

from __future__ import annotations

import torch


def tiny_llama(seed: int):
    from pagemesh.common.model_config import ModelConfig
    from pagemesh.workers.model.loader import build_random_model

    cfg = ModelConfig(
        architecture="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return build_random_model(cfg, torch.float32, torch.device("cpu"), seed=seed)


def tiny_engine(model, *, page_size: int = 4, num_pages: int = 64, max_model_len: int = 256, **options):
    """An fp32 CPU engine over `model` (no prefix caching unless `options` ask for it)."""
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    config = EngineConfig(
        dtype="float32",
        device="cpu",
        page_size=page_size,
        num_pages=num_pages,
        max_model_len=max_model_len,
        enable_prefix_caching=options.pop("enable_prefix_caching", False),
        cuda_graphs=False,
        **options,
    )
    return Engine(config, model=model)
