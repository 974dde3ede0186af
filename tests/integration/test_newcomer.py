"""The README's first command as a newcomer runs it: a clean clone of this repository, then
`bash scripts/install.sh && .venv/bin/pagemesh up`, started from a folder outside the clone. The
official client gets a chat answer and a PNG; Ctrl-C stops the mesh, and nothing is left running
and no socket folder is left in the temp directory."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pagemesh.tests.newcomer_smoke import smoke

ROOT = Path(__file__).resolve().parents[2]


def newcomer_env() -> dict[str, str]:
    """A shell without this test run's venv: no VIRTUAL_ENV, its bin/ off PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "TRITON_INTERPRET")}
    venv_bin = os.environ.get("VIRTUAL_ENV", "") and str(Path(os.environ["VIRTUAL_ENV"]) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p and p != venv_bin)
    return env


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a clone")
def test_a_fresh_clone_installs_and_serves_a_chat_and_an_image(tmp_path):
    clone, elsewhere, tmp = tmp_path / "clone", tmp_path / "elsewhere", tmp_path / "tmp"
    elsewhere.mkdir()
    tmp.mkdir()
    env = {**newcomer_env(), "TMPDIR": str(tmp)}
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, env=env)
    install = subprocess.run(["bash", "scripts/install.sh"], cwd=clone, env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert "pagemesh installed" in install.stdout

    answer = smoke(str(clone / ".venv" / "bin" / "pagemesh"), elsewhere, tmp, env)
    assert answer.strip()
