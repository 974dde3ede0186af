"""scripts/gpu_check.sh's control flow, with a stand-in `python` (PYTHON=...) that answers the
CUDA probes (FAKE_GPUS: how many GPUs it counts) and prints canned results: the report's
sections, the bench's time limit and deadline, the tensor-parallel run or the reason it was
skipped, the exit status. The real steps run on a GPU machine only."""

import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PY = """#!/usr/bin/env bash
case "$*" in
  *cuda.is_available*) exit ${FAKE_CUDA_RC:-0} ;;
  *cuda.device_count*) echo "${FAKE_GPUS:-1}" ;;
  *"import torch, triton"*) echo "torch T, triton R, CUDA C" ;;
  *get_device_name*) echo "Stand-in GPU" ;;
  "-m pytest"*"tests/gpu"*) [[ ${FAKE_GPU_RC:-1} == 0 ]] && echo "23 passed in 9.00s" || echo "1 failed, 22 passed in 9.00s"
                           exit ${FAKE_GPU_RC:-1} ;;
  "-m pytest"*) echo "90 passed in 9.00s" ;;
  bench/kernel_bench.py*) echo "kernel_bench $*"; exit ${FAKE_BENCH_RC:-0} ;;
  bench/gpu_engine.py*) echo "| 1 | CUDA graphs | 100 |" ;;
  bench/gpu_tensor_parallel.py*) echo "tp bench $*"; echo "tp trouble" >&2; exit ${FAKE_TP_RC:-0} ;;
  *) echo "unexpected: $*" >&2; exit 9 ;;
esac
"""


def run_check(tmp_path, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    report = tmp_path / "gpu.md"
    run_check.started = time.time()
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        env={
            **os.environ,
            "PYTHON": str(fake),
            "GPU_CHECK_REPORT": str(report),
            "PATH": f"{tmp_path}:/usr/bin:/bin",
            **env,
        },  # no nvidia-smi on this PATH
    )
    run_check.took = time.time() - run_check.started  # the script's own SECONDS is at most this
    return proc, report.read_text()


def test_report_has_every_step_and_a_failing_suite_fails_the_check(tmp_path):
    proc, report = run_check(tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "- GPU: Stand-in GPU" in report and "torch T, triton R, CUDA C" in report
    assert "- tests/kernels (compiled, no interpreter): PASS — 90 passed in 9.00s" in report
    assert "- tests/gpu (-m gpu): **FAIL (exit 1)** — 1 failed, 22 passed in 9.00s" in report
    deadline = re.search(r"kernel_bench bench/kernel_bench.py --deadline-at (\d+)", report)
    # 200 s limit - 20, from when the bench started: within the script's run, however slow it was
    assert (
        deadline and int(run_check.started) + 180 <= int(deadline[1]) <= int(run_check.started + run_check.took) + 180
    )
    assert "## Engine (bench/gpu_engine.py)" in report and "| 1 | CUDA graphs | 100 |" in report
    assert report.rstrip().endswith("exit status 1._")


def bench_limit(stdout: str) -> int:
    return int(re.search(r"\[gpu_check\] kernel bench \(limit (\d+)s\)", stdout)[1])


def test_a_short_budget_keeps_time_for_the_engine(tmp_path):
    # the limits are budget - 120 - the seconds the stand-in steps took (a second or so; more
    # on a loaded machine), and under 120 s the bench runs --quick
    proc, report = run_check(tmp_path, GPU_CHECK_BUDGET_S="260")
    limit = bench_limit(proc.stdout)
    # the script counts whole seconds (`date +%s`): a second boundary crossed costs one more
    assert 140 - int(run_check.took) - 1 <= limit <= 140  # 260 - 120 reserved for the engine step
    assert "kernel_bench bench/kernel_bench.py" in report and ("--quick" in report) == (limit < 120)
    proc, report = run_check(tmp_path, GPU_CHECK_BUDGET_S="200")
    limit = bench_limit(proc.stdout)
    assert 80 - int(run_check.took) - 1 <= limit <= 80 and f"(limit {limit}s) --quick" in proc.stdout
    assert f"_--quick: only {limit}s left for this step (no tile sweeps)._" in report
    assert "kernel_bench bench/kernel_bench.py --quick --deadline-at" in report


def test_a_bench_cut_at_its_limit_keeps_its_sections_and_does_not_fail_the_check(tmp_path):
    proc, report = run_check(tmp_path, FAKE_BENCH_RC="124", FAKE_GPU_RC="0")
    assert "**kernel_bench stopped at its 200s limit; the sections above were measured:**" in report
    assert "## Engine (bench/gpu_engine.py)" in report
    assert proc.returncode == 0, report
    proc, report = run_check(tmp_path, FAKE_BENCH_RC="3", FAKE_GPU_RC="0")
    assert "**kernel_bench failed (exit 3):**" in report and proc.returncode == 1


def test_without_cuda_it_says_so_and_fails(tmp_path):
    proc, report = run_check(tmp_path, FAKE_CUDA_RC="1")
    assert proc.returncode == 1
    assert "**No CUDA device: nothing run.**" in report and "## Kernel benchmarks" not in report


def test_one_gpu_skips_the_tensor_parallel_run_and_says_why(tmp_path):
    proc, report = run_check(tmp_path, FAKE_GPU_RC="0")
    assert proc.returncode == 0, report
    why = "skipped: 1 GPU(s) visible, -tp 2 needs 2 (one per rank)"
    assert f"[gpu_check] tensor parallel {why}" in proc.stdout
    assert f"## Tensor parallel (bench/gpu_tensor_parallel.py)\n\n_{why}._" in report
    assert "tp bench" not in report


def test_two_gpus_run_tensor_parallel_with_time_kept_for_it(tmp_path):
    proc, report = run_check(tmp_path, FAKE_GPUS="2", FAKE_GPU_RC="0", GPU_CHECK_BUDGET_S="460")
    assert proc.returncode == 0, report
    assert "tp bench bench/gpu_tensor_parallel.py --tp 2" in report and "tp trouble" not in report
    assert report.index("## Engine (bench/gpu_engine.py)") < report.index("## Tensor parallel")
    # the kernel bench leaves 120 s for the engine and 150 s for tensor parallel: 460 - 270
    assert 190 - int(run_check.took) - 1 <= bench_limit(proc.stdout) <= 190
    took = int(run_check.took) + 1
    engine = int(re.search(r"engine bench \(limit (\d+)s\)", proc.stdout)[1])
    assert 460 - 5 - 150 - took <= engine <= 460 - 5 - 150  # the engine step leaves tensor parallel its 150 s
    limit = int(re.search(r"tensor parallel -tp 2 on 2 GPUs \(limit (\d+)s\)", proc.stdout)[1])
    assert 460 - 5 - took <= limit <= 460 - 5  # the stand-in steps took no time: what is left
    proc, report = run_check(tmp_path, FAKE_GPUS="2", FAKE_GPU_RC="0", FAKE_TP_RC="1")
    assert proc.returncode == 1
    assert "**gpu_tensor_parallel.py failed (exit 1):**" in report and "tp trouble" in report
