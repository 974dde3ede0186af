"""TeaCache's rescaling polynomial (cache_policy.rescaled, training/fit_teacache.py): the decision
accumulates p(change) clamped at 0, the engine takes p from the pipeline's block forward (the
folder's pagemesh.json), teacache:0 still reproduces the uncached image exactly, and the fit
script writes coefficients a pipeline loads."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from pagemesh.common.messages import ImageParams
from pagemesh.workers.diffusion.engine import DiffusionEngine, FinishedJob, ImageJob
from pagemesh.workers.diffusion.engine.cache_policy import (
    COOLDOWN_STEPS,
    WARMUP_STEPS,
    CacheKind,
    CachePolicy,
    RowState,
    decide,
    rescaled,
)
from pagemesh.workers.diffusion.pipelines.common import ModelFolderError
from pagemesh.workers.diffusion.pipelines.embedded import DIGITS_PATH
from pagemesh.workers.diffusion.pipelines.loader import load_pipeline
from pagemesh.workers.diffusion.training import fit_teacache

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TEA = CachePolicy(kind=CacheKind.TEACACHE, value=0.33)  # no sum of the changes below lands on it
STEPS = 10


def decisions(policy: CachePolicy, changes: list[float | None], coefficients=None) -> str:
    """'C' (compute) / 'r' (reuse) per step, a change per step (None: no previous value)."""
    row = RowState()
    return "".join(
        "C" if decide(policy, row, step, len(changes), change, coefficients) else "r"
        for step, change in enumerate(changes)
    )


def test_rescaled_is_the_polynomial_clamped_at_zero():
    coefficients = (547.1, -114.2, 12.78, 0.138, 0.0026)
    for x in (0.0, 0.01, 0.05, 0.1, 0.3):
        assert rescaled(x, coefficients) == pytest.approx(float(np.polyval(coefficients, x)), rel=1e-12, abs=1e-15)
    assert rescaled(0.2, (1.0, -0.5)) == 0.0  # 0.2 - 0.5 < 0: clamped
    assert rescaled(0.2, None) == 0.2  # no coefficients: the raw change
    assert math.isnan(rescaled(float("nan"), coefficients))  # stays NaN, so it computes


def test_the_decision_accumulates_the_rescaled_change():
    changes = [None] + [0.1] * (STEPS - 1)
    raw = decisions(TEA, changes)
    doubled = decisions(TEA, changes, (2.0, 0.0))  # p(x) = 2x
    halved = decisions(TEA, changes, (0.5, 0.0))  # p(x) = x/2
    # warm-up CC, then the sum: 0.1 0.2 0.3 reuse, 0.4 computes (and restarts); cool-down C
    assert raw == "CC" + "rrrC" + "rrr" + "C"
    assert doubled == "CC" + "rC" * 3 + "r" + "C"  # 0.2 reuses, 0.4 computes
    assert halved == "CC" + "rrrrrr" + "C" + "C"  # 0.05 .. 0.3 reuse, 0.35 computes
    # negative p is clamped: nothing accumulates, every step between the windows reuses
    assert decisions(TEA, changes, (1.0, -0.5)) == "CC" + "r" * (STEPS - 3) + "C"
    # threshold 0 computes every step whatever p (the sum is never below 0)
    assert decisions(CachePolicy(kind=CacheKind.TEACACHE, value=0.0), changes, (1.0, -0.5)) == "C" * STEPS
    # NaN computes, as the raw NaN does
    assert decisions(TEA, [None, 0.1, 0.1, float("nan"), 0.1], (2.0, 0.0)) == "CCrCC"


def test_only_teacache_rescales():
    changes = [None] + [0.1] * (STEPS - 1)
    fb = CachePolicy(kind=CacheKind.FBCACHE, value=0.15)
    assert decisions(fb, changes, (2.0, 0.0)) == decisions(fb, changes) == "CC" + "r" * (STEPS - 3) + "C"


@pytest.fixture(scope="module")
def digits():
    """The embedded digits DiT, whose pagemesh.json carries its fitted coefficients."""
    pipe = load_pipeline(str(DIGITS_PATH))
    assert pipe.block_forward.teacache_coefficients is not None
    return pipe


def generate(pipe, cache: str | None, steps=STEPS) -> FinishedJob:
    engine = DiffusionEngine(pipe)
    params = ImageParams(
        prompt="a 3",
        negative_prompt=None,
        n=2,
        width=8,
        height=8,
        num_inference_steps=steps,
        guidance_scale=2.0,
        sampler="dpmsolver++",
        seed=5,
        cache=cache,
    )
    engine.add(ImageJob(request_id="r", params=params, arrival=0.0))
    done = []
    while engine.has_work():
        done += engine.step()
    return done[0]


def test_teacache_zero_still_reproduces_the_uncached_image_exactly(digits):
    plain, cached = generate(digits, None), generate(digits, "teacache:0")
    assert torch.equal(cached.images, plain.images) and cached.blocks_skipped == 0


def test_the_engine_decides_on_the_pipelines_polynomial(digits, monkeypatch):
    bf = digits.block_forward
    rows, blocks = 4, bf.num_blocks
    monkeypatch.setattr(bf, "teacache_coefficients", (0.0,))  # p = 0: every step between the windows reuses
    never = generate(digits, "teacache:0.01")
    assert never.blocks_computed == rows * (WARMUP_STEPS + COOLDOWN_STEPS) * blocks
    monkeypatch.setattr(bf, "teacache_coefficients", (1.0,))  # p = 1: every step computes
    always = generate(digits, "teacache:0.5")
    assert (always.blocks_computed, always.blocks_skipped) == (rows * STEPS * blocks, 0)
    monkeypatch.setattr(bf, "teacache_coefficients", None)  # the raw change
    raw = generate(digits, "teacache:0.1", steps=25)
    monkeypatch.undo()
    fitted = generate(digits, "teacache:0.1", steps=25)
    assert raw.blocks_skipped != fitted.blocks_skipped  # this model's p(x) is well below x


def test_the_fit_script_writes_coefficients_that_load(tmp_path):
    folder = tmp_path / "digits"
    shutil.copytree(DIGITS_PATH, folder)
    before = json.loads((folder / "pagemesh.json").read_text())
    fit_teacache.main(["--folder", str(folder), "--trajectories", "4", "--steps", "6", "--samplers", "ddim"])
    after = json.loads((folder / "pagemesh.json").read_text())
    coefficients = after["teacache_coefficients"]
    assert len(coefficients) == 5 and all(math.isfinite(c) for c in coefficients)
    assert coefficients != before["teacache_coefficients"]  # refitted on its tiny budget
    fitted = after["teacache_fit"]
    assert (fitted["trajectories"], fitted["steps"], fitted["samplers"], fitted["degree"]) == (4, [6], ["ddim"], 4)
    assert fitted["pairs"] == 4 * 2 * (6 - WARMUP_STEPS - COOLDOWN_STEPS)  # images x cond/uncond x skippable steps
    assert fitted["r2"] <= 1
    assert {k: v for k, v in after.items() if not k.startswith("teacache")} == {
        k: v for k, v in before.items() if not k.startswith("teacache")
    }
    assert load_pipeline(str(folder)).block_forward.teacache_coefficients == tuple(coefficients)


def test_a_pixart_folder_takes_its_coefficients_from_pagemesh_json(tmp_path):
    pytest.importorskip("transformers")
    from pagemesh.tests.diffusion_folders import tiny_pixart_sigma_folder

    folder = tiny_pixart_sigma_folder(tmp_path / "sigma")
    serving = tmp_path / "sigma" / "pagemesh.json"
    serving.write_text(json.dumps({"default_steps": 10, "teacache_coefficients": [2, 0.5], "teacache_fit": {}}))
    pipe = load_pipeline(folder)
    assert pipe.block_forward.teacache_coefficients == (2.0, 0.5) and pipe.serving.default_steps == 10
    serving.write_text(json.dumps({"teacache_coefficients": ["x"]}))
    with pytest.raises(ModelFolderError, match="teacache_coefficients"):
        load_pipeline(folder)
