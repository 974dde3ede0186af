#!/usr/bin/env bash
# Check the kernels against another Triton release than the one installed, without a GPU:
# the kernel tests under the interpreter, every launcher-picked variant compiled for sm_90, and
# the GPU path's CPU tests (CUDA-graph logic, the GPU bench's imports and toy run).
#
#   bash scripts/triton_compat.sh 3.6.0      # the release on the lent H200 machines (2026-11)
#
# The GPU machine runs its own image's torch and triton, not our pins, so a kernel that only
# compiles with our newer Triton would fail there. The release goes into a throwaway folder put
# first on PYTHONPATH. Triton releases before 3.7 have an interpreter that turns one-element
# arrays into ints, which numpy >= 2.4 refuses, so an older numpy goes beside them (the compiled
# path on a GPU does not use the interpreter and is unaffected).

set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: bash scripts/triton_compat.sh TRITON_VERSION}
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
extra=()
minor=$(echo "$version" | cut -d. -f2)
[[ "$version" == 3.* ]] && ((minor < 7)) && extra=("numpy<2.4")
"$PY" -m pip install -q --no-deps --target "$site" "triton==$version" ${extra[@]+"${extra[@]}"}
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import triton, numpy; print(f'triton {triton.__version__}, numpy {numpy.__version__}')"
"$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/kernels tests/unit/test_cuda_graphs.py tests/unit/test_gpu_imports.py
