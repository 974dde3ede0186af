"""Images through the real mesh: `pagemesh up` with a mixed LLM worker and a diffusion worker,
the official `openai` client, the embedded digits model, and an independent digit classifier
as the judge of what comes back.

    one mesh (module): images and text side by side; /v1/models lists both kinds; bad input is a
        400 in the OpenAI shape and the worker serves on; a client that leaves frees its slot
    separate processes: a killed diffusion worker fails its request with the OpenAI error and the
        pool's other worker serves on
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import urllib.request

import aiohttp
import numpy as np
import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, LATE_S, SeparateProcesses, metrics, per_worker, running_mesh, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.workers.diffusion.png import from_png_b64
from pagemesh.workers.shell.faults import DELAY_ENV

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def mesh():
    with running_mesh("--mixed", "1", "--diffusion", "1") as url:
        yield url


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def classify(images: list[np.ndarray]) -> list[int]:
    """The project's digit classifier on PNGs upscaled nearest-neighbour from 8×8."""
    import torch

    from pagemesh.bench.diffusion.classifier import digit_classifier

    native = [image[:: image.shape[0] // 8, :: image.shape[1] // 8, 0] for image in images]
    pixels = torch.tensor(np.stack(native), dtype=torch.float32)[:, None] / 255 * 2 - 1
    return digit_classifier().predict(pixels).tolist()


def test_a_handwritten_3_comes_back_as_a_3_beside_text(client):
    result = client.images.generate(prompt="a handwritten 3", n=4, extra_body={"seed": 3})
    images = [from_png_b64(d.b64_json) for d in result.data]
    assert len(images) == 4 and all(image.shape[:2] == (256, 256) for image in images)  # the default size
    assert classify(images).count(3) >= 3, classify(images)
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content


def test_the_same_seed_gives_the_same_image_and_the_extras_are_honoured(client):
    extra = {"seed": 11, "num_inference_steps": 12, "sampler": "ddim", "guidance_scale": 2.0}
    first = client.images.generate(prompt="the digit seven", size="8x8", extra_body=extra)
    again = client.images.generate(prompt="the digit seven", size="8x8", extra_body=extra)
    assert from_png_b64(first.data[0].b64_json).shape[:2] == (8, 8)  # the native size
    assert first.data[0].b64_json == again.data[0].b64_json
    usage = first.model_dump()["usage"]
    assert (usage["num_inference_steps"], usage["sampler"], usage["seed"]) == (12, "ddim", 11)


def test_models_lists_the_image_model_with_its_kind(mesh):
    with urllib.request.urlopen(mesh + "/v1/models") as r:
        cards = {card["kind"]: card for card in json.load(r)["data"]}
    assert set(cards) == {"llm", "diffusion"}
    assert "256x256" in cards["diffusion"]["sizes"] and "ddim" in cards["diffusion"]["samplers"]


@pytest.mark.parametrize(
    "request_, param, says",
    [
        (dict(prompt="a handwritten 3", size="300x300"), "size", "256x256"),
        (dict(prompt="a cat on a mat"), "prompt", "digit"),
        (dict(prompt="a handwritten 3", n=11), "n", "[1, 10]"),
        (dict(prompt="a handwritten 3", extra_body={"num_inference_steps": 100000}), "num_inference_steps", ""),
        (dict(prompt="a handwritten 3", extra_body={"sampler": "heun"}), "sampler", "ddim"),
        (dict(prompt="a handwritten 3", model="no-such-model"), "model", "does not exist"),
    ],
)
def test_bad_input_is_a_400_in_the_openai_shape_and_the_worker_serves_on(client, request_, param, says):
    with pytest.raises(openai.APIStatusError) as e:
        client.images.generate(**request_)
    assert e.value.status_code in (400, 404)
    error = e.value.body
    assert error["param"] == param and says in error["message"], error
    assert client.images.generate(prompt="4", size="8x8", extra_body={"num_inference_steps": 4}).data


def test_a_client_that_leaves_frees_its_slot_and_its_feature_cache(mesh, client):
    def running() -> float:
        return sum(v for w, v in per_worker(metrics(mesh), "pagemesh_num_requests_running").items() if "diffusion" in w)

    def cache_bytes() -> dict[str, float]:  # the diffusion worker's, from its heartbeats
        return per_worker(metrics(mesh), "pagemesh_diffusion_feature_cache_bytes")

    async def leave_mid_way() -> None:
        # A feature cache, so the abort must free its bytes too (the heartbeat shows them held meanwhile).
        body = {"prompt": "a 5", "num_inference_steps": 1000, "sampler": "ddpm", "n": 10, "cache": "interval:3"}
        async with aiohttp.ClientSession() as session:
            try:
                async with session.post(mesh + "/v1/images/generations", json=body, timeout=aiohttp.ClientTimeout(2)):
                    pass
            except TimeoutError:
                pass  # the client gives up after 2 s: the request is still denoising

    assert wait_until(lambda: running() == 0)
    assert wait_until(lambda: list(cache_bytes().values()) == [0.0])  # one diffusion worker, nothing cached
    held: list[float] = []

    def watch() -> None:  # samples the gauge while the request runs (the client leaves after 2 s)
        deadline = time.monotonic() + HANG_S
        while not held and time.monotonic() < deadline:
            held.extend(v for v in cache_bytes().values() if v > 0)
            time.sleep(0.05)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        watching = pool.submit(watch)
        asyncio.run(leave_mid_way())
        watching.result()
    assert held and held[0] > 0  # 10 images' residuals were held while it ran
    assert wait_until(lambda: running() == 0, timeout=LATE_S)  # aborted at a step boundary
    assert wait_until(lambda: list(cache_bytes().values()) == [0.0], timeout=LATE_S)  # and its cache freed
    started = time.monotonic()
    assert client.images.generate(prompt="6", size="8x8", extra_body={"num_inference_steps": 4}).data
    assert time.monotonic() - started < LATE_S


def test_a_killed_diffusion_workers_request_starts_over_on_the_other(tmp_path, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "0.1")  # 40 steps: a request runs for seconds
    procs = SeparateProcesses(
        str(tmp_path), "--prefill", "0", "--decode", "0", "--diffusion", "2", "--heartbeat-timeout", "2"
    )
    try:
        procs.start()
        client = openai.OpenAI(base_url=procs.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)

        def running() -> dict[str, float]:
            return per_worker(metrics(procs.url), "pagemesh_num_requests_running")

        slow = dict(prompt="a 2", size="8x8", extra_body={"num_inference_steps": 40, "seed": 5}, n=2)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.images.generate, **slow)
            assert wait_until(lambda: sum(running().values()) == 1)
            victim = max(running().items(), key=lambda kv: kv[1])[0]
            procs.kill(victim)
            killed_at = time.monotonic()
            drawn = pending.result(timeout=HANG_S)  # on the other worker, from the start: no error
        assert len(drawn.data) == 2 and all(d.b64_json for d in drawn.data)
        assert time.monotonic() - killed_at < HEARTBEAT_TIMEOUT_S + LATE_S
        assert client.images.generate(prompt="2", size="8x8", extra_body={"num_inference_steps": 4}).data
    finally:
        procs.stop()


def test_the_consistency_model_draws_the_digit_in_one_step_through_the_mesh():
    """The embedded consistency student (digits-dit-lcm) served by `pagemesh up --diffusion-model`:
    its one sampler, "lcm", is what a request gets, and one step draws the digit asked for."""
    flags = ("--prefill", "0", "--decode", "0", "--diffusion", "1", "--diffusion-model", "digits-dit-lcm")
    with running_mesh(*flags) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        result = client.images.generate(
            model="digits-dit-lcm", prompt="a handwritten 7", n=4, size="8x8", extra_body={"seed": 5}
        )
        usage = result.model_dump()["usage"]
        assert (usage["sampler"], usage["num_inference_steps"]) == ("lcm", 1)
        assert classify([from_png_b64(d.b64_json) for d in result.data]).count(7) >= 3
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(model="digits-dit-lcm", prompt="a 7", size="8x8", extra_body={"sampler": "ddim"})
        assert refused.value.body["param"] == "sampler" and "lcm" in refused.value.body["message"]
