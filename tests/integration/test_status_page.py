"""The live status page in headless Chromium, against a real mesh (`pagemesh up` with a prefill, a
decode and a diffusion worker): the page names every worker, and while text and image load runs
its numbers move (tokens and images made, tokens/s, images/s, recent requests). It saves a
screenshot taken under load (to docs/img/status.png with PAGEMESH_UPDATE_SCREENSHOT=1).

Debian's chromium, driven by Playwright's Python package (never its own browser downloads); the
test skips where either is missing. scripts/test.sh installs chromium where apt-get can.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.request
from pathlib import Path

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, running_mesh, sample_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# what keeps Chromium from stalling on a machine with no network, and a fresh profile (the
# persistent context's folder) per run
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "status.png"


def _playwright():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install playwright; the dev extra has it)")
    return sync_playwright


@pytest.fixture(scope="module")
def mesh():
    _playwright()  # skip before starting a mesh for nothing
    with running_mesh("--prefill", "1", "--decode", "1", "--diffusion", "1") as url:
        yield url


@pytest.fixture(scope="module")
def page(mesh, tmp_path_factory):
    sync_playwright = _playwright()
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1200, "height": 720},
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def status(mesh: str) -> dict:
    return json.loads(urllib.request.urlopen(mesh + "/status", timeout=HANG_S).read())


def shown(page) -> dict:
    """What the page shows: each worker row's cells by column name, and the summary figures."""
    return page.evaluate(
        """() => {
        const names = [...document.querySelectorAll("#workers thead th")].map((th) => th.textContent);
        const workers = {};
        for (const tr of document.querySelectorAll("#workers tbody tr")) {
          workers[tr.dataset.worker] = Object.fromEntries(names.map((n, i) => [n, tr.cells[i].textContent]));
        }
        const text = (id) => document.getElementById(id).textContent;
        return {workers, tokens_per_s: parseFloat(text("tokens-per-s")), images_per_s: parseFloat(text("images-per-s")),
                ready: text("ready"), requests: document.querySelectorAll("#requests tbody tr").length};
      }"""
    )


def test_the_page_names_every_worker_and_its_numbers_move_under_load(mesh, page, tmp_path):
    workers = {w["id"]: w["pool"] for w in status(mesh)["workers"]}
    assert sorted(workers.values()) == ["decode", "diffusion", "prefill"]

    page.goto(mesh + "/")
    before = sample_until(lambda: shown(page), lambda s: set(s["workers"]) == set(workers), timeout=HANG_S)
    assert before is not None, "the page never listed the workers"
    assert before["ready"] == "ready"
    assert {w: row["pool"] for w, row in before["workers"].items()} == workers
    assert all(row["state"] in ("idle", "busy") for row in before["workers"].values())

    client = openai.OpenAI(base_url=mesh + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    stop, errors = threading.Event(), []

    def text_load() -> None:
        while not stop.is_set():
            try:
                client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Count: 1, 2, 3,", max_tokens=24)
            except Exception as e:  # reported by the test, not lost in a thread
                errors.append(e)
                return

    def image_load() -> None:
        while not stop.is_set():
            try:
                client.images.generate(prompt="a handwritten 5", size="8x8", extra_body={"num_inference_steps": 8})
            except Exception as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=f) for f in (text_load, text_load, image_load)]
    for t in threads:
        t.start()
    try:

        def moved(now: dict) -> bool:
            return (
                not errors
                and all(int(now["workers"][w]["produced"]) > int(before["workers"][w]["produced"]) for w in workers)
                and now["tokens_per_s"] > 0
                and now["images_per_s"] > 0
                and now["requests"] >= 3  # the gateway lists finished requests (and the screenshot shows some)
            )

        during = sample_until(lambda: shown(page), lambda s: errors or moved(s), timeout=HANG_S, interval=0.2)
        page.screenshot(path=str(tmp_path / "status.png"))
    finally:
        stop.set()
        for t in threads:
            t.join(HANG_S)
    assert not errors, errors
    assert during is not None and moved(during), during
    if os.environ.get("PAGEMESH_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "status.png", SCREENSHOT)
