"""compose.yaml for real: scripts/compose_check.sh builds the image FROM the local Debian base
(docker/base.sh), starts the mesh with two decode workers on a real Docker engine, sends traffic
through the published port (a chat answer, a PNG, both decode workers serving, a stream that
survives the kill of its decode container, which comes back) and takes it all down, leaving no
container, network or volume. Where dockerd is missing it is installed and started (as root)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK_S = 2400  # bounds a hang: the first run installs Docker and debootstraps the base image


def docker_reachable() -> str | None:
    """Why the check cannot run here, or None."""
    if os.geteuid() == 0 and (shutil.which("docker") or shutil.which("apt-get")):
        return None
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return None
    return "needs a Docker engine, or root with apt-get to install and start one"


@pytest.mark.slow
@pytest.mark.timeout(CHECK_S + 60)
@pytest.mark.skipif(docker_reachable() is not None, reason=str(docker_reachable()))
def test_compose_builds_scales_survives_a_killed_decode_worker_and_comes_down():
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "compose_check.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CHECK_S,
    )
    log = done.stdout + done.stderr
    print(log[-20000:])  # the step timings (pytest shows it with -s or on a failure)
    # the check's own lines first (what failed, in which step), then the services' last logs
    steps = "\n".join(line for line in log.splitlines() if line.startswith("[compose_check"))
    assert done.returncode == 0, steps[-6000:] + "\n--- the end of the log ---\n" + log[-4000:]
