"""Compile `pagemesh_cpu.c` for this machine once, and cache the shared library.

The library is built with the system C compiler (`$CC`, else `cc`) for the host CPU
(`-march=native`), so the cache key holds the source, the flags, the compiler and the CPU's
feature flags; a cached build is never used on a different CPU. Builds are atomic (written
aside, then renamed), so processes starting together may build at once safely.
`Library` loads a built library once per process for the modules that call it
(`pagemesh.kernels.cpu`, `pagemesh.kernels.cpu.quant`).

    PAGEMESH_CACHE_DIR     where builds go (default ~/.cache/pagemesh)
    PAGEMESH_CPU_KERNELS   0: load no library (callers fall back to torch)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("pagemesh_cpu.c")
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


def library_path(source: Path = SOURCE) -> Path:
    """Path of the library built from `source` (a C file next to this one) for this machine,
    building it first if needed."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"C compiler {cc} does not run: {e}") from e
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_signature().encode()):
        key.update(part)
    cache = Path(os.environ.get("PAGEMESH_CACHE_DIR", Path.home() / ".cache" / "pagemesh")) / "kernels"
    target = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"building {source.name} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Library:
    """One C library of this folder, built and loaded on first `load()`. Every outcome is kept:
    the library, or why there is none (`error`: PAGEMESH_CPU_KERNELS=0, a failed build or load),
    so a process tries once."""

    def __init__(self, source: Path, signatures: dict[str, list]):
        self.source = source
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
            dll = ctypes.PyDLL(str(library_path(self.source)))
        except (BuildError, OSError) as e:
            self.error = str(e)
            return None
        for name, argtypes in self.signatures.items():
            fn = getattr(dll, name)
            fn.argtypes, fn.restype = argtypes, None
        self._dll = dll
        return dll
