"""`pagemesh bench --endpoint /v1/images/generations` in-process against a real mesh with one
diffusion worker and no LLM worker (`pagemesh up --prefill 0 --decode 0 --diffusion 1`: it
starts in ~55 s where `--mixed 1 --diffusion 1` took ~90 s on this 2-core machine at load 9; the
bench itself takes ~1 s) on loopback."""

from __future__ import annotations

import json
import time

import pytest

from pagemesh.bench.loadgen import main as bench_main
from pagemesh.bench.local_mesh import running_mesh


@pytest.mark.slow
def test_bench_images_against_a_mesh_with_a_diffusion_worker(tmp_path, capsys):
    started = time.monotonic()
    with running_mesh("--prefill", "0", "--decode", "0", "--diffusion", "1") as url:  # waits for "pagemesh is up"
        print(f"mesh up after {time.monotonic() - started:.1f}s")
        result = tmp_path / "images.json"
        bench_main.main(
            [
                "--base-url",
                f"{url}/v1",
                "--endpoint",
                "/v1/images/generations",
                "--num-prompts",
                "8",
                "--max-concurrency",
                "4",
                "--num-inference-steps",
                "10",
                "--image-seed",
                "0",
                "--result-json",
                str(result),
                "--no-progress",
            ]
        )
    [point] = json.loads(result.read_text())["points"]
    summary, requests = point["summary"], point["requests"]
    assert (summary["completed"], summary["failed"]) == (8, 0), point["errors"]
    assert requests["statuses"] == [200] * 8 and requests["images"] == [1] * 8
    assert summary["total_images"] == 8 and summary["image_throughput"] > 0
    # The mesh reports its own timings in usage: queue and compute fit inside the client's latency.
    assert all(q is not None and c is not None for q, c in zip(requests["queue_times"], requests["compute_times"]))
    assert all(
        0 <= q and 0 < c and q + c <= latency
        for q, c, latency in zip(requests["queue_times"], requests["compute_times"], requests["latencies"])
    )
    assert 0 < summary["median_e2el_ms"] <= summary["p99_e2el_ms"]
    assert "Image throughput (images/s)" in capsys.readouterr().out
