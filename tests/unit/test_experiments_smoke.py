"""`pagemesh experiment paged-memory --quick`: the cheapest experiment end to end on the real model."""

from __future__ import annotations

import pytest

from bench.experiments.main import main


@pytest.mark.slow
def test_paged_memory_quick_writes_its_report(tmp_path, capsys):
    main(["paged-memory", "--quick", "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("paged-memory: KV utilization paged ")
    md = (tmp_path / "paged-memory.md").read_text()
    assert "**Key figure:** " + last in md
    assert (tmp_path / "paged-memory_utilization.png").stat().st_size > 0
