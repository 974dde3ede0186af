"""docs/performance.md's tables are generated from docs/perf/figures.json by scripts/figures.py:
the page is up to date, the check catches a stale page, the prose pages link to the figures
instead of quoting them, and every relative link in README.md and docs/ resolves."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "figures.py"
DATA = ROOT / "docs" / "perf" / "figures.json"
DOC = ROOT / "docs" / "performance.md"
# the pages that explain and link, as against the reports that hold the runs (docs/perf, docs/experiments)
PROSE = [
    ROOT / "README.md",
    *(ROOT / "docs" / name for name in ("api.md", "architecture.md", "deployment.md", "design.md", "install.md")),
    ROOT / "docs" / "experiments.md",
]


def figures_module():
    spec = importlib.util.spec_from_file_location("pagemesh_figures_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)


def test_performance_page_is_up_to_date():
    proc = run_script("--check")
    assert proc.returncode == 0, proc.stderr


def test_check_fails_when_a_figure_changes_and_writes_nothing(tmp_path):
    data = json.loads(DATA.read_text(encoding="utf-8"))
    data["figures"][0]["value"] = "0.01×"
    changed = tmp_path / "figures.json"
    changed.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    before = DOC.read_text(encoding="utf-8")
    proc = run_script("--check", "--data", str(changed))
    assert proc.returncode == 1
    assert "out of date" in proc.stderr
    assert DOC.read_text(encoding="utf-8") == before


def test_rendering_replaces_only_the_generated_part():
    figures = figures_module()
    data = figures.load(DATA, DOC.parent)
    page = "# Title\n\nprose before\n\n" + figures.BEGIN + "\nstale table\n" + figures.END + "\n\nprose after\n"
    rendered = figures.update(page, figures.render(data))
    assert rendered.startswith("# Title\n\nprose before\n\n") and rendered.endswith("\n\nprose after\n")
    assert "stale table" not in rendered
    assert figures.update(rendered, figures.render(data)) == rendered
    for fig in data["figures"]:
        assert f'<a id="{fig["id"]}"></a>' in rendered
        assert fig["value"].replace("|", "\\|") in rendered
    with pytest.raises(ValueError, match="marker"):
        figures.update("# no markers\n", figures.render(data))


def test_a_broken_figures_file_is_refused(tmp_path):
    data = json.loads(DATA.read_text(encoding="utf-8"))
    data["figures"][1]["id"] = data["figures"][0]["id"]
    data["figures"][2]["source"] = "perf/no-such-page.md"
    del data["figures"][3]["command"]
    broken = tmp_path / "figures.json"
    broken.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError) as e:
        figures_module().load(broken, DOC.parent)
    assert "id used twice" in str(e.value)
    assert "no-such-page.md" in str(e.value)
    assert "command missing" in str(e.value)
    assert run_script("--check", "--data", str(broken)).returncode == 2


def test_prose_pages_link_to_the_figures_instead_of_quoting_them():
    data = json.loads(DATA.read_text(encoding="utf-8"))
    for page in PROSE:
        text = page.read_text(encoding="utf-8")
        quoted = [f["id"] for f in data["figures"] if f["value"] in text]
        assert not quoted, f"{page.relative_to(ROOT)} quotes {quoted}: link to docs/performance.md instead"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def test_every_relative_link_in_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor on the same page
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken
