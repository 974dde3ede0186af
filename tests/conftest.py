"""Shared test set-up: keep torch to the machine's cores and quiet; Triton kernels interpreted on
a machine without CUDA.

TRITON_INTERPRET is read when triton and the kernels are imported, so it is set here, before any
test can import triton: set later (tests/kernels/conftest.py reloads our kernel modules), triton's
own library functions (tl.sum, ...) would stay compiled-only, and a run whose earlier tests had
imported triton failed in the interpreter (e.g. tests/integration/test_engine_scheduling.py
followed by tests/unit/test_cuda_graphs.py)."""

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collectstart(collector):
    """Each test module is compiled with IEEE subnormals (see `ieee_subnormals`): compiled while
    the process flushes them, a literal such as 5e-324 or -1e-310 becomes 0.0 in the code."""
    torch.set_flush_denormal(False)


@pytest.fixture(autouse=True)
def ieee_subnormals():
    """Each test starts with IEEE subnormals, as a fresh process does. The CPU kernels' library is
    built with -ffast-math, whose start-up code sets the loading thread to flush subnormals to
    zero; once a test (or a module's import, at collection) had loaded it, every later test in
    this process ran in that mode: Hypothesis refused to draw floats, and modules imported after
    it had their subnormal literals compiled to 0.0. A worker process keeps that mode: only the
    tests' shared process is reset."""
    torch.set_flush_denormal(False)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    models and tensors this small gain nothing from a second thread, and on a busy 2-core machine
    two threads waiting on each other at every op ran them 5-20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
