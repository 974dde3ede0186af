"""DeepCache on U-Nets (pipelines/unet.py's UNetDeepCache, engine/deep_cache.py), on the tiny
random Stable Diffusion folder (tests/diffusion_folders.py) and a tiny class-conditional
UNet2DModel: the split forward is the whole one, interval 1 reproduces the uncached image
exactly, interval 3 skips, per-row decisions in a mixed batch give each request its image alone,
only computing rows run the deep branch, cache memory is counted and freed, and the policies a
U-Net cannot serve are 400s."""

from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DModel

from pagemesh.tests.diffusion_folders import tiny_sd_folder
from pagemesh.tests.diffusion_runs import image_job, run_alone, run_until_idle
from pagemesh.workers.diffusion.engine import DiffusionEngine, EngineConfig, FinishedJob, InvalidImageRequest
from pagemesh.workers.diffusion.pipelines.loader import load_pipeline
from pagemesh.workers.diffusion.pipelines.unet import UNetDeepCache, unet_deep_cache

BLOCKS = 5  # the tiny SD U-Net: 2 down blocks, the mid block, 2 up blocks
SHALLOW = 2  # a reusing row runs down block 0 and the last up block
FEATURE_ROW_BYTES = 16 * 8 * 8 * 4  # 16x16 images: 16 channels x 8x8 latent pixels x fp32

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    # not "tiny-sd": test_pipeline_folders.py checks the name its own folder gets (tiny-sd0)
    return load_pipeline(tiny_sd_folder(tmp_path_factory.mktemp("deep-cache-sd")))


class RecordingDeep:
    """A deep_cache_forward that records how many rows each deep-branch run took."""

    def __init__(self, split: UNetDeepCache, calls: list[int]):
        self.split, self.calls = split, calls

    def __getattr__(self, name):
        return getattr(self.split, name)

    def deep(self, shallow, index=None):
        self.calls.append(shallow.hidden.shape[0] if index is None else len(index))
        return self.split.deep(shallow, index)


class Recording:
    """The SD pipeline, recording the float latents it decodes and the deep branch's rows."""

    def __init__(self, pipe):
        self.pipe, self.decoded, self.deep_rows = pipe, [], []
        self.deep_cache_forward = RecordingDeep(pipe.deep_cache_forward, self.deep_rows)

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    def decode(self, latents):
        self.decoded.append(latents.clone())
        return self.pipe.decode(latents)


@pytest.fixture
def pipe(sd) -> Recording:
    return Recording(sd)


def job(request_id: str, cache: str | None, **kw):
    return image_job(request_id, cache, **{**dict(prompt="a cat", size=(16, 16)), **kw})


def run(pipe, engine: DiffusionEngine, done: list[FinishedJob] | None = None):
    return run_until_idle(pipe, engine, done)


def alone(pipe, cache, **kw) -> tuple[FinishedJob, torch.Tensor]:
    return run_alone(pipe, job("r", cache, **kw))


# ---- the split forward ---------------------------------------------------------------------
@pytest.mark.parametrize("latent_shape", [(4, 8, 8), (4, 8, 12), (4, 6, 10)])  # 6x10: odd after the downsampler
def test_the_split_forward_is_the_sd_pipelines_denoise_exactly(sd, latent_shape):
    split = sd.deep_cache_forward
    assert isinstance(split, UNetDeepCache) and (split.num_blocks, split.shallow_blocks) == (BLOCKS, SHALLOW)
    rows = [sd.encode_prompt(p, "ugly")[i % 2] for i, p in enumerate(["a cat", "a dog", "red"])]
    x = torch.randn((3, *latent_shape), generator=torch.Generator().manual_seed(0))
    t = torch.tensor([981.0, 500.0, 21.0])
    with torch.inference_mode():
        whole = sd.denoise(x, t, sd.stack(rows))
        shallow = split.shallow_down(x, t, sd.stack(rows))
        feature = split.deep(shallow)
        out = split.shallow_up(shallow, feature)
    assert torch.equal(out, whole)
    assert feature.shape == (3, *split.feature_shape(latent_shape))


def tiny_class_unet() -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(
        num_class_embeds=11,
        block_out_channels=(16, 32),
        layers_per_block=1,
        sample_size=8,
        in_channels=1,
        out_channels=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    ).eval()


