#!/usr/bin/env bash
# Install (scripts/install.sh), lint (ruff) and run the whole test suite: unit, kernels (Triton interpreter),
# integration (real processes on loopback with the real model). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
[ -n "${VIRTUAL_ENV:-}" ] || source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
ruff check . && ruff format --check .
python -m pytest -q -m "not gpu" --timeout=900 "$@"
