"""Feature caches in the diffusion engine, on the tiny random DiT (tests/diffusion_tiny.py): the
block-level forward equals the whole one, threshold 0 / interval 1 reproduce the uncached image
exactly, per-row decisions in a mixed batch give each request its image alone, only computing
rows run the deep blocks, cache memory is counted, bounded and freed, bad specs are 400s."""

from __future__ import annotations

import pytest
import torch

from pagemesh.tests.diffusion_runs import image_job, run_alone, run_until_idle
from pagemesh.tests.diffusion_tiny import NUM_CLASSES, TinyDiTPipeline
from pagemesh.workers.diffusion.engine import DiffusionEngine, EngineConfig, FinishedJob, InvalidImageRequest
from pagemesh.workers.diffusion.pipelines.dit import DiTBlocks

LAYERS = 3  # block 0, then two deep blocks a cache may skip
HIDDEN_ROW_BYTES = 16 * 16 * 4  # 16 tokens (8x8, patch 2) x 16 dims (2 heads x 8) x fp32


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pipe() -> TinyDiTPipeline:
    return TinyDiTPipeline(num_layers=LAYERS)


def job(request_id: str, cache: str | None, **kw):
    return image_job(request_id, cache, **{**dict(prompt="a 3", size=(8, 8)), **kw})


def run(pipe, engine: DiffusionEngine, done: list[FinishedJob] | None = None):
    return run_until_idle(pipe, engine, done)


def alone(pipe, cache, **kw) -> tuple[FinishedJob, torch.Tensor]:
    return run_alone(pipe, job("r", cache, **kw))


def test_the_block_path_is_the_whole_forward(pipe):
    blocks = DiTBlocks(pipe.transformer)
    x = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([999.0, 500.0, 20.0, 999.0, 1.0])
    labels = torch.tensor([1, 2, 3, NUM_CLASSES, NUM_CLASSES])
    with torch.inference_mode():
        whole = pipe.transformer(x, timestep=t, class_labels=labels).sample
        hidden, rows = blocks.embed(x, t, labels)
        split = blocks.final(blocks.blocks(blocks.blocks(hidden, rows, 0, 1), rows, 1, LAYERS), rows)
        first_channel = DiTBlocks(pipe.transformer, out_channels=1).final(blocks.blocks(hidden, rows, 0, LAYERS), rows)
    assert torch.equal(split, whole)
    assert torch.equal(first_channel, whole[:, :1])
    assert blocks.hidden_shape((1, 8, 8)) == (16, 16) and blocks.hidden_shape((1, 16, 16)) == (64, 16)


@pytest.mark.parametrize("cache", ["fbcache:0", "teacache:0", "interval:1"])
@pytest.mark.parametrize("sampler", ["ddim", "dpmsolver++"])
def test_threshold_zero_or_interval_one_reproduces_the_uncached_image_exactly(pipe, cache, sampler):
    plain, expected = alone(pipe, None, n=2, sampler=sampler)
    cached, got = alone(pipe, cache, n=2, sampler=sampler)
    assert torch.equal(got, expected) and torch.equal(cached.images, plain.images)
    rows_steps = 4 * 10  # 2 images x cond/uncond, 10 steps
    assert (cached.cache, cached.blocks_computed, cached.blocks_skipped) == (cache, rows_steps * LAYERS, 0)
    assert (plain.cache, plain.blocks_computed, plain.blocks_skipped) == ("none", rows_steps * LAYERS, 0)


@pytest.mark.parametrize("cache", ["fbcache:0.12", "teacache:0.2", "interval:3"])
def test_a_cache_that_skips_changes_the_image_and_says_what_it_skipped(pipe, cache):
    _, expected = alone(pipe, None)
    cached, got = alone(pipe, cache)
    assert cached.blocks_skipped > 0 and cached.blocks_computed + cached.blocks_skipped == 2 * 10 * LAYERS
    assert not torch.equal(got, expected)  # how near, on a trained model: `pagemesh experiment diffusion-cache`


MIXED = {  # request -> (cache, n, sampler, steps, seed, steps run before the next one joins)
    "fb": ("fbcache:0.12", 2, "ddim", 10, 1, 1),
    "tea": ("teacache:0.2", 1, "dpmsolver++", 12, 2, 2),
    "every3": ("interval:3", 1, "euler", 9, 3, 1),
    "plain": ("none", 2, "ddim", 10, 4, 0),
}


def test_per_row_decisions_in_a_mixed_batch_give_each_request_its_image_alone(pipe):
    expected = {}
    for rid, (cache, n, sampler, steps, seed, _) in MIXED.items():
        expected[rid] = alone(pipe, cache, n=n, sampler=sampler, steps=steps, seed=seed)
    _, uncached = alone(pipe, None, n=2, sampler="ddim", steps=10, seed=4)

    engine = DiffusionEngine(pipe)
    for rid, (cache, n, sampler, steps, seed, then) in MIXED.items():  # they ride at different steps
        engine.add(job(rid, cache, n=n, sampler=sampler, steps=steps, seed=seed))
        for _ in range(then):
            engine.step()
    results = run(pipe, engine)
    for rid, (done, latents) in results.items():
        alone_done, alone_latents = expected[rid]
        torch.testing.assert_close(latents, alone_latents, rtol=1e-4, atol=1e-4)
        assert (done.blocks_computed, done.blocks_skipped) == (alone_done.blocks_computed, alone_done.blocks_skipped)
        assert done.batched_with == 3
    assert all(results[rid][0].blocks_skipped > 0 for rid in ("fb", "tea", "every3"))
    torch.testing.assert_close(results["plain"][1], uncached, rtol=1e-4, atol=1e-4)  # unaffected by the others
    assert results["plain"][0].blocks_skipped == 0
    stats = engine.stats()
    assert stats.blocks_computed == sum(d.blocks_computed for d, _ in results.values())
    assert stats.blocks_skipped == sum(d.blocks_skipped for d, _ in results.values())
    assert stats.requests_cached == 3 and 0 < stats.block_fraction < 1


