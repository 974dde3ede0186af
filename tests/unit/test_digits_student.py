"""The embedded few-step student (workers/diffusion/models/digits-dit-student): the embedded names
resolve to their package folders, `pagemesh up --diffusion-student N` starts workers serving it
under its name, and the images the engine makes with its defaults are the digits asked for, as
the project's classifier judges them."""

from __future__ import annotations

import pytest
import torch

from pagemesh.bench.diffusion.classifier import digit_classifier
from pagemesh.common.messages import ImageParams
from pagemesh.services import launcher
from pagemesh.workers.diffusion.engine.config import EngineConfig
from pagemesh.workers.diffusion.engine.engine import DiffusionEngine
from pagemesh.workers.diffusion.engine.jobs import ImageJob
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest
from pagemesh.workers.diffusion.pipelines.embedded import DIGITS_NAME, EMBEDDED_MODELS, STUDENT_NAME
from pagemesh.workers.diffusion.pipelines.loader import load_pipeline

PER_DIGIT = 30  # 300 images: one misjudged image moves the figure by a third of a percent


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def student():
    return load_pipeline(STUDENT_NAME)


def test_embedded_names_resolve_to_their_package_folders_and_serve_under_them(student):
    assert set(EMBEDDED_MODELS) >= {DIGITS_NAME, STUDENT_NAME, "digits-unet"}
    for name, folder in EMBEDDED_MODELS.items():
        assert folder.name == name and (folder / "model_index.json").is_file()
    teacher = load_pipeline(DIGITS_NAME)
    assert (teacher.name, student.name) == (DIGITS_NAME, STUDENT_NAME)
    assert load_pipeline(STUDENT_NAME, name="fast-digits").name == "fast-digits"
    # The student answers by DDIM in a few steps, guidance distilled in (one row per image).
    info = student.info
    assert (info.default_sampler, info.samplers, info.default_steps, info.max_steps) == ("ddim", ["ddim"], 4, 8)
    assert student.default_guidance == 1.0
    assert student.scheduler_config["prediction_type"] == "v_prediction"
    assert (teacher.info.default_steps, teacher.default_guidance) == (25, 1.5)


def test_the_students_images_at_its_defaults_are_the_digits_asked_for(student):
    engine = DiffusionEngine(student, EngineConfig(max_running=30, max_batch_rows=300))
    for digit in range(10):
        for k in range(PER_DIGIT // 10):  # n = 10 images a request, seeds 10 apart
            params = ImageParams(
                prompt=f"a handwritten {digit}",
                negative_prompt=None,
                n=10,
                width=None,
                height=None,
                num_inference_steps=None,
                guidance_scale=None,
                sampler=None,
                seed=1000 + 100 * digit + 10 * k,
            )
            engine.add(ImageJob(request_id=f"{digit}-{k}", params=params, arrival=0.0))
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert len(finished) == 3 * 10
    assert {(f.steps, f.sampler) for f in finished} == {(4, "ddim")}
    images = torch.cat([f.images for f in finished]).permute(0, 3, 1, 2).float() / 127.5 - 1  # [-1, 1]
    asked = torch.tensor([int(f.request_id.split("-")[0]) for f in finished for _ in range(10)])
    predicted = digit_classifier().predict(images)
    accuracy = float((predicted == asked).float().mean())
    assert accuracy >= 0.90, f"{accuracy:.1%} of {len(asked)} images classified as the digit asked for"
    for digit in range(10):  # and no digit is left out
        assert float((predicted[asked == digit] == digit).float().mean()) >= 0.7, digit


def test_guidance_above_1_is_refused_naming_the_field_since_the_students_is_distilled_in(student):
    def params(guidance: float | None) -> ImageParams:
        return ImageParams(
            prompt="a 7",
            negative_prompt=None,
            n=1,
            width=8,
            height=8,
            num_inference_steps=None,
            guidance_scale=guidance,
            sampler=None,
            seed=7,
        )

    engine = DiffusionEngine(student)
    for guidance in (1.5, 7.5):
        with pytest.raises(InvalidImageRequest) as refused:
            engine.add(ImageJob(request_id=f"g{guidance}", params=params(guidance), arrival=0.0))
        assert refused.value.param == "guidance_scale"
        assert "<= 1" in refused.value.message and "distilled" in refused.value.message
    assert not engine.has_work()  # nothing of a refused request stays behind
    for k, guidance in enumerate((None, 0.0, 1.0)):  # its default, and the values that add no uncond rows
        engine.add(ImageJob(request_id=f"ok{k}", params=params(guidance), arrival=0.0))
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert len(finished) == 3
    # Guidance <= 1 is no guidance: the same seed gives the same image whichever of them it asked.
    assert all(torch.equal(f.images, finished[0].images) for f in finished)
    # The teacher has no such cap: its guidance is a knob.
    teacher = load_pipeline(DIGITS_NAME)
    assert teacher.max_guidance is None and teacher.resolve(params(7.5)).guidance_scale == 7.5


def test_up_starts_student_workers_that_serve_it_under_its_name():
    args = launcher.parse(
        [
            "--prefill",
            "0",
            "--decode",
            "0",
            "--diffusion",
            "1",
            "--diffusion-student",
            "2",
            "--diffusion-served-model-name",
            "digits",
        ]
    )
    argv = dict(launcher.plan(args, "/tmp/run"))
    assert [name for name in argv if name.startswith("diffusion")] == [
        "diffusion-0",
        "diffusion-student-0",
        "diffusion-student-1",
    ]
    for name in ("diffusion-student-0", "diffusion-student-1"):
        flags = argv[name]
        assert flags[flags.index("--diffusion-model") + 1] == STUDENT_NAME
        assert "--diffusion-served-model-name" not in flags  # served under its own name
        assert flags[flags.index("--worker-id") + 1] == name
    assert "--diffusion-model" not in argv["diffusion-0"]  # the default worker keeps the embedded default
    assert argv["diffusion-0"][argv["diffusion-0"].index("--diffusion-served-model-name") + 1] == "digits"
    only_student = launcher.parse(["--prefill", "0", "--decode", "0", "--diffusion", "0", "--diffusion-student", "1"])
    assert [name for name in dict(launcher.plan(only_student, "/tmp/run")) if "diffusion" in name] == [
        "diffusion-student-0"
    ]
