"""Compile this folder's C kernels for this machine once, and cache the shared libraries.

Three libraries: `pagemesh_cpu` from `SOURCES` (one file per kernel family, sharing common.h;
`pagemesh.kernels.cpu` binds it), `quant_matmul.c` (`pagemesh.kernels.cpu.quant`) and
`decode_layers.c` (`pagemesh.kernels.cpu.decode_layers`). Each is built with the system C
compiler (`$CC`, else `cc`) for the host CPU (`-march=native`), so the cache key holds the
sources and the local headers they include, the flags, the compiler and the CPU's feature flags;
a cached build is never used on a different CPU, and a changed source or header rebuilds.
Builds are atomic (written aside, then renamed), so processes starting together may build at
once safely. `Library` loads a built library once per process for the modules that call it.

    PAGEMESH_CACHE_DIR     where builds go (default ~/.cache/pagemesh)
    PAGEMESH_CPU_KERNELS   0: load no library (callers fall back to torch)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

KERNEL_DIR = Path(__file__).parent
# the pagemesh_cpu library, by kernel family: the functions pagemesh.kernels.cpu binds
SOURCES = tuple(
    KERNEL_DIR / name
    for name in (
        "norm.c",  # pm_add_rms_norm
        "activation.c",  # pm_silu_and_mul
        "rotary.c",  # pm_rotary
        "kv_write.c",  # pm_write_kv
        "attention.c",  # pm_paged_attention
        "attention_fp8.c",  # pm_paged_attention_fp8
        "amx_linear.c",  # pm_amx_init, pm_amx_pack, pm_amx_linear
        "sampling.c",  # pm_argmax_rows
        "lora.c",  # pm_lora_add
    )
)
LIBRARY_NAME = "pagemesh_cpu"
_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
FLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffast-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=gnu11",
]


class BuildError(RuntimeError):
    pass


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler found (set CC, or install gcc)")
    return cc


def _sources(sources: Path | Sequence[Path]) -> list[Path]:
    return [sources] if isinstance(sources, Path) else list(sources)


def _headers(sources: list[Path]) -> list[Path]:
    """The local headers (`#include "x.h"`, found next to the file that includes them) the
    sources include, directly or through another header; sorted."""
    found: set[Path] = set()
    todo = list(sources)
    while todo:
        path = todo.pop()
        for include in _INCLUDE.findall(path.read_bytes()):
            header = path.parent / include.decode()
            if header not in found and header.is_file():  # else a system header: the compiler finds it
                found.add(header)
                todo.append(header)
    return sorted(found)


def library_path(sources: Path | Sequence[Path] = SOURCES, name: str | None = None) -> Path:
    """Path of the library built from `sources` (C files next to this one: one file, or several
    into one library) for this machine, building it first if needed. The file is named `name`
    and the build's key: by default `pagemesh_cpu` for SOURCES, else the first file's stem."""
    sources = _sources(sources)
    if name is None:
        name = LIBRARY_NAME if sources == list(SOURCES) else sources[0].stem
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"C compiler {cc} does not run: {e}") from e
    key = hashlib.sha256()
    for path in [*sources, *_headers(sources)]:  # each file's name and bytes, so a rename or a move counts
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (" ".join(FLAGS).encode(), version.encode(), _cpu_signature().encode()):
        key.update(part)
    cache = Path(os.environ.get("PAGEMESH_CACHE_DIR", Path.home() / ".cache" / "pagemesh")) / "kernels"
    target = cache / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, *map(str, sources), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"building {', '.join(s.name for s in sources)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Library:
    """One C library of this folder, built and loaded on first `load()`. Every outcome is kept:
    the library, or why there is none (`error`: PAGEMESH_CPU_KERNELS=0, a failed build or load),
    so a process tries once."""

    def __init__(self, sources: Path | Sequence[Path], signatures: dict[str, list], name: str | None = None):
        self.sources = _sources(sources)
        self.name = name
        self.signatures = signatures  # function name -> ctypes argtypes; every function returns void
        self.error: str | None = None
        self._dll: ctypes.PyDLL | None = None

    def load(self) -> ctypes.PyDLL | None:
        """The loaded library with its functions' argtypes set, or None (see `error`)."""
        if self._dll is not None or self.error is not None:
            return self._dll
        if os.environ.get("PAGEMESH_CPU_KERNELS", "1") == "0":
            self.error = "disabled by PAGEMESH_CPU_KERNELS=0"
            return None
        try:
            # PyDLL: calls keep the GIL. They are short (tens of µs to ~0.5 ms, OpenMP inside), and a
            # worker's engine thread would otherwise queue for the GIL behind its event loop ~150
            # times a step
            dll = ctypes.PyDLL(str(library_path(self.sources, self.name)))
        except (BuildError, OSError) as e:
            self.error = str(e)
            return None
        for name, argtypes in self.signatures.items():
            fn = getattr(dll, name)
            fn.argtypes, fn.restype = argtypes, None
        self._dll = dll
        return dll
