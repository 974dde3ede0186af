"""Quantized weights and an fp8 KV pool in tensor- and pipeline-parallel workers: the engine as a
worker runs it (it starts its follower ranks itself) on the tiny random Llama of
test_tensor_parallel (8 query and 4 KV heads, hidden 128, MLP 256: every row-parallel shard of
tp 2 falls on blocks of 32), under page pressure (swap preemption), with shared prefixes (the
prefix cache) and n = 2: every greedy token equals the single-rank engine's with the same
quantization and the same KV dtype.

Why equal and not close: each rank holds exactly the blocks one rank would (a column-parallel
shard is whole rows of W; a row-parallel one whole blocks of 32 input columns, so the int8
activation blocks are the same too), and each rank's fp8 scales are the ones a single rank
records for its heads; only the order of the all-reduce's fp32 sum differs, which moves logits by
~1e-6 here, far below the gap between this model's top two logits. The gguf blocks with -tp 3
run through the mesh (test_mesh_tensor_parallel_disagg.py). Self-speculation with a quantized
draft in a -tp 2 worker (the draft whole on rank 0) gives the tokens of no speculation.
"""

from __future__ import annotations

import pytest
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.kernels.cpu import quant
from pagemesh.tests.integration import test_tensor_parallel as tp_tests
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

pytestmark = pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
tiny_llama = tp_tests.tiny_llama


@pytest.fixture(autouse=True)
def one_thread_a_rank():
    """Rank 0 gives each follower as many torch threads as it has: one each, so that two ranks
    fit two cores (oversubscribed, a loaded machine's OpenMP barriers made a step 5-10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def generate(engine: Engine) -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 256, (24,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    return [r.token_ids for r in engine.generate(prompts, greedy)]


def config(folder, **parallel) -> EngineConfig:
    base = dict(model=str(folder), dtype="float32", num_pages=24, page_size=4, max_num_batched_tokens=32)
    return EngineConfig(**base, max_prefill_chunk=16, preemption_mode="swap", swap_space_gb=0.01, **parallel)


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype", "parallel"),
    [("int8", "fp8_e4m3", {"tensor_parallel_size": 2}), ("int8", "fp8_e5m2", {"pipeline_parallel_size": 2})],
    ids=["int8-fp8kv-tp2", "int8-fp8kv-pp2"],
)
def test_a_parallel_engine_generates_what_one_rank_does(tiny_llama, quantization, kv_cache_dtype, parallel):
    kinds = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    one = Engine(config(tiny_llama, **kinds))
    want = generate(one)
    engine = Engine(config(tiny_llama, **kinds, **parallel))
    try:
        runner = engine.runner
        if quantization != "none":  # this rank's shard of every linear is held quantized
            o_proj = runner.model.layers[0].self_attn.o_proj
            assert o_proj.packed.format == "int8"
            assert o_proj.packed.shape == (128, 128 // parallel.get("tensor_parallel_size", 1))
        if kv_cache_dtype != "auto":
            assert runner.kv_cache.dtype == one.runner.kv_cache.dtype
            # rank 0 holds every rank's scales: each rank's heads of its layers, as one rank records them
            ranks = runner.rank_kv_scales
            tp = parallel.get("tensor_parallel_size", 1)
            assert len(ranks) == tp * parallel.get("pipeline_parallel_size", 1)
            whole = one.runner.kv_scales
            if tp > 1:
                torch.testing.assert_close(torch.cat(ranks, dim=-1), whole, rtol=1e-5, atol=0)
            else:
                torch.testing.assert_close(torch.cat(ranks), whole, rtol=1e-5, atol=0)
        got = generate(engine)
        assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_used_pages == 0
    finally:
        engine.close()
        torch.distributed.destroy_process_group()
    assert got == want


def test_a_quantized_draft_speculates_in_a_tensor_parallel_worker(tiny_llama):
    """`draft_quantized` with -tp 2: the int8 draft runs whole on rank 0 over its own pool (every
    KV head), the ranks verify; greedy tokens equal the single-rank engine's without speculation."""
    from pagemesh.workers.engine.speculative import SpeculativeConfig

    want = generate(Engine(config(tiny_llama)))
    draft = SpeculativeConfig.from_json(
        '{"method": "draft_quantized", "num_speculative_tokens": 3, "quantization": "int8"}'
    )
    engine = Engine(config(tiny_llama, tensor_parallel_size=2, speculative_config=draft))
    try:
        got = generate(engine)
        assert engine.drafter is not None and engine.drafter.forwards > 0
        assert engine.drafter.runner.kv_cache.shape[4] == 4  # the draft's pool: every KV head
        assert engine.runner.kv_cache.shape[4] == 2  # rank 0's: its half
        assert engine.blocks.num_used_pages == 0
    finally:
        engine.close()
        torch.distributed.destroy_process_group()
    assert got == want
