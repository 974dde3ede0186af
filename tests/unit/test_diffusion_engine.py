"""The diffusion engine on a tiny random DiT (tests/diffusion_tiny.py): each sampler against a
plain diffusers loop, a request's images independent of its batch, step-level joins and leaves,
aborts, request and serial modes, CFG rows, shape turns, refusals."""

from __future__ import annotations

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from pagemesh.common.messages import ImageParams
from pagemesh.tests.diffusion_tiny import NUM_CLASSES, TinyDiTPipeline
from pagemesh.workers.diffusion.engine import (
    SAMPLERS,
    DiffusionEngine,
    EngineConfig,
    EngineFull,
    FinishedJob,
    ImageJob,
    InvalidImageRequest,
)

SMALL, LARGE = (1, 8, 8), (1, 16, 16)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def pipe() -> TinyDiTPipeline:
    return TinyDiTPipeline()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def params(prompt="a 3", *, n=1, steps=4, sampler="ddim", guidance=None, seed=0, size=8) -> ImageParams:
    return ImageParams(
        prompt=prompt,
        negative_prompt=None,
        n=n,
        width=size,
        height=size,
        num_inference_steps=steps,
        guidance_scale=guidance,
        sampler=sampler,
        seed=seed,
    )


def job(request_id: str, arrival: float = 0.0, **kw) -> ImageJob:
    return ImageJob(request_id=request_id, params=params(**kw), arrival=arrival)


def run(engine: DiffusionEngine) -> dict[str, tuple[int, FinishedJob]]:
    """Step until idle: request id -> (the step it finished in, counting from 1; its result)."""
    finished = {}
    step = 0
    while engine.has_work():
        step += 1
        assert step <= 100, "the engine made no progress"
        for done in engine.step():
            finished[done.request_id] = (step, done)
    return finished


def final_latents(pipe: TinyDiTPipeline, engine: DiffusionEngine, request_id: str) -> torch.Tensor:
    """The latents `request_id` decoded (decodes happen in the order requests finish)."""
    pipe.decoded.clear()
    order = [rid for rid, _ in sorted(run(engine).items(), key=lambda kv: kv[1][0])]
    return pipe.decoded[order.index(request_id)]


