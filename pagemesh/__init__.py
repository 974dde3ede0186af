"""pagemesh: a serving mesh for LLMs and diffusion models. `pagemesh` is the only name it installs.

The repository keeps the design card's folders at its top (common/ gateway/ kernels/ services/
workers/); they are this package's subpackages, `pagemesh.kernels` is kernels/ and so on.
setup.py maps them into the wheel. In a clone (an editable install, or a checkout on PYTHONPATH)
this package's path also covers the repository's root, which adds the clone-only `pagemesh.bench`
(benchmarks, the load client, experiments) and `pagemesh.tests`; the wheel has neither.

The root itself must never be on sys.path: its kernels/ would answer `import kernels`, the name of
Hugging Face's distribution that transformers imports. Python puts it there when it starts from
the clone with `python -m`, `python -c` or `python bench/x.py` (or PYTHONPATH=.), so importing
pagemesh takes it off again; the processes pagemesh starts run with `python -P`."""

import os
import sys
from pathlib import Path

_repo = Path(__file__).resolve().parent.parent


def _is_clone(root: Path) -> bool:
    """The folder above this package is pagemesh's repository (in a wheel it is site-packages)."""
    try:
        return 'name = "pagemesh"' in (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False


if _is_clone(_repo):
    __path__.append(str(_repo))

    def _is_repo_root(entry: str) -> bool:
        try:
            return Path(entry or os.curdir).resolve() == _repo
        except OSError:
            return False

    sys.path[:] = [entry for entry in sys.path if not _is_repo_root(entry)]
