"""kernels/cpu/build.py: several C files into one library, keyed by every file it compiles,
the local headers they include among them."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from pagemesh.kernels.cpu import build

pytestmark = pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"
)


def test_the_key_holds_every_source_and_included_header(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEMESH_CPU_KERNELS", "1")
    (tmp_path / "shared.h").write_text('#include "inner.h"\nstatic inline int twice(int x) { return INNER * x; }\n')
    (tmp_path / "inner.h").write_text("#define INNER 2\n")
    one, two = tmp_path / "one.c", tmp_path / "two.c"
    one.write_text('#include <stdint.h>\n#include "shared.h"\nint pm_one(int x) { return twice(x); }\n')
    two.write_text("int pm_two(int x) { return x + 2; }\n")
    assert build._headers([one, two]) == [tmp_path / "inner.h", tmp_path / "shared.h"]
    first = build.library_path([one, two], "both")
    assert first.name.startswith("both-") and build.library_path([one, two], "both") == first
    library = build.Library([one, two], {"pm_one": [ctypes.c_int], "pm_two": [ctypes.c_int]}, "both")
    assert library.load() is not None  # both files' functions in the one library
    seen = {first}
    for path, text in ((tmp_path / "inner.h", "#define INNER 3\n"), (two, "int pm_two(int x) { return x + 3; }\n")):
        path.write_text(text)  # a header included through another, then the second source: each rebuilds
        again = build.library_path([one, two], "both")
        assert again not in seen and again.exists()
        seen.add(again)


def test_the_kernels_library_is_built_from_every_family():
    assert build.SOURCES and all(s.suffix == ".c" and s.exists() for s in build.SOURCES)
    assert (build.KERNEL_DIR / "common.h") in build._headers(list(build.SOURCES))
