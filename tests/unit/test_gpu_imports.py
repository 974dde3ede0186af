"""The GPU machine has torch, triton, numpy, msgpack, aiohttp, uvloop, transformers and pytest, but
not pyzmq, structlog or gguf: bench/gpu_engine.py and the engine it drives must not need them.

Each check runs in a fresh interpreter where importing those modules fails."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("zmq", "structlog", "gguf")

PRELUDE = f"""
import importlib.util, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
sys.path.insert(0, {str(ROOT)!r})
spec = importlib.util.spec_from_file_location("gpu_engine", {str(ROOT / "bench" / "gpu_engine.py")!r})
gpu_engine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_engine)
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_and_the_engine_import_without_zmq_structlog_gguf():
    proc = run_python("""
        import pagemesh.kernels, pagemesh.kernels.reference, pagemesh.workers.model.ops
        import pagemesh.workers.engine.cuda_graphs, pagemesh.workers.engine.engine
        import pagemesh.workers.engine.tensor_parallel  # tensor parallel: NCCL on CUDA
        mesh = ("pagemesh.services", "pagemesh.gateway")
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("zmq", "structlog", "gguf") or m.startswith(mesh)))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "['gguf', 'structlog', 'zmq']"  # only the blocking entries


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_bench_exits_2_with_a_message_without_cuda():
    proc = run_python("sys.exit(gpu_engine.main())")
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and proc.stdout == ""


def test_bench_measurements_run_on_a_tiny_model_on_cpu():
    """The bench's engine-driving code, end to end at toy sizes, so a GPU session does not find
    its bugs: decode rows for each batch plus the eager row, and the TTFT line."""
    proc = run_python("""
        import torch
        from pagemesh.workers.model.loader import build_random_model
        cfg = gpu_engine.ModelConfig(
            architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=512, tie_word_embeddings=False,
            rope_scaling=gpu_engine.LLAMA3_8B.rope_scaling,
        )
        model = build_random_model(cfg, torch.bfloat16, torch.device("cpu"))
        print("\\n".join(gpu_engine.run(model, 100.0, batches=(1, 3), prompt_len=20, steps=4, ttft_len=40)))
    """)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[:2] for r in rows] == [["| 1", "eager"], ["| 3", "eager"], ["| 1", "eager"]]
    assert all(r.split(" | ")[4] == "—" for r in rows)  # no graphs on CPU: no replay timing
    assert "TTFT of a 40-token prompt" in proc.stdout


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the message given without two GPUs")
def test_tensor_parallel_bench_imports_without_them_and_exits_2_without_two_gpus():
    proc = run_python(f"""
        spec = importlib.util.spec_from_file_location("gpu_tp", {str(ROOT / "bench" / "gpu_tensor_parallel.py")!r})
        gpu_tp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gpu_tp)
        sys.exit(gpu_tp.main(["--tp", "2"]))
    """)
    assert proc.returncode == 2, proc.stderr
    assert "-tp 2 needs 2 GPUs" in proc.stderr and proc.stdout == ""
