"""Arrows one way: the model (workers/model/) is below the engine (workers/engine/), which builds
it, hands it an attention backend and steps it. Nothing under workers/model/ imports
`pagemesh.workers.engine`, at the top of a module or inside a function, by an absolute name, a
relative one (`from ..engine import x`), a package's attribute (`from pagemesh.workers import
engine`) or importlib. What both sides share (`AttentionMetadata`) lives below both, in
workers/attention/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOWER = ROOT / "workers" / "model"
FORBIDDEN = "pagemesh.workers.engine"
PROBE = LOWER / "probe.py"  # never written: a name that places the relative imports of the checks' own tests


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("pagemesh", *parts))


def _package(path: Path) -> str:
    module = _module_name(path)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_names(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file (or in `source`, read as that
    file), at any depth: for `from a import b` both `a` and `a.b` (b may be a submodule)."""
    found = []
    source = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package(path).split(".")
                base = ".".join(package[: len(package) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _is_forbidden(module: str) -> bool:
    return module == FORBIDDEN or module.startswith(FORBIDDEN + ".")


def test_the_model_imports_nothing_of_the_engine():
    files = sorted(LOWER.rglob("*.py"))
    assert files, LOWER
    offending = {}  # one entry per import statement
    for path in files:
        for line, module in imported_names(path):
            if _is_forbidden(module):
                offending.setdefault(f"{path.relative_to(ROOT)}:{line}", module)
    offending = [f"{where}: {module}" for where, module in offending.items()]
    assert not offending, "workers/model must not import the engine:\n" + "\n".join(offending)


@pytest.mark.parametrize(
    "source",
    [
        "from pagemesh.workers.engine.attention import AttentionMetadata\n",
        "import pagemesh.workers.engine.backend\n",
        "from pagemesh.workers import engine\n",
        "from ..engine import config\n",
        "from ..engine.backend import CpuKernelAttentionBackend\n",
        "def f():\n    from pagemesh.workers.engine.backend import CpuKernelAttentionBackend\n",
        "import importlib\nimportlib.import_module('pagemesh.workers.engine.config')\n",
    ],
)
def test_the_check_sees_every_form_of_import(source):
    """The check itself: a file of workers/model/ holding `source` would be caught."""
    assert any(_is_forbidden(module) for _, module in imported_names(PROBE, source))


def test_the_check_passes_the_allowed_imports():
    source = (
        "from pagemesh.workers.attention.metadata import AttentionMetadata\n"
        "from .layers import linear\n"
        "from ..attention import metadata\n"
        "import pagemesh.kernels.cpu\n"
    )
    assert not [module for _, module in imported_names(PROBE, source) if _is_forbidden(module)]
