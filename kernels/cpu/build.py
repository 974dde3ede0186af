"""Compile `pagemesh_cpu.c` for this machine once, and cache the shared library.

The library is built with the system C compiler (`$CC`, else `cc`) for the host CPU
(`-march=native`), so the cache key holds the source, the flags, the compiler and the CPU's
feature flags; a cached build is never used on a different CPU. Builds are atomic (written
aside, then renamed), so processes starting together may build at once safely.

    PAGEMESH_CACHE_DIR   where builds go (default ~/.cache/pagemesh)
"""

from __future__ import annotations

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
