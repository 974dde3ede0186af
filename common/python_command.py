"""The command line that runs one of pagemesh's modules in a new interpreter (standard library only:
the tensor-parallel ranks import it where zmq and structlog are missing)."""

import sys


def python_module(module: str) -> list[str]:
    """`python -P -m MODULE` with this interpreter. -P keeps the working directory off sys.path:
    started from a clone's root, its kernels/ would answer for Hugging Face's `kernels`
    distribution, which transformers imports (see pagemesh/__init__.py)."""
    return [sys.executable, "-P", "-m", module]
