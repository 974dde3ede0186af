"""Pure logic imports neither torch nor zmq: checked in a fresh interpreter where importing either
(or any of their submodules) raises ImportError."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # `python -c` puts its working directory on sys.path

BLOCK_TORCH_AND_ZMQ = textwrap.dedent("""
    import sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "zmq"):
                raise ImportError(f"{name} is blocked: this module must stay pure")
            return None

    sys.meta_path.insert(0, Blocked())
""")


def check_pure(*modules: str) -> None:
    imports = "".join(f"import {m}\n" for m in modules)
    code = BLOCK_TORCH_AND_ZMQ + imports + "assert not {'torch', 'zmq'} & set(sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr


def test_the_scheduler_core_imports_neither_torch_nor_zmq():
    check_pure("services.scheduler.core", "services.scheduler.placement", "services.scheduler.registry",
               "services.scheduler.prefix_index")
