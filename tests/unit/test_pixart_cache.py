"""Feature caches on PixArt (pipelines/pixart.py's PixArtBlocks), Alpha and Sigma, on tiny random
folders (tests/diffusion_folders.py): the block-level forward is `denoise` bit for bit, threshold
0 / interval 1 reproduce the uncached image exactly through the engine, a skipping cache says what
it skipped, and per-row decisions in a mixed batch give each request the image it gets alone (as
tests/unit/test_diffusion_cache.py checks it for the DiT: to float rounding, as a batch of other
sizes may sum in another order)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from pagemesh.tests.diffusion_folders import tiny_pixart_alpha_folder, tiny_pixart_sigma_folder  # noqa: E402
from pagemesh.tests.diffusion_runs import image_job, run_alone, run_until_idle
from pagemesh.workers.diffusion.engine import DiffusionEngine, FinishedJob  # noqa: E402
from pagemesh.workers.diffusion.pipelines.loader import load_pipeline  # noqa: E402
from pagemesh.workers.diffusion.pipelines.pixart import PixArtBlocks  # noqa: E402

LAYERS = 2  # the tiny PixArts' blocks: block 0 and one deep block
STEPS = 8

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module", params=["alpha", "sigma"])
def pipe(request, tmp_path_factory):
    make = {"alpha": tiny_pixart_alpha_folder, "sigma": tiny_pixart_sigma_folder}[request.param]
    pipe = load_pipeline(make(tmp_path_factory.mktemp(f"tiny-pixart-{request.param}")))
    pipe.decoded = []  # every decode's input latents (float), in finishing order
    decode = pipe.decode

    def recording_decode(latents: torch.Tensor) -> torch.Tensor:
        pipe.decoded.append(latents.float().clone())
        return decode(latents)

    pipe.decode = recording_decode
    return pipe


def job(request_id: str, cache: str | None, **kw):
    return image_job(request_id, cache, **{**dict(prompt="a cat on a mat", size=None, steps=STEPS), **kw})


def run(pipe, engine: DiffusionEngine, done: list[FinishedJob] | None = None):
    return run_until_idle(pipe, engine, done)


def alone(pipe, cache, **kw) -> tuple[FinishedJob, torch.Tensor]:
    return run_alone(pipe, job("r", cache, **kw))


def _inputs(pipe, rows: int = 4):
    cat, empty = pipe.encode_prompt("a cat on a mat", None)
    dog, _ = pipe.encode_prompt("the dog", None)
    cond = pipe.stack([cat, dog, empty, empty][:rows])
    shape = pipe._latent_shape(*pipe.native_size)
    x = torch.randn(rows, *shape, generator=torch.Generator().manual_seed(0))
    return x, torch.tensor([999, 500, 20, 1][:rows]), cond


def test_the_block_path_is_denoise_bit_for_bit(pipe):
    bf = pipe.block_forward
    assert isinstance(bf, PixArtBlocks) and bf.num_blocks == LAYERS and bf.teacache_coefficients is None
    x, t, cond = _inputs(pipe)
    with torch.inference_mode():
        whole = pipe.denoise(x, t, cond)
        hidden, rows = bf.embed(x, t, cond)
        split = bf.final(bf.blocks(bf.blocks(hidden, rows, 0, 1), rows, 1, LAYERS), rows)
        index = torch.tensor([2, 0])  # some rows, reordered: each row's conditioning follows it
        picked = bf.final(bf.blocks(hidden.index_select(0, index), rows.select(index), 0, LAYERS), rows.select(index))
    assert torch.equal(split, whole)
    assert whole.shape == x.shape  # the learned-sigma channels dropped, as denoise does
    torch.testing.assert_close(picked, whole[index], rtol=1e-5, atol=1e-6)
    latent_shape = tuple(x.shape[1:])
    assert bf.hidden_shape(latent_shape) == tuple(hidden.shape[1:])


def test_the_modulated_input_is_what_block_0s_self_attention_reads(pipe):
    bf = pipe.block_forward
    x, t, cond = _inputs(pipe)
    seen = []
    hook = bf.transformer.transformer_blocks[0].attn1.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    try:
        with torch.inference_mode():
            hidden, rows = bf.embed(x, t, cond)
            bf.blocks(hidden, rows, 0, 1)
            modulated = bf.modulated_input(hidden, rows)
    finally:
        hook.remove()
    assert torch.equal(modulated, seen[0])


@pytest.mark.parametrize("cache", ["fbcache:0", "teacache:0", "interval:1"])
def test_threshold_zero_or_interval_one_reproduces_the_uncached_image_exactly(pipe, cache):
    plain, expected = alone(pipe, None, n=2, sampler="dpmsolver++")
    cached, got = alone(pipe, cache, n=2, sampler="dpmsolver++")
    assert torch.equal(got, expected) and torch.equal(cached.images, plain.images)
    rows_steps = 4 * STEPS  # 2 images x cond/uncond
    assert (cached.cache, cached.blocks_computed, cached.blocks_skipped) == (cache, rows_steps * LAYERS, 0)
    assert (plain.cache, plain.blocks_computed, plain.blocks_skipped) == ("none", rows_steps * LAYERS, 0)


@pytest.mark.parametrize("cache", ["fbcache:0.5", "teacache:0.5", "interval:3"])
def test_a_cache_that_skips_changes_the_image_and_says_what_it_skipped(pipe, cache):
    _, expected = alone(pipe, None)
    cached, got = alone(pipe, cache)
    assert cached.blocks_skipped > 0 and cached.blocks_computed + cached.blocks_skipped == 2 * STEPS * LAYERS
    assert not torch.equal(got, expected)


MIXED = {  # request -> (cache, n, sampler, steps, seed, steps run before the next one joins)
    "fb": ("fbcache:0.5", 2, "ddim", 8, 1, 1),
    "tea": ("teacache:0.5", 1, "dpmsolver++", 9, 2, 2),
    "every3": ("interval:3", 1, "euler", 7, 3, 1),
    "plain": ("none", 1, "ddim", 8, 4, 0),
}


def test_per_row_decisions_in_a_mixed_batch_give_each_request_its_image_alone(pipe):
    expected = {
        rid: alone(pipe, cache, n=n, sampler=sampler, steps=steps, seed=seed)
        for rid, (cache, n, sampler, steps, seed, _) in MIXED.items()
    }
    pipe.decoded.clear()
    engine, done = DiffusionEngine(pipe), []
    for rid, (cache, n, sampler, steps, seed, then) in MIXED.items():  # they ride at different steps
        engine.add(job(rid, cache, n=n, sampler=sampler, steps=steps, seed=seed))
        for _ in range(then):
            done += engine.step()
    results = run(pipe, engine, done)
    assert set(results) == set(MIXED)
    for rid, (done_job, latents) in results.items():
        alone_job, alone_latents = expected[rid]
        torch.testing.assert_close(latents, alone_latents, rtol=1e-4, atol=1e-4)
        assert (done_job.blocks_computed, done_job.blocks_skipped) == (
            alone_job.blocks_computed,
            alone_job.blocks_skipped,
        )
        assert done_job.batched_with == 3
    assert all(results[rid][0].blocks_skipped > 0 for rid in ("fb", "tea", "every3"))
    assert results["plain"][0].blocks_skipped == 0
    stats = engine.stats()
    assert stats.blocks_skipped == sum(d.blocks_skipped for d, _ in results.values())
    assert stats.requests_cached == 3 and 0 < stats.block_fraction < 1