def test_the_split_forward_is_a_class_conditional_unet2dmodels_forward_exactly():
    unet = tiny_class_unet()
    split = unet_deep_cache(unet)
    assert split is not None and (split.num_blocks, split.shallow_blocks) == (BLOCKS, SHALLOW)
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([999.0, 500.0, 20.0, 1.0])
    labels = torch.tensor([0, 3, 10, 10])  # 10: the null class
    with torch.inference_mode():
        whole = unet(x, t, class_labels=labels).sample
        shallow = split.shallow_down(x, t, labels)
        feature = split.deep(shallow)
        out = split.shallow_up(shallow, feature)
        # rows of the deep branch are independent: a gathered run gives those rows' features
        some = split.deep(shallow, torch.tensor([2, 0]))
    assert torch.equal(out, whole)
    assert feature.shape == (4, *split.feature_shape((1, 8, 8))) == (4, 32, 8, 8)
    torch.testing.assert_close(some, feature[[2, 0]], rtol=1e-5, atol=1e-6)


def test_a_model_it_cannot_split_has_no_deep_cache_forward():
    assert unet_deep_cache(torch.nn.Linear(2, 2)) is None


# ---- through the engine --------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["ddim", "dpmsolver++", "euler"])
def test_interval_one_reproduces_the_uncached_image_exactly(pipe, sampler):
    plain, expected = alone(pipe, None, n=2, sampler=sampler)
    cached, got = alone(pipe, "interval:1", n=2, sampler=sampler)
    assert torch.equal(got, expected) and torch.equal(cached.images, plain.images)
    rows_steps = 4 * 10  # 2 images x cond/uncond, 10 steps
    assert (cached.cache, cached.blocks_computed, cached.blocks_skipped) == ("interval:1", rows_steps * BLOCKS, 0)
    assert (plain.cache, plain.blocks_computed, plain.blocks_skipped) == ("none", rows_steps * BLOCKS, 0)


def test_interval_three_changes_the_image_and_says_what_it_skipped(pipe):
    _, expected = alone(pipe, None)
    cached, got = alone(pipe, "interval:3")
    # 10 steps: 0-1 warm-up and 9 cool-down compute; of 2..8, 4 and 7 compute, 5 steps reuse
    reuse_rows = 2 * 5  # cond + uncond
    assert cached.blocks_skipped == reuse_rows * (BLOCKS - SHALLOW)
    assert cached.blocks_computed == 2 * 10 * BLOCKS - cached.blocks_skipped
    assert not torch.equal(got, expected)


MIXED = {  # request -> (cache, n, sampler, steps, seed, steps run before the next one joins)
    "every2": ("interval:2", 2, "ddim", 10, 1, 1),
    "every3": ("interval:3", 1, "dpmsolver++", 12, 2, 2),
    "exact": ("interval:1", 1, "euler", 9, 3, 1),
    "plain": ("none", 2, "ddim", 10, 4, 0),
}


def test_per_row_decisions_in_a_mixed_batch_give_each_request_its_image_alone(pipe):
    expected = {}
    for rid, (cache, n, sampler, steps, seed, _) in MIXED.items():
        expected[rid] = alone(pipe, cache, n=n, sampler=sampler, steps=steps, seed=seed)

    engine = DiffusionEngine(pipe)
    for rid, (cache, n, sampler, steps, seed, then) in MIXED.items():  # they ride at different steps
        engine.add(job(rid, cache, n=n, sampler=sampler, steps=steps, seed=seed))
        for _ in range(then):
            engine.step()
    results = run(pipe, engine)
    for rid, (done, latents) in results.items():
        alone_done, alone_latents = expected[rid]
        # the deep branch on a gathered subset of rows gives those rows' numbers: bit for bit where
        # oneDNN's convolutions do not depend on the batch size (AVX-512 CPUs, fp32, these sizes),
        # to fp32 rounding where they do (AVX2: another algorithm per batch size)
        torch.testing.assert_close(latents, alone_latents, rtol=1e-5, atol=1e-4, msg=rid)
        torch.testing.assert_close(done.images, alone_done.images, rtol=1e-5, atol=1e-4, msg=rid)
        assert (done.blocks_computed, done.blocks_skipped) == (alone_done.blocks_computed, alone_done.blocks_skipped)
        assert done.batched_with == 3
    assert all(results[rid][0].blocks_skipped > 0 for rid in ("every2", "every3"))
    assert results["plain"][0].blocks_skipped == 0 == results["exact"][0].blocks_skipped
    stats = engine.stats()
    assert stats.blocks_computed == sum(d.blocks_computed for d, _ in results.values())
    assert stats.blocks_skipped == sum(d.blocks_skipped for d, _ in results.values())
    assert stats.requests_cached == 3 and 0 < stats.block_fraction < 1