def test_a_mixed_batch_runs_the_deep_blocks_only_on_the_computing_rows(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("every2", "interval:2", n=2, steps=6, guidance=2.0))  # 4 rows: CCrCrC
    engine.add(job("plain", None, n=1, steps=6, guidance=1.0))  # 1 row, every block
    pipe.block_calls.clear()
    run(pipe, engine)
    deep = [rows for start, stop, rows in pipe.block_calls if (start, stop) == (1, LAYERS)]
    first = [rows for start, stop, rows in pipe.block_calls if (start, stop) == (0, 1)]
    assert first == [5] * 6  # interval always runs block 0
    assert deep == [5, 5, 1, 5, 1, 5]  # at a reuse step only the plain request's row


def test_a_teacache_skip_runs_no_block_on_its_rows(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("tea", "teacache:100", n=1, steps=5, guidance=2.0))  # computes only the windows: CCrrC
    engine.add(job("plain", "none", n=1, steps=5, guidance=1.0))
    pipe.block_calls.clear()
    results = run(pipe, engine)
    # one call a step over the whole stack (no row decides after block 0): 3 rows, or the plain one
    assert pipe.block_calls == [(0, LAYERS, rows) for rows in (3, 3, 1, 1, 3)]
    assert (results["tea"][0].blocks_computed, results["tea"][0].blocks_skipped) == (2 * 3 * LAYERS, 2 * 2 * LAYERS)


def test_cache_memory_is_counted_while_running_and_back_to_zero_after_finish_and_abort(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("fb", "fbcache:0.1", n=2, steps=4))  # 4 rows x (residual + first-block residual)
    engine.add(job("every2", "interval:2", n=1, steps=8))  # 2 rows x residual
    engine.add(job("plain", None, n=1, steps=8))
    assert engine.stats().cache_bytes == 0  # nothing before a request's first step
    engine.step()
    expected = (4 * 2 + 2 * 1) * HIDDEN_ROW_BYTES
    assert engine.stats().cache_bytes == expected == engine.stats().cache_peak_bytes
    engine.abort("every2")
    assert engine.stats().cache_bytes == 4 * 2 * HIDDEN_ROW_BYTES
    results = run(pipe, engine)
    assert set(results) == {"fb", "plain"}
    stats = engine.stats()
    assert (stats.cache_bytes, stats.cache_peak_bytes, stats.requests_aborted) == (0, expected, 1)
    assert all(running.cache is None for running in engine.jobs.values())


def test_a_cache_over_the_budget_runs_uncached_and_says_so(pipe):
    budget = 4 * 2 * HIDDEN_ROW_BYTES  # exactly one n=2 guided fbcache request
    engine = DiffusionEngine(pipe, EngineConfig(cache_budget_bytes=budget))
    engine.add(job("first", "fbcache:0.1", n=2, seed=1))
    engine.add(job("second", "fbcache:0.1", n=2, seed=2))
    results = run(pipe, engine)
    first, (second, latents) = results["first"][0], results["second"]
    assert (first.cache, first.cache_over_budget) == ("fbcache:0.1", False)
    assert (second.cache, second.cache_over_budget, second.blocks_skipped) == ("none", True, 0)
    _, uncached = alone(pipe, None, n=2, seed=2)
    torch.testing.assert_close(latents, uncached, rtol=1e-4, atol=1e-4)
    stats = engine.stats()
    assert (stats.requests_over_cache_budget, stats.cache_peak_bytes, stats.cache_budget_bytes) == (1, budget, budget)


def test_the_worker_default_applies_when_a_request_asks_for_none(pipe):
    engine = DiffusionEngine(pipe, EngineConfig(cache="interval:2"))
    engine.add(job("default", None, steps=6))
    engine.add(job("asked", "none", steps=6))
    results = run(pipe, engine)
    assert results["default"][0].cache == "interval:2" and results["default"][0].blocks_skipped > 0
    assert results["asked"][0].cache == "none" and results["asked"][0].blocks_skipped == 0


@pytest.mark.parametrize("spec", ["deepcache", "interval:0", "fbcache:-1", "none:2"])
def test_a_bad_spec_is_a_400_on_cache_that_lists_the_policies(pipe, spec):
    engine = DiffusionEngine(pipe)
    with pytest.raises(InvalidImageRequest, match="^cache: ") as raised:
        engine.add(job("bad", spec))
    assert raised.value.param == "cache"
    if spec == "deepcache":
        assert "policies: none; interval:N" in raised.value.message and "fbcache:T" in raised.value.message
    assert not engine.has_work() and engine.num_waiting == 0


def test_a_pipeline_without_blocks_serves_only_none():
    pipe = TinyDiTPipeline(blocks=False)
    engine = DiffusionEngine(pipe)
    with pytest.raises(InvalidImageRequest, match="has no block-level forward") as raised:
        engine.add(job("cached", "fbcache:0.1"))
    assert raised.value.param == "cache"
    engine.add(job("plain", "none", steps=2))
    assert run(pipe, engine)["plain"][0].blocks_computed == 0  # nothing to count blocks of
    with pytest.raises(ValueError, match="serves only 'none'"):
        DiffusionEngine(pipe, EngineConfig(cache="fbcache:0.1"))
