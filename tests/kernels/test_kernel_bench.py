"""bench/kernel_bench.py's sections at toy sizes (under the interpreter on CPU), so the one GPU
run of scripts/gpu_check.sh does not find the bench's own bugs: every section yields its rows,
the mixed batch agrees with SDPA flash on the same data, every sweep cell runs."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from pagemesh.kernels.attention import AttentionConfig

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kb():
    spec = importlib.util.spec_from_file_location("kernel_bench", ROOT / "bench" / "kernel_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(kb):
    geo = kb.Geometry(heads=4, kv_heads=2, head_dim=16, page=16, dtype=torch.bfloat16)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    pool = kb.make_pool(geo, 400, DEVICE, gen)
    return geo, kb.Timer(warmup=0, reps=1, device=DEVICE, flush_mb=1), pool, gen


def table_rows(lines):
    return [line for line in lines if line.startswith("| ") and not line.startswith("| ---")]


def test_copy_bandwidth_is_positive(kb, setup):
    assert kb.copy_bandwidth(setup[1], gib=1 / 64) > 0


def test_decode_rows_for_every_point_that_fits(kb, setup):
    geo, timer, pool, gen = setup
    lines = kb.bench_decode(timer, 100.0, geo, [1, 3, 30], [40, 100], pool, gen)
    rows = table_rows(lines)[1:]
    # 30 x 100 tokens need 210 pages of 16: more than the pool's 26, so that point is skipped
    assert [r.split(" | ")[:2] for r in rows] == [["| 1", "40"], ["| 1", "100"], ["| 3", "40"], ["| 3", "100"]]
    assert all(re.fullmatch(r"\d+%", r.split(" | ")[5]) for r in rows)


def test_mixed_batch_matches_sdpa_flash_and_sweeps_configs(kb, setup):
    geo, timer, pool, gen = setup
    cases = [("2 decodes @ 50 + 1 prefill x 20", 2, 50, 1, 20), ("prefill only: 2 x 17", 0, 0, 2, 17)]
    configs = [AttentionConfig(16, 16, 4, 2), AttentionConfig(32, 32, 4, 2)]
    lines = kb.bench_mixed(timer, geo, cases, configs, pool, gen)
    results, sweep = table_rows(lines)[1:3], table_rows(lines)[4:]
    assert [r.split(" | ")[0] for r in results] == ["| " + c[0] for c in cases]
    assert all(float(r.split(" | ")[4]) < 3e-2 for r in results)  # bf16 outputs, same data
    assert len(sweep) == 2 and all(len(r.split(" | ")) == 3 for r in sweep)


def test_decode_sweep_runs_every_cell_and_names_the_best(kb, setup):
    geo, timer, pool, gen = setup
    configs = [AttentionConfig(16, 16, 4, 3), AttentionConfig(16, 32, 4, 2)]
    chunks = list(kb.bench_decode_sweep(timer, 100.0, geo, [(2, 130), (40, 200)], configs, [1, 2, 4], pool, gen))
    assert len(chunks) == 1  # one per case; 40 x 200 does not fit
    lines = chunks[0]
    assert re.match(
        r"Batch 2, context 130: launcher's choice [\d.]+ ms \(\d+% of copy BW\); "
        r"best m16 n(16|32) w4 s[23] splits [124] [\d.]+ ms",
        lines[0],
    )
    rows = table_rows(lines)
    assert rows[0] == "| 2 x 130 | splits 1 | splits 2 |"  # 130 keys / 4 splits < 64 per split
    assert len(rows) == 3 and "err" not in "".join(rows)


def test_sweeps_time_nothing_past_their_deadline(kb, setup):
    geo, timer, pool, gen = setup
    configs = [AttentionConfig(16, 16, 4, 3)]
    chunks = list(kb.bench_decode_sweep(timer, 100.0, geo, [(2, 130)], configs, [1], pool, gen, deadline=0))
    assert chunks == [["_Sweep stopped before batch 2 x 130: out of time._", ""]]
    lines = kb.bench_mixed(timer, geo, [("1 prefill x 20", 0, 0, 1, 20)], configs, pool, gen, deadline=0)
    assert table_rows(lines)[-1] == "| 1 prefill x 20 | — |"


def test_a_config_that_does_not_compile_is_a_cell_not_the_end_of_the_bench(kb, setup, capsys):
    geo, timer, pool, gen = setup
    configs = [AttentionConfig(16, 24, 4, 2), AttentionConfig(16, 16, 4, 2)]  # 24: not a power of two
    lines = kb.bench_mixed(timer, geo, [("1 prefill x 20", 0, 0, 1, 20)], configs, pool, gen)
    cells = table_rows(lines)[-1].split(" | ")
    assert cells[1] == "err" and re.fullmatch(r"[\d.]+ \|", cells[2])
    [chunk] = kb.bench_decode_sweep(timer, 100.0, geo, [(2, 130)], configs, [1], pool, gen)
    bad, good = table_rows(chunk)[1:]
    assert bad.endswith("| err |") and re.search(r"\| [\d.]+ \|$", good)
    assert "kernel_bench: m16 n24" in capsys.readouterr().err