def test_a_mixed_batch_runs_the_deep_branch_only_on_the_computing_rows(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("every2", "interval:2", n=2, steps=6, guidance=2.0))  # 4 rows: CCrCrC
    engine.add(job("plain", None, n=1, steps=6, guidance=1.0))  # 1 row, every block
    pipe.deep_rows.clear()
    results = run(pipe, engine)
    assert pipe.deep_rows == [5, 5, 1, 5, 1, 5]  # at a reuse step only the plain request's row
    every2 = results["every2"][0]
    assert (every2.blocks_computed, every2.blocks_skipped) == (4 * (4 * BLOCKS + 2 * SHALLOW), 4 * 2 * (BLOCKS - 2))
    engine.add(job("every2-alone", "interval:2", n=1, steps=6))  # every row of the batch reuses at 2 and 4
    pipe.deep_rows.clear()
    run(pipe, engine)
    assert pipe.deep_rows == [2, 2, 2, 2]


# ---- what a U-Net serves -------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["fbcache:0.1", "teacache", "fbcache:0"])
def test_fbcache_and_teacache_on_a_unet_are_a_400_naming_what_it_serves(pipe, spec):
    engine = DiffusionEngine(pipe)
    with pytest.raises(InvalidImageRequest, match="^cache: ") as raised:
        engine.add(job("bad", spec))
    assert raised.value.param == "cache"
    assert "'none' and 'interval:N'" in raised.value.message and "U-Net" in raised.value.message
    assert not engine.has_work() and engine.num_waiting == 0


def test_the_worker_default_is_checked_at_start_and_applies_when_a_request_asks_for_none(pipe):
    for spec in ("fbcache:0.1", "teacache:0.3"):
        with pytest.raises(ValueError, match="U-Net: it serves 'none' and 'interval:N'"):
            DiffusionEngine(pipe, EngineConfig(cache=spec))
    engine = DiffusionEngine(pipe, EngineConfig(cache="interval:2"))
    engine.add(job("default", None, steps=6))
    engine.add(job("asked", "none", steps=6))
    results = run(pipe, engine)
    assert results["default"][0].cache == "interval:2" and results["default"][0].blocks_skipped > 0
    assert results["asked"][0].cache == "none" and results["asked"][0].blocks_skipped == 0


# ---- cache memory ----------------------------------------------------------------------------
def test_cache_memory_is_counted_while_running_and_back_to_zero_after_finish_and_abort(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("every2", "interval:2", n=2, steps=4))  # 4 rows x the deep feature
    engine.add(job("every3", "interval:3", n=1, steps=8))  # 2 rows
    engine.add(job("plain", None, n=1, steps=8))
    assert engine.stats().cache_bytes == 0  # nothing before a request's first step
    engine.step()
    expected = (4 + 2) * FEATURE_ROW_BYTES
    assert engine.stats().cache_bytes == expected == engine.stats().cache_peak_bytes
    engine.abort("every3")
    assert engine.stats().cache_bytes == 4 * FEATURE_ROW_BYTES
    results = run(pipe, engine)
    assert set(results) == {"every2", "plain"}
    stats = engine.stats()
    assert (stats.cache_bytes, stats.cache_peak_bytes, stats.requests_aborted) == (0, expected, 1)
    assert all(running.cache is None for running in engine.jobs.values())


def test_a_cache_over_the_budget_runs_uncached_and_says_so(pipe):
    budget = 4 * FEATURE_ROW_BYTES  # exactly one n=2 guided request
    engine = DiffusionEngine(pipe, EngineConfig(cache_budget_bytes=budget))
    engine.add(job("first", "interval:3", n=2, seed=1))
    engine.add(job("second", "interval:3", n=2, seed=2))
    results = run(pipe, engine)
    first, (second, latents) = results["first"][0], results["second"]
    assert (first.cache, first.cache_over_budget) == ("interval:3", False) and first.blocks_skipped > 0
    assert (second.cache, second.cache_over_budget, second.blocks_skipped) == ("none", True, 0)
    _, uncached = alone(pipe, None, n=2, seed=2)
    assert torch.equal(latents, uncached)
    stats = engine.stats()
    assert (stats.requests_over_cache_budget, stats.cache_peak_bytes, stats.cache_budget_bytes) == (1, budget, budget)
