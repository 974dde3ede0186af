"""`pagemesh up`'s own duties: children's log lines relayed whole, its socket folder removed, and
the ready line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.services import launcher
from pagemesh.services.log_relay import LogRelay

WRITER = """
import json, sys
for i in range(200):
    sys.stderr.write(json.dumps({"writer": sys.argv[1], "i": i, "pad": "x" * 9000}) + "\\n")
    sys.stderr.flush()
"""


def test_long_lines_of_several_children_come_out_whole():
    """Lines of 9 KB (over PIPE_BUF) from three processes at once: each output line is one record."""
    out = io.BytesIO()
    relay = LogRelay(out)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(k)], stderr=subprocess.PIPE) for k in range(3)]
    for proc in procs:
        relay.attach(proc)
    for proc in procs:
        assert proc.wait(timeout=HANG_S) == 0
    relay.drain(HANG_S)
    records = [json.loads(line) for line in out.getvalue().decode().splitlines()]
    assert sorted((r["writer"], r["i"]) for r in records) == [(str(k), i) for k in range(3) for i in range(200)]


def test_stop_removes_the_socket_folder_it_made_and_keeps_a_given_one(tmp_path):
    made = launcher.Mesh(launcher.parse(["--mixed", "1"]))
    assert Path(made.run_dir).is_dir() and Path(made.run_dir).name.startswith("pagemesh-")
    made.stop()
    assert not Path(made.run_dir).exists()
    given = launcher.Mesh(launcher.parse(["--mixed", "1", "--run-dir", str(tmp_path / "run")]))
    given.stop()
    assert (tmp_path / "run").is_dir()


def test_the_ready_line_names_url_model_and_workers():
    args = launcher.parse(["--port", "8123"])
    assert launcher.ready_line(args, "1 prefill + 1 decode + 1 diffusion") == (
        "pagemesh is up: http://127.0.0.1:8123/v1  model HuggingFaceTB/SmolLM2-135M-Instruct "
        "(alias SmolLM2-135M-Instruct)  workers: 1 prefill + 1 decode + 1 diffusion  (Ctrl-C stops)"
    )
