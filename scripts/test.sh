#!/usr/bin/env bash
# Install (scripts/install.sh), lint (ruff) and run the whole test suite: unit, kernels (Triton interpreter),
# integration (real processes on loopback with the real model). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Debian's chromium for the status page's browser test (tests/integration/test_status_page.py,
# which skips without it); only where apt-get is there and we are root
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }) \
        || echo "chromium did not install: the status page's browser test will skip"
fi
# Debian's espeak-ng speaks the audio tests' real input (tests/integration/test_audio_engine.py,
# test_mesh_audio.py, which skip without it); the same way
if ! command -v espeak-ng >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q --no-install-recommends espeak-ng >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends espeak-ng >/dev/null; }) \
        || echo "espeak-ng did not install: the audio tests' speech input will skip"
fi
[ -n "${VIRTUAL_ENV:-}" ] || source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
ruff check . && ruff format --check .
python -P -m pytest -q -m "not gpu" --timeout=900 --durations=40 "$@"
