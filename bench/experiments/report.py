"""The report of one experiment: markdown with tables and PNG plots.

    DIR/NAME.md        header (machine, date, model, command, load), then the body in order
    DIR/NAME_<x>.png   one file per figure, linked from the markdown

Pure apart from matplotlib (Agg backend, no display needed).
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pagemesh.bench.plots import save_png


def machine_description() -> str:
    """Cores and CPU model, e.g. '2 cores, Intel(R) Xeon(R) ... (x86_64)'."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model} ({platform.machine()})"


def load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def format_cell(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "–"
        if value == 0 or abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3g}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub markdown table; floats get 3 significant-ish digits, NaN shows as '–'."""
    if any(len(row) != len(headers) for row in rows):
        raise ValueError("every row needs one cell per header")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(format_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Report:
    """Collects an experiment's text, tables and figures; `write` puts them on disk.

    `key` is the one-line result `pagemesh experiment` prints last."""

    name: str
    title: str
    command: str
    model: str = ""
    seed: int = 0
    threads: int | None = None
    started: float = field(default_factory=time.monotonic)
    load_at_start: str = field(default_factory=load_average)
    key: str = ""
    _body: list = field(default_factory=list)  # str (markdown) or (suffix, figure, caption)

    def text(self, markdown: str) -> None:
        self._body.append(markdown.strip())

    def table(self, headers: Sequence[str], rows: Sequence[Sequence], caption: str = "") -> None:
        self._body.append((f"{caption}\n\n" if caption else "") + markdown_table(headers, rows))

    def figure(self, suffix: str, figure, caption: str = "") -> None:
        """`figure` is a matplotlib Figure; saved as NAME_<suffix>.png by `write`."""
        self._body.append((suffix, figure, caption))

    def header(self) -> str:
        seconds = time.monotonic() - self.started
        rows = [
            ("machine", machine_description() + (f"; {self.threads} torch thread(s)" if self.threads else "")),
            ("date", datetime.datetime.now().isoformat(timespec="seconds")),
            ("model", self.model or "–"),
            ("command", f"`{self.command}`"),
            ("seed", str(self.seed)),
            ("wall time", f"{seconds:.0f} s"),
            ("load average (1/5/15 min) at start → end", f"{self.load_at_start} → {load_average()}"),
        ]
        note = (
            "The CPU is shared with other work (see the load average), so absolute times are noisy; "
            "compare rows within one report."
        )
        return f"# {self.title}\n\n" + markdown_table(("", ""), rows) + f"\n\n{note}"

    def write(self, out_dir: str | Path) -> list[Path]:
        """Write NAME.md and its PNGs into `out_dir`; returns the paths written."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        parts, written = [self.header()], []
        for item in self._body:
            if isinstance(item, str):
                parts.append(item)
                continue
            suffix, figure, caption = item
            path = out / f"{self.name}_{suffix}.png"
            save_png(figure, path, dpi=100, bbox_inches="tight")
            plt.close(figure)
            written.append(path)
            parts.append(f"![{caption or suffix}]({path.name})" + (f"\n\n*{caption}*" if caption else ""))
        if self.key:
            parts.append(f"**Key figure:** {self.key}")
        md = out / f"{self.name}.md"
        md.write_text("\n\n".join(parts) + "\n")
        return [md, *written]


def new_figure(ncols: int = 1, width: float = 5.5, height: float = 3.8):
    """(figure, axes) from the Agg backend; `axes` is a list even for one column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    for axis in axes[0]:
        axis.grid(True, alpha=0.3)
    return figure, list(axes[0])
