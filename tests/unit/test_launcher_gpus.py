"""`pagemesh up` on CUDA: workers spread over the visible GPUs (a tensor-parallel worker over a
group of its own: tests/unit/test_gpu_assignment.py has the arithmetic), a shared GPU's memory
divided among its workers, and the KV pool sized from a worker's share (the arithmetic; a real GPU
run is scripts/gpu_check.sh's)."""

import pytest

from pagemesh.services import launcher
from pagemesh.workers.engine.kv_pool_size import gpu_kv_budget
from pagemesh.workers.llm.main import parse as parse_worker

GB = 2**30


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(launcher, "nvidia_gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launcher.visible_gpus("auto") == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert launcher.visible_gpus("cuda") == ["3", "5"]
    assert launcher.visible_gpus("cpu") == []
    monkeypatch.setattr(launcher, "nvidia_gpu_count", lambda: 0)
    assert launcher.visible_gpus("auto") == []


def test_the_driver_lists_one_folder_per_gpu(tmp_path):
    from pagemesh.common.gpus import nvidia_gpu_count

    for bus in ("0000:01:00.0", "0000:41:00.0"):
        (tmp_path / bus).mkdir()
    (tmp_path / "stray-file").write_text("")
    assert nvidia_gpu_count(str(tmp_path)) == 2
    assert nvidia_gpu_count(str(tmp_path / "no-driver")) == 0


def test_pagemesh_up_itself_never_imports_torch(tmp_path):
    """The launcher runs no model: planning a mesh and placing it on GPUs leaves torch unloaded
    (a child process: this one has torch loaded already)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pagemesh.services import launcher\n"
        f"args = launcher.parse(['--prefill', '1', '--decode', '1', '--run-dir', {str(tmp_path)!r}])\n"
        f"launcher.on_gpus(args, launcher.plan(args, {str(tmp_path)!r}))\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("gpus, expect", [(1, [("0", 0.45), ("0", 0.45)]), (2, [("0", 0.9), ("1", 0.9)]), (0, None)])
def test_each_worker_sees_its_gpu_and_parses_its_memory_share(monkeypatch, tmp_path, gpus, expect):
    monkeypatch.setattr(launcher, "nvidia_gpu_count", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = launcher.parse(["--prefill", "1", "--decode", "1", "--diffusion", "0"])
    procs = launcher.on_gpus(args, launcher.plan(args, str(tmp_path)))
    assert [name for name, _, _ in procs] == [name for name, _ in launcher.plan(args, str(tmp_path))]
    argv = {name: a for name, a, _ in procs}
    env = {name: e for name, _, e in procs if e}
    if expect is None:
        assert env == {}
        assert parse_worker(argv["decode-0"][1:]).engine.gpu_memory_fraction == 0.9
        return
    assert set(env) == {"prefill-0", "decode-0"}
    for name, (gpu, fraction) in zip(["prefill-0", "decode-0"], expect):
        assert env[name] == {"CUDA_VISIBLE_DEVICES": gpu}
        assert parse_worker(argv[name][1:]).engine.gpu_memory_fraction == pytest.approx(fraction)
    assert "gateway" not in env and "scheduler" not in env


def test_kv_budget_is_the_share_less_the_weights_and_never_past_free_memory():
    # alone on a 140 GB GPU with 16 GB of weights: 0.9 * 140 - 16
    assert gpu_kv_budget(free=123 * GB, total=140 * GB, reserved=16 * GB, fraction=0.9) == pytest.approx(110 * GB)
    # sharing it with another worker: 0.45 * 140 - 16
    assert gpu_kv_budget(free=123 * GB, total=140 * GB, reserved=16 * GB, fraction=0.45) == pytest.approx(47 * GB)
    # another process holds most of it: 0.9 of what is free
    assert gpu_kv_budget(free=20 * GB, total=140 * GB, reserved=16 * GB, fraction=0.9) == pytest.approx(18 * GB)
    assert gpu_kv_budget(free=20 * GB, total=140 * GB, reserved=80 * GB, fraction=0.5) == 0.0


def test_a_diffusion_worker_gets_a_gpu_in_turn_and_leaves_the_llm_workers_memory_share(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "nvidia_gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = launcher.parse(["--prefill", "1", "--decode", "1"])  # and one diffusion worker, the default
    procs = launcher.on_gpus(args, launcher.plan(args, str(tmp_path)))
    argv = {name: a for name, a, _ in procs}
    env = {name: e["CUDA_VISIBLE_DEVICES"] for name, _, e in procs if e}
    assert env == {"prefill-0": "0", "decode-0": "1", "diffusion-0": "0"}
    assert parse_worker(argv["prefill-0"][1:]).engine.gpu_memory_fraction == 0.9  # alone among LLM workers
    assert argv["diffusion-0"][0] == "diffusion" and "--gpu-memory-utilization" not in argv["diffusion-0"]


def test_a_tensor_parallel_worker_sees_a_group_of_gpus_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "nvidia_gpu_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2,3,4,5")  # the driver counts 4 of them
    args = launcher.parse(["--mixed", "2", "-tp", "2", "--diffusion", "1"])
    procs = launcher.on_gpus(args, launcher.plan(args, str(tmp_path)))
    env = {name: e["CUDA_VISIBLE_DEVICES"] for name, _, e in procs if e}
    assert env == {"mixed-0": "1,2", "mixed-1": "3,4", "diffusion-0": "1"}
    argv = {name: a for name, a, _ in procs}
    assert parse_worker(argv["mixed-1"][1:]).engine.gpu_memory_fraction == 0.9  # no other LLM worker on 3,4


def test_too_few_gpus_for_a_worker_stops_pagemesh_up_at_start_naming_the_numbers(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(launcher, "nvidia_gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spawned = []
    monkeypatch.setattr(launcher.Supervisor, "spawn", lambda self, *a: spawned.append(a))
    with pytest.raises(SystemExit) as exit:
        launcher.main(["--mixed", "1", "-tp", "3", "--diffusion", "0", "--run-dir", str(tmp_path / "run")])
    assert exit.value.code == 1 and spawned == []  # nothing started
    err = capsys.readouterr().err
    assert "pagemesh up: a worker of -tp 3 x -pp 1 runs 3 ranks, one GPU each, but 2 GPUs are visible (0,1)" in err
