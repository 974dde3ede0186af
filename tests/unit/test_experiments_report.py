"""pagemesh.bench.experiments.report: markdown tables and the files a report writes."""

from __future__ import annotations

import pytest

from pagemesh.bench.experiments.report import Report, format_cell, markdown_table, new_figure


def test_markdown_table_formats_cells():
    text = markdown_table(("a", "b"), [(1, 0.12345), ("x", 1234.5), ("y", float("nan"))])
    assert text.splitlines() == [
        "| a | b |",
        "| --- | --- |",
        "| 1 | 0.12 |",
        "| x | 1234 |",
        "| y | – |",
    ]


def test_format_cell_significant_digits():
    assert [format_cell(v) for v in (0.0, 0.01234, 3.14159, 42.42, 512.6, "s")] == [
        "0",
        "0.0123",
        "3.14",
        "42.4",
        "513",
        "s",
    ]


def test_markdown_table_rejects_ragged_rows():
    with pytest.raises(ValueError, match="one cell per header"):
        markdown_table(("a", "b"), [(1,)])


def test_report_writes_markdown_and_pngs(tmp_path):
    report = Report("demo", "A demo", "pagemesh experiment demo --out x", model="M (bf16)", seed=7, threads=1)
    report.text("Some words.")
    report.table(("k", "v"), [("one", 1)], caption="Table caption")
    figure, (axis,) = new_figure()
    axis.plot([0, 1], [1, 0])
    report.figure("line", figure, "A line.")
    report.key = "demo: 42"
    paths = report.write(tmp_path / "out")
    assert [p.name for p in paths] == ["demo.md", "demo_line.png"]
    assert (tmp_path / "out" / "demo_line.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "out" / "demo.md").read_text()
    assert md.startswith("# A demo\n")
    for needed in (
        "cores",
        "1 torch thread",
        "M (bf16)",
        "`pagemesh experiment demo --out x`",
        "| seed | 7 |",
        "load average",
        "Some words.",
        "Table caption",
        "| one | 1 |",
        "![A line.](demo_line.png)",
        "**Key figure:** demo: 42",
    ):
        assert needed in md
    assert md.index("Some words.") < md.index("Table caption") < md.index("demo_line.png")
