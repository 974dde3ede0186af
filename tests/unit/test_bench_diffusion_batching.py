"""bench/diffusion_batching.py's pure parts: the mode order, the means and the paired ratios."""

from __future__ import annotations

import pytest

from pagemesh.bench.diffusion_batching import aggregate, markdown, mode_order, paired_ratios, plot, requests_for


def _record(mode, repeat, clients, images_per_s, p99_ms, batched=None):
    return {
        "mode": mode,
        "repeat": repeat,
        "clients": clients,
        "completed": 8,
        "failed": 0,
        "images_per_s": images_per_s,
        "p50_ms": p99_ms / 2,
        "p99_ms": p99_ms,
        "mean_queue_ms": None,
        "mean_compute_ms": None,
        "mean_batched_with": batched,
    }


# Repetition 1 runs 10% slower than repetition 0 (the drift the pairing cancels).
RECORDS = [
    _record("serial", 0, 16, 2.0, 8000, 1.0),
    _record("request", 0, 16, 8.0, 2000, 12.0),
    _record("step", 0, 16, 10.0, 1600, 15.0),
    _record("step", 1, 16, 9.0, 1760, 15.0),
    _record("request", 1, 16, 7.2, 2200, 12.0),
    _record("serial", 1, 16, 1.8, 8800, 1.0),
    _record("serial", 0, 1, 2.0, 500),
    _record("step", 0, 1, 2.0, 500),
]


def test_mode_order_alternates_and_point_sizes():
    modes = ("serial", "request", "step")
    assert [mode_order(modes, r) for r in range(3)] == [modes, modes[::-1], modes]
    assert (requests_for(1, 4, 8), requests_for(16, 4, 8)) == (8, 64)


def test_means_over_repetitions_and_paired_ratios():
    table = aggregate(RECORDS)
    assert list(table) == [("serial", 1), ("step", 1), ("serial", 16), ("request", 16), ("step", 16)]
    step16 = table[("step", 16)]
    assert step16["images_per_s"] == pytest.approx(9.5) and step16["per_repeat"] == [10.0, 9.0]
    assert (step16["p99_ms"], step16["p50_ms"], step16["mean_batched_with"]) == pytest.approx((1680, 840, 15))
    assert table[("step", 1)]["mean_batched_with"] is None
    assert paired_ratios(RECORDS, "step", "request") == {16: pytest.approx([1.25, 1.25])}
    assert paired_ratios(RECORDS, "step", "serial") == {1: [1.0], 16: pytest.approx([5.0, 5.0])}
    assert paired_ratios(RECORDS, "step", "request", "p99_ms") == {16: pytest.approx([0.8, 0.8])}


def test_report_and_plot(tmp_path):
    setup = {
        "date": "d",
        "commit": "c",
        "machine": "m",
        "load_before": "1",
        "load_after": "2",
        "mesh_flags": ["--mixed", "1"],
        "requests": "r",
        "steps": "50",
        "n": 1,
        "repeats": 2,
        "orders": [("serial", "request", "step"), ("step", "request", "serial")],
    }
    text = markdown(RECORDS, setup)
    assert "| step | 16 | 9.50 | 10.00, 9.00 | 840 | 1680 | 15.0 | 0 |" in text
    assert "| 16 | 1.25x (1.25-1.25) | 5.00x (5.00-5.00) | 0.80x (0.80-0.80) | 0.20x (0.20-0.20) |" in text
    assert "| 1 | - | 1.00x | - | 1.00x |" in text
    plot(RECORDS, tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").stat().st_size > 1000
