"""Pipeline stages inside a worker: the real rank processes (`FollowerRanks` starts them; gloo
point-to-point on loopback), this test process being rank 0 (stage 0), on the tiny random Llama
of test_tensor_parallel (2 layers: one a stage; heads divisible by 2).
The logits of every step equal the single-rank model's, over mixed prefill chunks and decodes,
copy-on-write page copies, swaps and prompt-logprob rows, with one step in flight or all of
them; an engine of two stages generates what one rank does (preemption, prefix cache); a stage
that dies takes its worker down, its other ranks with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from bench.local_mesh import HANG_S
from workers.engine.model_runner import ModelRunner
from workers.engine.pipeline_parallel import StagePipe, stage_group, stage_layers
from workers.engine.tensor_parallel import COLLECTIVE_TIMEOUT_S, FollowerRanks, FollowerSpec, rank_context
from workers.model.loader import load_model

from tests.integration.test_tensor_parallel import (  # noqa: F401  (fixtures)
    NUM_PAGES,
    PAGE_SIZE,
    single_rank_logits,
    steps,
    tiny_llama,
)


def stage_zero(folder, tp_size: int, pp_size: int) -> tuple[ModelRunner, FollowerRanks]:
    """Rank 0 of a tp×pp worker, as the engine builds it (its followers started)."""
    from common.model_config import read_model_config

    cpu, cfg = torch.device("cpu"), read_model_config(folder)
    group = stage_group(0, tp_size) if tp_size > 1 else None
    model = load_model(
        folder,
        torch.float32,
        cpu,
        rank_context(0, tp_size, None, 0, torch.float32, group),
        stage_layers(cfg.num_layers, pp_size, 0),
    )
    pipe = StagePipe(0, tp_size, pp_size, cfg, torch.float32, cpu, COLLECTIVE_TIMEOUT_S)
    spec = FollowerSpec(folder, "float32", "cpu", NUM_PAGES, PAGE_SIZE, tp_size, 1, pipeline_size=pp_size)
    followers = FollowerRanks(spec, group)
    return ModelRunner(model, NUM_PAGES, PAGE_SIZE, cpu, followers=followers, pipe=pipe), followers


@pytest.mark.parametrize(("tp_size", "pp_size"), [(1, 2), (2, 2)], ids=["pp2", "tp2-pp2"])
def test_pipeline_stages_give_the_single_rank_models_logits(tiny_llama, single_rank_logits, tp_size, pp_size):
    runner, followers = stage_zero(tiny_llama, tp_size, pp_size)
    try:
        assert len(followers.procs) == tp_size * pp_size - 1
        # stage 0 holds layer 0 and the embedding; its pool that layer's pages of its KV heads
        assert runner.model.layer_range == range(0, 1) and runner.model.norm is None and runner.model.lm_head is None
        assert runner.kv_cache.shape[0] == 1 and runner.kv_cache.shape[4] == 4 // tp_size
        in_order = [runner.execute(step).clone() for step in steps()]
        # every step launched before the first result is read: each stage runs them in order
        launched = [runner.launch(step) for step in steps()]
        all_in_flight = [f.result().clone() for f in launched]
        assert all(p.poll() is None for p in followers.procs)
    finally:
        followers.close()
        torch.distributed.destroy_process_group()
    assert [p.returncode for p in followers.procs] == [0] * (tp_size * pp_size - 1)
    for got, again, want in zip(in_order, all_in_flight, single_rank_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        torch.testing.assert_close(again, got, rtol=0, atol=0)
