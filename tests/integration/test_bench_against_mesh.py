"""`pagemesh bench` in-process against a real `pagemesh up --mixed 1` on loopback."""

from __future__ import annotations

import json
import time

import pytest

from pagemesh.bench.loadgen import main as bench_main
from pagemesh.bench.local_mesh import running_mesh


@pytest.mark.slow
def test_bench_against_a_mixed_mesh(tmp_path):
    started = time.monotonic()
    with running_mesh("--mixed", "1") as url:  # waits for "pagemesh is up", however long start-up takes
        print(f"mesh up after {time.monotonic() - started:.1f}s")
        result = tmp_path / "pagemesh.bench.json"
        bench_main.main(
            [
                "--base-url",
                f"{url}/v1",
                "--num-prompts",
                "8",
                "--random-input-len",
                "32",
                "--random-output-len",
                "16",
                "--prompt-as-token-ids",
                "--max-concurrency",
                "8",
                "--result-json",
                str(result),
                "--no-progress",
            ]
        )
        [point] = json.loads(result.read_text())["points"]
        summary, requests = point["summary"], point["requests"]
        assert (summary["completed"], summary["failed"]) == (8, 0), point["errors"]
        assert requests["errors"] == [""] * 8
        assert requests["input_lens"] == [32] * 8 and requests["output_lens"] == [16] * 8
        assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (8 * 32, 8 * 16)
        # One gap per output chunk after the first (the gateway may hold a token's text back to
        # the next chunk, e.g. an incomplete UTF-8 sequence, so a chunk can carry two tokens).
        assert all(
            len(itl) == chunks - 1 and 8 <= chunks <= 16 for itl, chunks in zip(requests["itls"], requests["chunks"])
        )
        assert 0 < summary["median_ttft_ms"] <= summary["median_e2el_ms"]
        assert summary["output_throughput"] > 0
