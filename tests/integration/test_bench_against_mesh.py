"""`pagemesh bench` in-process against a real `pagemesh up --mixed 1` on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.loadgen import main as bench_main

REPO = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 40.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if "pagemesh is up" in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"pagemesh up did not come up in {UP_TIMEOUT_S:.0f}s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bench_against_a_mixed_mesh(tmp_path):
    started = time.monotonic()
    port = _free_port()
    log = tmp_path / "mesh.log"
    with log.open("w") as out:   # a file, not a pipe: the children's logs must never block on it
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--mixed", "1", "--port", str(port)],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        _wait_until_up(proc, log)
        print(f"mesh up after {time.monotonic() - started:.1f}s")
        result = tmp_path / "bench.json"
        bench_main.main(["--base-url", f"http://127.0.0.1:{port}/v1", "--num-prompts", "8",
                         "--random-input-len", "32", "--random-output-len", "16", "--prompt-as-token-ids",
                         "--max-concurrency", "8", "--result-json", str(result), "--no-progress"])
        [point] = json.loads(result.read_text())["points"]
        summary, requests = point["summary"], point["requests"]
        assert (summary["completed"], summary["failed"]) == (8, 0), point["errors"]
        assert requests["errors"] == [""] * 8
        assert requests["input_lens"] == [32] * 8 and requests["output_lens"] == [16] * 8
        assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (8 * 32, 8 * 16)
        # One gap per output chunk after the first (the gateway may hold a token's text back to
        # the next chunk, e.g. an incomplete UTF-8 sequence, so a chunk can carry two tokens).
        assert all(len(itl) == chunks - 1 and 8 <= chunks <= 16
                   for itl, chunks in zip(requests["itls"], requests["chunks"]))
        assert 0 < summary["median_ttft_ms"] <= summary["median_e2el_ms"]
        assert summary["output_throughput"] > 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
