"""Kernel tests run compiled on a GPU and in Triton's interpreter on CPU.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before any module of
`pagemesh.kernels` that imports triton is imported; modules imported earlier in this pytest process
(by another test directory) are reloaded so their kernels become interpreted.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for name in [m for m in sys.modules if m.startswith("pagemesh.kernels.")]:
        importlib.reload(sys.modules[name])