REFERENCE = {
    "ddpm": (DDPMScheduler, {}),
    "ddim": (DDIMScheduler, {}),
    "dpmsolver++": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "unipc": (UniPCMultistepScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
}


def reference_loop(pipe: TinyDiTPipeline, sampler: str, digit: int, n: int, steps: int, guidance: float, seed: int):
    """The request as a diffusers pipeline would run it alone: the same weights and noise."""
    cls, fixed = REFERENCE[sampler]
    scheduler = cls.from_config({**pipe.scheduler_config, **fixed})
    scheduler.set_timesteps(steps)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    latents = torch.cat([torch.randn((1, *SMALL), generator=g) for g in generators]) * scheduler.init_noise_sigma
    labels = torch.tensor([digit] * n + [NUM_CLASSES] * n)
    with torch.inference_mode():
        for t in scheduler.timesteps:
            x = scheduler.scale_model_input(latents, t)
            out = pipe.transformer(torch.cat([x, x]), timestep=t.float().expand(2 * n), class_labels=labels).sample
            cond, uncond = out[:n], out[n:]
            eps = uncond[:, :1] + guidance * (cond[:, :1] - uncond[:, :1])
            if sampler == "ddpm" and scheduler.config.variance_type == "learned_range":
                eps = torch.cat([eps, cond[:, 1:]], dim=1)
            kwargs = {"generator": generators} if sampler in ("ddpm", "euler") else {}
            latents = scheduler.step(eps, t, latents, **kwargs).prev_sample
    return latents


# ---- what each request computes -------------------------------------------------------------
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_each_sampler_matches_a_plain_diffusers_loop_with_guidance(pipe, sampler):
    engine = DiffusionEngine(pipe)
    engine.add(job("r", prompt="a 7", n=2, steps=5, sampler=sampler, guidance=3.0, seed=11))
    got = final_latents(pipe, engine, "r")
    torch.testing.assert_close(got, reference_loop(pipe, sampler, 7, 2, 5, 3.0, 11), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampler", ["ddpm", "dpmsolver++", "ddim"])
def test_a_learned_variance_serves_ddpm_and_is_dropped_for_the_others(sampler):
    pipe = TinyDiTPipeline(variance_type="learned_range")
    engine = DiffusionEngine(pipe)
    engine.add(job("r", prompt="4", n=1, steps=5, sampler=sampler, guidance=2.0, seed=5))
    got = final_latents(pipe, engine, "r")
    torch.testing.assert_close(got, reference_loop(pipe, sampler, 4, 1, 5, 2.0, 5), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_the_same_seed_gives_the_same_image_alone_and_in_a_mixed_batch(pipe, sampler):
    alone = DiffusionEngine(pipe)
    alone.add(job("me", n=2, steps=6, sampler=sampler, guidance=2.5, seed=42))
    expected = final_latents(pipe, alone, "me")

    mixed = DiffusionEngine(pipe)
    mixed.add(job("other1", prompt="1", n=3, steps=3, sampler="ddpm", seed=42))  # same seed, other request
    mixed.add(job("other2", prompt="9", steps=9, sampler="euler", guidance=4.0, seed=1))
    mixed.add(job("big", prompt="5", steps=4, sampler="unipc", seed=2, size=16))  # another shape
    mixed.step()  # "me" joins two steps late: it rides with others at other timesteps
    mixed.step()
    mixed.add(job("me", n=2, steps=6, sampler=sampler, guidance=2.5, seed=42))
    got = final_latents(pipe, mixed, "me")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert any(rows > 4 for rows, shape in pipe.calls if shape == SMALL)  # it did share forwards


def test_image_i_of_n_is_seeded_from_seed_plus_i(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("pair", n=2, seed=100, sampler="ddpm"))
    engine.add(job("second", n=1, seed=101, sampler="ddpm"))
    finished = run(engine)
    pair, second = finished["pair"][1].images, finished["second"][1].images
    assert (pair[1].int() - second[0].int()).abs().max() <= 1  # uint8 rounding of float noise
    assert not torch.equal(pair[0], pair[1])


# ---- step-level batching --------------------------------------------------------------------
def test_mixed_step_counts_and_samplers_share_forwards_and_each_finishes_after_its_own_steps(pipe):
    engine = DiffusionEngine(pipe)
    plan = {"a": ("ddpm", 5), "b": ("euler", 2), "c": ("dpmsolver++", 4), "d": ("unipc", 3), "e": ("ddim", 1)}
    for name, (sampler, steps) in plan.items():
        engine.add(job(name, sampler=sampler, steps=steps))
    finished = run(engine)
    assert {name: step for name, (step, _) in finished.items()} == {name: s for name, (_, s) in plan.items()}
    assert [rows for rows, _ in pipe.calls] == [5, 4, 3, 2, 1]
    assert {name: done.steps for name, (_, done) in finished.items()} == {n: s for n, (_, s) in plan.items()}
    assert finished["a"][1].batched_with == 4 and finished["a"][1].sampler == "ddpm"
    stats = engine.stats()
    assert (stats.steps, stats.rows, stats.images_finished, stats.requests_finished) == (5, 15, 5, 5)
    assert stats.rows_per_forward == {5: 1, 4: 1, 3: 1, 2: 1, 1: 1} and stats.mean_rows == 3.0


def test_a_new_request_joins_at_the_next_step_and_leaves_when_done(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("a", steps=4))
    assert engine.step() == []
    engine.add(job("b", steps=2))
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert engine.step() == []
    assert (engine.num_running, engine.num_waiting) == (2, 0)
    assert [done.request_id for done in engine.step()] == ["b"]
    assert engine.num_running == 1
    assert [done.request_id for done in engine.step()] == ["a"]
    assert [rows for rows, _ in pipe.calls] == [1, 2, 2, 1]
    assert not engine.has_work() and engine.step() == []


def test_abort_mid_way_frees_the_slot_for_the_next_waiting_request(pipe):
    engine = DiffusionEngine(pipe, EngineConfig(max_running=1))
    engine.add(job("a", steps=10))
    engine.add(job("b", steps=2))
    engine.step()
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert engine.abort("a")
    assert (engine.num_running, engine.num_waiting) == (0, 1) and "a" not in engine.jobs
    assert not engine.abort("a") and not engine.abort("never")
    finished = run(engine)
    assert list(finished) == ["b"] and finished["b"][0] == 2
    assert engine.stats().requests_aborted == 1
    assert engine.abort("b") is False  # finished requests are gone


def test_abort_a_waiting_request(pipe):
    engine = DiffusionEngine(pipe, EngineConfig(max_running=1))
    engine.add(job("a", steps=1))
    engine.add(job("b", steps=1))
    assert engine.abort("b") and engine.num_waiting == 1  # a waits on, alone
    assert list(run(engine)) == ["a"]


def test_guidance_puts_cond_and_uncond_rows_in_the_same_forward(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("guided", n=2, guidance=3.0, steps=2))
    engine.add(job("plain", n=3, guidance=1.0, steps=2))
    run(engine)
    assert pipe.calls == [(7, SMALL), (7, SMALL)]


def test_shapes_take_turns_without_starving(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("s1", steps=3))
    engine.add(job("l1", steps=2, size=16))
    engine.add(job("s2", steps=3))
    finished = run(engine)
    assert pipe.calls == [(2, SMALL), (1, LARGE), (2, SMALL), (1, LARGE), (2, SMALL)]
    assert {name: step for name, (step, _) in finished.items()} == {"l1": 4, "s1": 5, "s2": 5}


def test_the_row_budget_splits_a_shape_group_oldest_first(pipe):
    engine = DiffusionEngine(pipe, EngineConfig(max_batch_rows=4))
    engine.add(job("a", n=2, guidance=2.0, steps=2))  # 4 rows
    engine.add(job("b", n=1, steps=1))
    run(engine)
    assert [rows for rows, _ in pipe.calls] == [4, 4, 1]


# ---- the baselines --------------------------------------------------------------------------
def test_request_mode_gathers_a_batch_then_runs_it_to_the_end_while_arrivals_wait(pipe):
    clock = Clock()
    engine = DiffusionEngine(pipe, EngineConfig(batching="request", request_wait_s=0.05), clock=clock)
    engine.add(job("a", steps=3, arrival=0.0))
    assert engine.step() == [] and engine.stalled()  # the window is open: the worker waits
    clock.now = 0.02
    engine.add(job("b", steps=1, arrival=0.02))
    assert engine.step() == [] and engine.stalled()
    clock.now = 0.05
    assert [done.request_id for done in engine.step()] == ["b"]  # a and b start together
    assert not engine.stalled()
    engine.add(job("c", steps=1, arrival=0.05))
    clock.now = 0.1  # c's window has passed by the time a is done
    finished = run(engine)
    assert [rows for rows, _ in pipe.calls] == [2, 1, 1, 1]  # b left after its step; c waited for a
    assert list(finished) == ["a", "c"]


def test_request_mode_reports_queue_and_compute_times(pipe):
    clock = Clock()
    engine = DiffusionEngine(pipe, EngineConfig(batching="request", request_wait_s=0.05), clock=clock)
    engine.add(ImageJob(request_id="a", params=params(steps=2), arrival=0.0, queued_s=0.5))
    clock.now = 0.01
    assert engine.step() == [] and engine.stalled() and pipe.calls == []
    clock.now = 0.06  # the window has passed: its first step
    assert engine.step() == [] and len(pipe.calls) == 1
    clock.now = 0.07
    [done] = engine.step()
    assert done.queued_s == pytest.approx(0.5 + 0.06) and done.compute_s == pytest.approx(0.01)
    assert (done.steps, done.sampler, done.seed, done.batched_with) == (2, "ddim", 0, 0)
    assert done.images.dtype == torch.uint8 and done.images.shape == (1, 8, 8, 1)
    assert (done.resolved.width, done.resolved.height) == (8, 8)


def test_serial_mode_runs_one_request_at_a_time(pipe):
    engine = DiffusionEngine(pipe, EngineConfig(batching="serial"))
    engine.add(job("a", steps=2, n=2))
    engine.add(job("b", steps=1))
    engine.add(job("c", steps=1, guidance=2.0))
    finished = run(engine)
    assert [rows for rows, _ in pipe.calls] == [2, 2, 1, 2]
    assert {name: step for name, (step, _) in finished.items()} == {"a": 2, "b": 3, "c": 4}
    assert all(done.batched_with == 0 for _, done in finished.values())
    assert not engine.stalled()


# ---- refusals -------------------------------------------------------------------------------
def test_a_full_queue_refuses_with_engine_full_and_serves_on(pipe):
    engine = DiffusionEngine(pipe, EngineConfig(max_waiting=2, max_running=1))
    engine.add(job("a", steps=1))
    engine.add(job("b", steps=1))
    with pytest.raises(EngineFull, match="2 requests are already waiting; retry later"):
        engine.add(job("c", steps=1))
    assert engine.num_waiting == 2 and "c" not in engine.jobs
    engine.step()  # a is admitted and done: room again
    engine.add(job("c", steps=1))
    assert set(run(engine)) == {"b", "c"}


@pytest.mark.parametrize(
    "bad, param",
    [({"size": 12}, "size"), ({"sampler": "heun"}, "sampler"), ({"steps": 101}, "num_inference_steps")],
)
def test_bad_input_raises_invalid_image_request_and_holds_nothing(pipe, bad, param):
    engine = DiffusionEngine(pipe)
    with pytest.raises(InvalidImageRequest) as raised:
        engine.add(job("bad", **bad))
    assert raised.value.param == param
    assert not engine.has_work() and engine.num_waiting == 0


def test_a_prompt_without_a_digit_is_refused(pipe):
    engine = DiffusionEngine(pipe)
    with pytest.raises(InvalidImageRequest, match="the prompt must name a digit from 0 to 9"):
        engine.add(job("bad", prompt="a cat"))
    assert not engine.has_work()


def test_a_request_id_already_held_is_refused(pipe):
    engine = DiffusionEngine(pipe)
    engine.add(job("a"))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add(job("a"))


def test_guidance_in_one_call_per_scale_gives_each_request_its_own_numbers():
    """_guided_parts: the requests of a step sharing a guidance scale are guided in one call; each
    request's part equals `guide` over its own rows, bit for bit (n 1 and 2, two scales, one
    request unguided, an extra variance channel kept from the cond rows)."""
    from types import SimpleNamespace

    from pagemesh.workers.diffusion.engine.engine import DiffusionEngine, guide

    def request(n: int, scale: float):
        guided = scale > 1.0
        return SimpleNamespace(
            n=n,
            guided=guided,
            rows=2 * n if guided else n,
            resolved=SimpleNamespace(guidance_scale=scale),
            latents=torch.zeros(n, 1, 4, 4),
        )

    group = [request(1, 2.0), request(2, 7.5), request(1, 1.0), request(2, 2.0), request(1, 7.5)]
    out = torch.randn(sum(r.rows for r in group), 2, 4, 4, generator=torch.Generator().manual_seed(0))
    parts = DiffusionEngine._guided_parts(group, out)
    offset = 0
    for running, part in zip(group, parts):
        rows = out[offset : offset + running.rows]
        offset += running.rows
        if running.guided:
            expected = guide(rows[: running.n], rows[running.n :], running.resolved.guidance_scale, 1)
        else:
            expected = rows
        assert torch.equal(part, expected)
        assert part.shape == (running.n, 2, 4, 4)
