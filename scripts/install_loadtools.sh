#!/usr/bin/env bash
# Load tools people already use, each in its own virtual environment under .loadtools/ (never in
# the project's .venv: guidellm pulls its own torch build, and pagemesh stays on torch 2.13.0).
#   bash scripts/install_loadtools.sh            # aiperf and guidellm
#   bash scripts/install_loadtools.sh aiperf     # one of them
# Measured on the 2-core dev box under load: aiperf 0.13 ~8 min, 1.2 GB, no torch; guidellm 0.8
# ~11 min, 6 GB (it pulls torch 2.14). tests/integration/test_aiperf_against_mesh.py runs aiperf
# from .loadtools/aiperf when it is there (or $PAGEMESH_AIPERF), and skips otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(aiperf guidellm)
for tool in "${tools[@]}"; do
    case "$tool" in
        aiperf | guidellm) ;;
        *) echo "unknown tool: $tool (aiperf or guidellm)" >&2; exit 2 ;;
    esac
    [ -x ".loadtools/$tool/bin/python" ] || python3 -m venv ".loadtools/$tool"
    ".loadtools/$tool/bin/python" -m pip install --disable-pip-version-check -q "$tool"
    echo "$tool: .loadtools/$tool/bin/$tool"
done
