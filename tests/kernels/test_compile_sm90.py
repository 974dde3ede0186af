"""Every kernel variant the launchers pick compiles for sm_90 (H100/H200) — checked on CPU.

The interpreter never lowers kernels; this runs tests/kernels/compile_sm90.py in a fresh
process (no TRITON_INTERPRET), which compiles through triton's bundled ptxas. The 16-bit
attention variants must also not spill registers (fp32 uses FMA products and may spill a little).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).with_name("compile_sm90.py")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the NVIDIA backend")
def test_all_variants_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    shards = max(1, min(2, os.cpu_count() or 1))  # the variants split between processes, one a core
    runs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(i), str(shards)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(shards)
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    stdout = "".join(out for out, _ in outputs)
    lines = [line for line in stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, out[-4000:] + err[-4000:]
    assert len(lines) >= 15 and all(line.startswith("ok") for line in lines), stdout
    attention_16bit = [line for line in lines if "_paged_attention_kernel" in line and "float32" not in line]
    assert attention_16bit and all("STACK:0 " in line for line in attention_16bit), stdout
