"""`pagemesh experiment paged-memory --quick`: the cheapest experiment end to end on the real model."""

from __future__ import annotations

import pytest

from pagemesh.bench.experiments.main import main


@pytest.mark.slow
def test_paged_memory_quick_writes_its_report(tmp_path, capsys):
    main(["paged-memory", "--quick", "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("paged-memory: KV utilization paged ")
    md = (tmp_path / "paged-memory.md").read_text()
    assert "**Key figure:** " + last in md
    assert (tmp_path / "paged-memory_utilization.png").stat().st_size > 0


@pytest.mark.slow
def test_diffusion_cache_quick_writes_its_report(tmp_path, capsys):
    main(["diffusion-cache", "--quick", "--out", str(tmp_path), "--threads", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("diffusion-cache: block speed-up at PSNR 35 dB")
    md = (tmp_path / "diffusion-cache.md").read_text()
    assert "## Each cache beside fewer steps at equal block compute" in md and "**Key figure:** " + last in md
    assert (tmp_path / "diffusion-cache_fidelity.png").stat().st_size > 0


@pytest.mark.slow
def test_diffusion_batching_quick_writes_its_report(tmp_path, capsys):
    main(["diffusion-batching", "--quick", "--out", str(tmp_path), "--threads", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("diffusion-batching at ") and "request-level" in last and "step+teacache:0.1" in last
    md = (tmp_path / "diffusion-batching.md").read_text()
    assert "## Latency and throughput" in md and "**Key figure:** " + last in md
    for batching in ("serial", "request", "step"):
        assert f"| {batching} | none |" in md
    assert (tmp_path / "diffusion-batching_latency.png").stat().st_size > 0


@pytest.mark.slow
def test_diffusion_cache_deep_quick_runs_the_sweeps_on_the_12_block_asset(tmp_path, capsys):
    main(["diffusion-cache-deep", "--quick", "--out", str(tmp_path), "--threads", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("diffusion-cache-deep: block speed-up at PSNR 35 dB")
    md = (tmp_path / "diffusion-cache-deep.md").read_text()
    assert "digits-dit-deep: 12-layer DiT" in md and "**Key figure:** " + last in md
    assert "## Step-level batching under load" not in md  # the batching experiment covers load


@pytest.mark.slow
def test_parallel_quick_measures_one_rank_refuses_two_and_models_the_gpus(tmp_path, capsys):
    main(["parallel", "--quick", "--out", str(tmp_path), "--threads", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("parallel: tp1 ") and "Llama-3-8B on H200 KV tokens tp1 0.86M -> tp8 7.53M" in last
    md = (tmp_path / "parallel.md").read_text()
    assert "| tp2 | tensor-parallel size 2 does not divide the model's 9 query heads" in md  # SmolLM2's heads
    assert "| tp1 | 1 |" in md and "| Llama-3-8B | 8 |" in md and "**Key figure:** " + last in md
    assert (tmp_path / "parallel_tp.png").stat().st_size > 0


@pytest.mark.slow
def test_diffusion_unet_cache_quick_runs_deepcache_on_the_digits_unet(tmp_path, capsys):
    main(["diffusion-unet-cache", "--quick", "--out", str(tmp_path), "--threads", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("diffusion-unet-cache: block speed-up at PSNR 35 dB") and "fbcache" not in last
    md = (tmp_path / "diffusion-unet-cache.md").read_text()
    assert "-block U-Net (down/mid/up blocks)" in md and "**Key figure:** " + last in md
    assert "## Each cache beside fewer steps at equal block compute" in md and "| dpmsolver++ | interval:2 |" in md
    assert "## Step-level batching under load" not in md and "TeaCache" not in md
    assert (tmp_path / "diffusion-unet-cache_fidelity.png").stat().st_size > 0
