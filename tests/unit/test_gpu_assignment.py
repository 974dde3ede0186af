"""Which GPUs the processes run on (common/gpus.py, pure): `pagemesh up` gives each LLM worker a
group of -tp x -pp GPUs of its own, the worker gives each rank one of them, and too few GPUs is an
error at start that names the numbers. No GPU here: the arithmetic, and the environment the
launcher and rank 0 hand their children."""

import pytest
import torch

from pagemesh.common.gpus import rank_gpus, visible_gpu_ids, worker_gpu_groups
from pagemesh.workers.engine import tensor_parallel
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine


def test_visible_gpus_are_named_as_cuda_visible_devices_names_them():
    assert visible_gpu_ids(None, 3) == ["0", "1", "2"]
    assert visible_gpu_ids("", 2) == ["0", "1"]
    assert visible_gpu_ids("4, 6,7", 3) == ["4", "6", "7"]
    assert visible_gpu_ids("GPU-aa,GPU-bb,GPU-cc", 2) == ["GPU-aa", "GPU-bb"]  # what the driver counts
    assert visible_gpu_ids("0,1", 0) == []


def test_each_worker_gets_a_disjoint_group_of_tp_x_pp_gpus_in_turn():
    six = [str(i) for i in range(6)]
    assert worker_gpu_groups(["m0", "m1", "m2"], six, tp=2) == {"m0": ("0", "1"), "m1": ("2", "3"), "m2": ("4", "5")}
    assert worker_gpu_groups(["m0", "m1"], six, tp=3) == {"m0": ("0", "1", "2"), "m1": ("3", "4", "5")}
    assert worker_gpu_groups(["m0"], six, tp=2, pp=2) == {"m0": ("0", "1", "2", "3")}  # 4 and 5 stay free
    # more workers than groups: round-robin, sharing whole groups, never half of one
    assert worker_gpu_groups(["p0", "d0", "d1"], ["3", "5", "7", "9", "11"], tp=2) == {
        "p0": ("3", "5"),
        "d0": ("7", "9"),
        "d1": ("3", "5"),
    }


def test_single_rank_workers_go_round_robin_over_single_gpus():
    assert worker_gpu_groups(["p0", "d0", "d1"], ["3", "5"]) == {"p0": ("3",), "d0": ("5",), "d1": ("3",)}
    assert worker_gpu_groups(["p0", "d0"], ["0"]) == {"p0": ("0",), "d0": ("0",)}


def test_a_diffusion_worker_takes_one_gpu_of_its_turns_group():
    placement = worker_gpu_groups(["m0", "diffusion-0"], ["0", "1", "2", "3"], tp=2, one_gpu={"diffusion-0"})
    assert placement == {"m0": ("0", "1"), "diffusion-0": ("2",)}


def test_no_visible_gpu_means_the_cpu_whatever_the_ranks():
    assert worker_gpu_groups(["m0"], [], tp=3) == {}


@pytest.mark.parametrize(
    "visible, tp, pp, message",
    [
        (["0", "1"], 3, 1, r"-tp 3 x -pp 1 runs 3 ranks, one GPU each, but 2 GPUs are visible \(0,1\)"),
        (["5"], 2, 2, r"-tp 2 x -pp 2 runs 4 ranks, one GPU each, but 1 GPU is visible \(5\)"),
        (["0", "1", "2"], 2, 2, r"runs 4 ranks.*but 3 GPUs are visible \(0,1,2\): make 4 visible"),
    ],
)
def test_too_few_gpus_for_one_worker_is_an_error_naming_the_numbers(visible, tp, pp, message):
    with pytest.raises(ValueError, match=message):
        worker_gpu_groups(["m0"], visible, tp, pp)
    with pytest.raises(ValueError, match=message):
        rank_gpus(visible, tp, pp)


def test_rank_i_runs_on_the_workers_i_th_gpu():
    assert rank_gpus(["4", "5", "6"], 3, 1) == ["4", "5", "6"]
    assert rank_gpus(["4", "5", "6", "7", "8"], 2, 2) == ["4", "5", "6", "7"]
    assert rank_gpus(["4"], 1, 1) == ["4"]


def test_rank_0_names_each_followers_gpu_from_what_it_sees(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5,7")  # the group `pagemesh up` gave this worker
    assert tensor_parallel.rank_gpu_names(3, 1) == ["2", "5", "7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert tensor_parallel.rank_gpu_names(1, 2) == ["0", "1"]
    with pytest.raises(ValueError, match="runs 4 ranks, one GPU each, but 3 GPUs are visible"):
        tensor_parallel.rank_gpu_names(2, 2)
    tensor_parallel.check_rank_gpus(torch.device("cpu"), 4, 4)  # the CPU: ranks share it


def test_rank_0_starts_no_follower_when_it_sees_too_few_gpus(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(tensor_parallel.subprocess, "Popen", lambda *a, **k: pytest.fail("started a rank"))
    spec = tensor_parallel.FollowerSpec(tmp_path, "float32", "cuda", 8, 4, world_size=2)
    with pytest.raises(ValueError, match=r"-tp 2 x -pp 1 runs 2 ranks, one GPU each, but 1 GPU is visible \(0\)"):
        tensor_parallel.FollowerRanks(spec)


def test_a_cuda_engine_with_too_few_gpus_is_refused_before_it_loads_anything(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def never_load(*args, **kwargs):
        pytest.fail("loaded a model")

    monkeypatch.setattr("pagemesh.workers.engine.engine_setup.load_model", never_load)
    with pytest.raises(ValueError, match=r"-tp 3 x -pp 1 runs 3 ranks, one GPU each, but 2 GPUs are visible"):
        Engine(EngineConfig(device="cuda", tensor_parallel_size=3))
