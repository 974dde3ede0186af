"""aiperf (NVIDIA's load tool) against `pagemesh up --mixed 1`, with the tokenizer folder
`pagemesh tokenizer-export` writes: a handful of requests, all answered, and the server metrics
aiperf scrapes from /metrics include vLLM's series. Runs when aiperf is installed
(scripts/install_loadtools.sh puts it in .loadtools/aiperf; or $PAGEMESH_AIPERF names the
executable), else skips: it lives outside the project's environment."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pagemesh.bench.local_mesh import HANG_S, running_mesh
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.services.tokenizer_export import export

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
AIPERF = Path(os.environ.get("PAGEMESH_AIPERF") or ROOT / ".loadtools" / "aiperf" / "bin" / "aiperf")
REQUESTS = 4


@pytest.mark.skipif(
    not AIPERF.is_file(), reason=f"aiperf not installed at {AIPERF} (scripts/install_loadtools.sh aiperf)"
)
def test_aiperf_runs_against_the_mesh_with_the_exported_tokenizer(tmp_path):
    tokenizer = tmp_path / "tokenizer"
    export(None, tokenizer)
    out = tmp_path / "aiperf"
    with running_mesh("--mixed", "1", "--heartbeat-timeout", "60") as url:
        run = subprocess.run(
            [
                str(AIPERF),
                "profile",
                "--model",
                DEFAULT_MODEL_NAME,
                "--url",
                url,
                "--endpoint-type",
                "completions",
                "--streaming",
                "--tokenizer",
                str(tokenizer),
                "--synthetic-input-tokens-mean",
                "32",
                "--output-tokens-mean",
                "8",
                "--concurrency",
                "2",
                "--request-count",
                str(REQUESTS),
                "--artifact-dir",
                str(out),
                "--ui-type",
                "none",
            ],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            env={k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")},
        )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == REQUESTS and not result["error_summary"]
    assert result["time_to_first_token"]["avg"] > 0
    scraped = (out / "server_metrics_export.csv").read_text()
    assert "vllm:time_to_first_token_seconds" in scraped and "vllm:kv_cache_usage_perc" in scraped
