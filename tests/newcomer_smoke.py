"""The newcomer's smoke: `pagemesh up` with its defaults (a port aside), started from a given folder
with its own temp directory; the official client gets a chat answer and a PNG; Ctrl-C stops it;
nothing is left running and no socket folder is left in that temp directory. Used by
tests/integration/test_newcomer.py (after a fresh clone's install) and scripts/check_latest.sh
(on the newest releases the ranges allow):

    python -P -m pagemesh.tests.newcomer_smoke PAGEMESH_COMMAND
"""

import base64
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import openai
import psutil

from pagemesh.bench.local_mesh import HANG_S, free_port

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def smoke(pagemesh: str, elsewhere: Path, tmp: Path, env: dict[str, str]) -> str:
    """Runs the smoke (AssertionError on a failure); returns the chat answer. `env` is the
    environment of `pagemesh up`; its TMPDIR is set to `tmp`."""
    env = {**env, "TMPDIR": str(tmp)}
    port = free_port()
    mesh = subprocess.Popen(
        [pagemesh, "up", "--port", str(port)],
        cwd=elsewhere,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in mesh.stdout:
            lines.append(line)
            if "pagemesh is up" in line:
                up.set()

    threading.Thread(target=read, daemon=True).start()
    tree: list[int] = []
    try:
        while not up.wait(0.5):
            assert mesh.poll() is None, "pagemesh up exited:\n" + "".join(lines[-40:])
        tree = [mesh.pid, *(p.pid for p in psutil.Process(mesh.pid).children(recursive=True))]
        assert len(tree) >= 6  # launcher, gateway, tokenizer, scheduler, an LLM worker, a diffusion worker
        run_dirs = list(tmp.glob("pagemesh-*"))
        assert len(run_dirs) == 1 and any(p.is_socket() for p in run_dirs[0].iterdir())

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=HANG_S)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16
        )
        assert chat.choices[0].message.content.strip() and chat.usage.completion_tokens > 0
        image = client.images.generate(prompt="a handwritten 3", n=1)
        assert base64.b64decode(image.data[0].b64_json).startswith(b"\x89PNG\r\n\x1a\n")

        os.killpg(mesh.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        assert mesh.wait(timeout=HANG_S) == 0, "".join(lines[-40:])
    finally:
        if mesh.poll() is None:
            os.killpg(mesh.pid, signal.SIGKILL)
            mesh.wait()
    left = [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert left == [], "still running: " + str([psutil.Process(pid).cmdline() for pid in left])
    assert list(tmp.glob("pagemesh-*")) == [] and [p for p in tmp.rglob("*") if p.is_socket()] == []
    return chat.choices[0].message.content


def main() -> None:
    pagemesh = sys.argv[1] if len(sys.argv) > 1 else "pagemesh"
    with tempfile.TemporaryDirectory() as top:
        elsewhere, tmp = Path(top) / "elsewhere", Path(top) / "tmp"
        elsewhere.mkdir()
        tmp.mkdir()
        answer = smoke(pagemesh, elsewhere, tmp, dict(os.environ))
    print(f"newcomer smoke passed: a chat answer ({answer!r}), a PNG, a clean stop")


if __name__ == "__main__":
    main()
