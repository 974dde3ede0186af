"""The roofline model of `pagemesh experiment parallel` (bench/experiments/parallel_model.py),
checked against figures worked out by hand."""

from __future__ import annotations

import pytest

from pagemesh.bench.experiments.parallel_model import (
    H200,
    LLAMA_3_8B,
    Gpu,
    params_per_gpu,
    tensor_parallel_point,
    valid_sizes,
)
from pagemesh.common.model_config import read_model_config
from pagemesh.common.model_files import default_model_path

# Llama-3-8B has 8,030,261,248 parameters; the model leaves out its 65 RMSNorm vectors of 4096
LLAMA_3_8B_WITHOUT_NORMS = 8_030_261_248 - 65 * 4096


def test_llama_3_8b_weights_split_except_the_embedding_and_lm_head():
    assert params_per_gpu(LLAMA_3_8B, 1) == LLAMA_3_8B_WITHOUT_NORMS
    replicated = 2 * 128256 * 4096
    assert params_per_gpu(LLAMA_3_8B, 4) == (LLAMA_3_8B_WITHOUT_NORMS - replicated) // 4 + replicated


def test_a_point_at_tp4_on_an_h200():
    p = tensor_parallel_point(LLAMA_3_8B, 4, H200, batch=64, context=2048)
    weights = params_per_gpu(LLAMA_3_8B, 4) * 2
    assert p.weight_bytes_per_gpu == weights
    assert p.kv_bytes_per_token_per_gpu == 32 * 2 * 2 * 128 * 2  # layers, K and V, 8/4 KV heads, head dim, bf16
    assert p.kv_tokens == pytest.approx((141e9 - weights) * 0.9 / 32768)
    assert p.all_reduce_bytes_per_token == 2 * 32 * 4096 * 2
    assert p.link_bytes_per_token_per_gpu == 1.5 * 2 * 32 * 4096 * 2  # a ring moves 2(N-1)/N
    hbm = (weights + 64 * 2048 * 32768) / 4.8e12  # memory-bound: above the FLOPs' time
    links = 64 * 10e-6 + 1.5 * 2 * 32 * 4096 * 2 * 64 / 900e9
    assert p.decode_step_s == pytest.approx(hbm + links)
    assert p.tokens_per_s == pytest.approx(64 / (hbm + links))


def test_more_ranks_hold_more_than_proportionally_more_kv_and_one_rank_pays_no_all_reduce():
    points = [tensor_parallel_point(LLAMA_3_8B, n) for n in (1, 2, 4, 8)]
    assert all(b.kv_tokens > 2 * a.kv_tokens for a, b in zip(points, points[1:]))
    assert points[0].all_reduce_bytes_per_token == 0 and points[0].link_bytes_per_token_per_gpu == 0
    slow_links = Gpu(all_reduce_latency_s=1.0)
    assert tensor_parallel_point(LLAMA_3_8B, 2, slow_links).decode_step_s > 64  # 64 all-reduces of a second each


def test_sizes_that_divide_the_heads():
    assert valid_sizes(LLAMA_3_8B) == [1, 2, 4, 8]
    assert valid_sizes(read_model_config(default_model_path())) == [1, 3]  # SmolLM2-135M: 9 and 3 heads
