"""Pure logic imports neither torch nor zmq (STYLE.md: habits 1; docs/design.md §3): each module listed
here is imported in a fresh interpreter where importing torch or zmq (or any of their submodules)
raises ImportError."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("torch", "zmq")
PURE_MODULES = [
    "pagemesh.workers.engine.block_manager",
    "pagemesh.workers.engine.scheduler",
    "pagemesh.workers.engine.sequence",
    "pagemesh.workers.engine.model_input",
    "pagemesh.workers.engine.speculative",
    "pagemesh.workers.engine.in_flight",
    "pagemesh.workers.engine.lora_slots",
    "pagemesh.workers.engine.lora_config",
    "pagemesh.common.lora",
    "pagemesh.services.scheduler.loras",
    "pagemesh.services.scheduler.tasks",
    "pagemesh.workers.shell.thread_policy",
    "pagemesh.common.cpu_threads",
    "pagemesh.common.quantization",
    "pagemesh.services.scheduler.core",
    "pagemesh.services.scheduler.failures",
    "pagemesh.services.scheduler.placement",
    "pagemesh.services.scheduler.registry",
    "pagemesh.services.scheduler.prefix_index",
    "pagemesh.services.scheduler.audio",
    "pagemesh.workers.audio.transcript",
    "pagemesh.common.messages",
    "pagemesh.common.page_hash",
    "pagemesh.common.model_config",
    "pagemesh.common.gpus",
    "pagemesh.workers.diffusion.engine.batcher",
    "pagemesh.workers.diffusion.engine.cache_policy",
    "pagemesh.workers.diffusion.engine.config",
    "pagemesh.workers.diffusion.engine.stats",
]
# docs/design.md §2: the sockets (transport.py) and their CurveZMQ keys (transport_curve.py)
ZMQ_MODULES = {"common/transport.py", "common/transport_curve.py"}
# processes that talk over sockets but must not load torch: the launcher parses every kind's flags
NO_TORCH_MODULES = [
    "pagemesh.services.launcher",
    "pagemesh.services.tokenizer.core",
    "pagemesh.services.tokenizer.config",
    "pagemesh.gateway.app",
]

GUARD = """
import importlib, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked: this module must stay pure")
        return None

sys.meta_path.insert(0, Blocked())
importlib.import_module({module!r})
leaked = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
assert not leaked, leaked
print("ok")
"""


def import_guarded(module: str, blocked: tuple[str, ...] = BLOCKED) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", GUARD.format(blocked=blocked, module=module)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


@pytest.mark.parametrize("module", PURE_MODULES)
def test_module_imports_without_torch_or_zmq(module):
    done = import_guarded(module)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]


@pytest.mark.parametrize("module", NO_TORCH_MODULES)
def test_module_imports_without_torch(module):
    done = import_guarded(module, ("torch",))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]


def test_the_guard_blocks_torch():
    """The finder really refuses what it should (a test that could not fail would prove nothing)."""
    done = import_guarded("torch.nn")
    assert done.returncode != 0 and "torch is blocked" in done.stderr


def zmq_importers() -> set[str]:
    """The project's modules (tests aside: they drive raw zmq as rogue peers) that import zmq."""
    found = set()
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith((".", "__")) and d not in ("tests", "node_modules")]
        for name in (f for f in files if f.endswith(".py")):
            path = Path(folder, name)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    modules = [node.module]
                else:
                    continue
                if any(m.split(".")[0] == "zmq" for m in modules):
                    found.add(path.relative_to(ROOT).as_posix())
    return found


def test_only_the_transport_modules_import_zmq():
    assert zmq_importers() == ZMQ_MODULES
