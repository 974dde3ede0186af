"""When the scheduler calls the mesh ready (the gateway's /ready and its start-up wait read it):
with `--serves` (which `pagemesh up` sets from what it starts), every kind named needs a usable
pool; without it, the LLM pools, or the diffusion ones in a mesh of diffusion workers only. And a
prompt no worker's whole KV pool could hold is refused at once, not queued for ever."""

from __future__ import annotations

import argparse

import pytest

from pagemesh.common.messages import RequestFailed, ScheduleRequest, WorkerKind
from pagemesh.services.scheduler.config import (
    SchedulerConfig,
    add_policy_arguments,
    add_serves_argument,
    config_from_args,
)
from pagemesh.services.scheduler.core import SchedulerCore
from pagemesh.tests.scheduler_harness import DEFAULT, T0, TIMEOUT, TOK, TOK_OUT, disaggregated, register


def core_serving(*kinds: WorkerKind) -> SchedulerCore:
    config = SchedulerConfig("ipc:///unused", heartbeat_timeout=TIMEOUT, serves=kinds)
    return SchedulerCore(config, "inst-1", T0)


def test_a_diffusion_worker_registered_first_does_not_make_an_llm_and_image_mesh_ready():
    core = core_serving(WorkerKind.LLM, WorkerKind.DIFFUSION)
    register(core, "img0", kind=WorkerKind.DIFFUSION)
    assert not core.status(T0 + 1).ready
    register(core, "p0", role="prefill", now=T0 + 1)
    assert not core.status(T0 + 1).ready  # a prefill worker alone is no LLM pool
    register(core, "d0", role="decode", now=T0 + 1)
    assert core.status(T0 + 1).ready


def test_an_llm_mesh_named_so_is_not_ready_until_its_llm_pool_is():
    core = core_serving(WorkerKind.LLM)
    assert not core.status(T0).ready
    register(core, "img0", kind=WorkerKind.DIFFUSION)  # a stray diffusion worker changes nothing
    assert not core.status(T0 + 1).ready
    register(core, "m0", now=T0 + 1)
    assert core.status(T0 + 1).ready


def test_without_serves_a_lone_diffusion_worker_reads_as_ready_as_before():
    core = core_serving()
    assert not core.status(T0).ready
    register(core, "img0", kind=WorkerKind.DIFFUSION)
    assert core.status(T0 + 1).ready
    register(core, "p0", role="prefill", now=T0 + 1)  # an LLM worker: the LLM pools decide now
    assert not core.status(T0 + 1).ready


def parse(argv: list[str]) -> SchedulerConfig:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", default="ipc:///unused")
    parser.add_argument("--ready-address", default=None)
    add_policy_arguments(parser)
    add_serves_argument(parser)
    return config_from_args(parser.parse_args(argv), parser)


def test_the_serves_flag_reads_kinds_and_refuses_an_unknown_one(capsys):
    assert parse(["--serves", "llm,diffusion"]).serves == (WorkerKind.LLM, WorkerKind.DIFFUSION)
    assert parse([]).serves == ()
    with pytest.raises(SystemExit):
        parse(["--serves", "llm,video"])
    assert "unknown kind 'video'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "up_args, serves",
    [([], "llm,diffusion"), (["--diffusion", "0"], "llm"), (["--prefill", "0", "--decode", "0"], "diffusion")],
)
def test_pagemesh_up_tells_its_scheduler_what_it_starts(up_args, serves):
    from pagemesh.services.launcher import parse as parse_up
    from pagemesh.services.launcher import plan

    (argv,) = [argv for name, argv in plan(parse_up(up_args), "/tmp/pm") if name == "scheduler"]
    assert argv[argv.index("--serves") + 1] == serves


def test_a_prompt_larger_than_every_kv_pool_is_refused_at_once_instead_of_queued_for_ever():
    core = disaggregated()  # prefill and decode pools of 100 pages of 4 tokens

    def schedule_prompt(rid: str, n: int):
        msg = ScheduleRequest(
            request_id=rid, prompt_token_ids=[5] * n, sampling=DEFAULT, reply_to=TOK_OUT, arrival_time=0.0
        )
        return core.handle(TOK, msg, T0)

    assert schedule_prompt("big", 400) == [
        (
            TOK,
            RequestFailed(
                request_id="big",
                status=400,
                error_type="invalid_request_error",
                message="prompt: 400 tokens and one more do not fit any worker's KV pool "
                "(the largest holds 100 pages of 4 tokens)",
                param="prompt",
                code=None,
            ),
        )
    ]
    assert core.queued == 0
    assert {dest for dest, _ in schedule_prompt("fits", 399)} == {"p0", "d0"}  # 400 tokens: the whole pool


def test_which_pools_a_prompt_must_fit():
    from types import SimpleNamespace

    from pagemesh.services.scheduler.placement import too_large_for_every_pool

    def pool(pages: int):
        return [SimpleNamespace(page_size=4, total_pages=pages)]

    big, small = pool(100), pool(10)
    assert too_large_for_every_pool([], [], [], 10_000) is None  # no worker known yet: no verdict
    assert too_large_for_every_pool(big, [], [], 10) is None  # none that decodes (a lone one restarting)
    assert too_large_for_every_pool([], [], big, 399) is None  # 400 tokens: a mixed pool exactly
    assert too_large_for_every_pool([], [], big, 400) is not None
    assert too_large_for_every_pool(small, big, [], 200) is not None  # the prefill pool cannot hold it
    assert too_large_for_every_pool(small, big, [], 200, decode_alone=True) is None  # migrated: decode recomputes
    assert too_large_for_every_pool([], big, [], 200) is None  # no prefill worker left: a decode worker alone
    assert too_large_for_every_pool(big, small, big, 200) is None  # a mixed worker will do
