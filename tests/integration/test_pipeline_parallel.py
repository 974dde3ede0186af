"""Pipeline stages inside a worker: the real rank processes (`FollowerRanks` starts them; gloo
point-to-point on loopback), this test process being rank 0 (stage 0), on the tiny random Llama
of test_tensor_parallel (2 layers: one a stage; heads divisible by 2).
The logits of every step equal the single-rank model's, over mixed prefill chunks and decodes,
copy-on-write page copies, swaps and prompt-logprob rows, with one step in flight or all of
them; a stage that dies takes its worker down, its other ranks with it. The engine of two
stages (steps in flight, preemption, prefix cache, n > 1, aborts) is test_pipeline_in_flight.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from pagemesh.bench.local_mesh import HANG_S, wait_until
from pagemesh.tests.integration import test_tensor_parallel as tp_tests
from pagemesh.tests.integration.test_tensor_parallel import NUM_PAGES, PAGE_SIZE, steps
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.engine.pipeline_parallel import StagePipe, stage_group, stage_layers
from pagemesh.workers.engine.tensor_parallel import COLLECTIVE_TIMEOUT_S, FollowerRanks, FollowerSpec, rank_context
from pagemesh.workers.model.loader import load_model

tiny_llama = tp_tests.tiny_llama  # the same model and steps, with their single-rank logits
single_rank_logits = tp_tests.single_rank_logits


def stage_zero(folder, tp_size: int, pp_size: int) -> tuple[ModelRunner, FollowerRanks]:
    """Rank 0 of a tp×pp worker, as the engine builds it (its followers started)."""
    from pagemesh.common.model_config import read_model_config

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


DIES = """
import sys
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

config = EngineConfig(model=sys.argv[1], dtype="float32", num_pages=64, page_size=4, tensor_parallel_size=2,
                      pipeline_parallel_size=2)
engine = Engine(config)
print(*[p.pid for p in engine.followers.procs], flush=True)
while True:
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
"""


def test_a_stage_that_dies_takes_the_worker_and_its_other_ranks_down(tiny_llama):
    """tp 2 × pp 2, generating without pause: rank 3 (stage 1, tp rank 1) killed mid-step. Rank 0
    exits with an error, and ranks 1 and 2 (one waits on an all-reduce with the dead rank, one
    for activations) are gone too: nothing hangs."""
    worker = subprocess.Popen([sys.executable, "-c", DIES, str(tiny_llama)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in worker.stdout.readline().split()]
        assert len(pids) == 3, "the engine did not start its three followers"
        os.kill(pids[2], signal.SIGKILL)
        assert worker.wait(timeout=HANG_S) == 1
        assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") and not is_zombie(pid) for pid in pids))
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
