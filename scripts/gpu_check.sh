#!/usr/bin/env bash
# GPU check: kernel tests at full shapes, kernel benchmarks, (if present) the engine bench and,
# with two or more GPUs visible, a tensor-parallel run (skipped with its reason otherwise),
# written to docs/perf/gpu.md. One command, run from anywhere, finishes in under 8 minutes on
# one H200; needs torch, triton, pytest (no pip install, no network, no zmq/structlog/gguf).
#
#   PAGEMESH_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_check.sh [--quick]
#
# PAGEMESH_COMMIT names the commit where the copy on the GPU machine has no .git.
# Exit status: 0 when every step passed, 1 otherwise (the report is written either way).

set -uo pipefail
cd "$(dirname "$0")/.."

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
PY=${PYTHON:-python}
command -v "$PY" >/dev/null || PY=python3

BUDGET_S=${GPU_CHECK_BUDGET_S:-460}  # stay under 8 minutes with margin for start-up
QUICK=""
[[ "${1:-}" == "--quick" ]] && QUICK="--quick"
REPORT=${GPU_CHECK_REPORT:-docs/perf/gpu.md}
LOGS=$(mktemp -d)
status=0

remaining() { echo $((BUDGET_S - SECONDS)); }
cap() { local r; r=$(remaining); ((r < $1)) && echo "$r" || echo "$1"; }
# run_markdown_bench LOG LIMIT SCRIPT [ARGS]: a bench that prints markdown, within LIMIT seconds;
# its output goes into the report, and a failure (with its stderr's tail) fails the check.
run_markdown_bench() {
  local log=$1 limit=$2 script=$3 rc
  shift 2
  timeout -k 10 "$limit" "$PY" "$@" >"$LOGS/$log.md" 2>"$LOGS/$log.err"
  rc=$?
  cat "$LOGS/$log.md" >>"$REPORT"
  if ((rc)); then
    status=1
    { echo; echo "**$(basename "$script") failed (exit $rc):**"; echo; echo '```'
      tail -n 40 "$LOGS/$log.err"; echo '```'; } >>"$REPORT"
  fi
}

commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo "${PAGEMESH_COMMIT:-unknown}")
if git diff --quiet HEAD -- 2>/dev/null; then dirty=""; else dirty=" (plus uncommitted changes)"; fi
[[ "$commit" == "${PAGEMESH_COMMIT:-unknown}" ]] && dirty=""
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
      | head -n1)
[[ -z "$gpu" ]] && gpu=$("$PY" -c "import torch; print(torch.cuda.get_device_name())" \
                         2>/dev/null || echo "none visible")
versions=$("$PY" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}')" 2>&1)

mkdir -p "$(dirname "$REPORT")"
{
  echo "# GPU check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- GPU: $gpu"
  echo "- commit: \`$commit\`$dirty"
  echo "- software: $versions"
  echo "- command: \`bash scripts/gpu_check.sh $QUICK\`"
  echo
  echo "## Tests"
  echo
} >"$REPORT"

summarize() {  # name, log, exit code
  local line
  line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped)|no tests ran" "$2" | tail -n1)
  [[ -z "$line" ]] && line="(no pytest summary; exit $3)"
  if (($3 == 0)); then echo "- $1: PASS — ${line//=/}"; else
    echo "- $1: **FAIL (exit $3)** — ${line//=/}"
    echo
    echo '  <details><summary>last lines</summary>'
    echo
    echo '  ```'
    tail -n 60 "$2" | sed 's/^/  /'
    echo '  ```'
    echo '  </details>'
  fi
}

if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "**No CUDA device: nothing run.** (CPU kernel tests: \`pytest tests/kernels\`.)" >>"$REPORT"
  echo "[gpu_check] no CUDA device; wrote $REPORT" >&2
  exit 1
fi

# Tensor parallel across GPUs (step 4) only where a worker's two ranks can each have a GPU: its
# time is kept back from the steps before it.
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
TP_SIZE=2  # bench/gpu_engine.py's Llama-3-8B shape: 32 query and 8 KV heads split 2 ways
TP_RESERVE_S=0
((gpus >= TP_SIZE)) && TP_RESERVE_S=${GPU_CHECK_TP_RESERVE_S:-150}

# 1. Tests, the two suites side by side (their Triton compiles use separate CPU cores).
t=$(cap 240)
echo "[gpu_check] tests (limit ${t}s)"
timeout -k 10 "$t" "$PY" -m pytest -q -p no:cacheprovider --noconftest tests/kernels \
  >"$LOGS/kernels.log" 2>&1 &
kernels_pid=$!
timeout -k 10 "$t" "$PY" -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/gpu \
  >"$LOGS/gpu.log" 2>&1 &
gpu_pid=$!
wait "$kernels_pid"; kernels_rc=$?
wait "$gpu_pid"; gpu_rc=$?
((kernels_rc || gpu_rc)) && status=1
{
  summarize "tests/kernels (compiled, no interpreter)" "$LOGS/kernels.log" "$kernels_rc"
  summarize "tests/gpu (-m gpu)" "$LOGS/gpu.log" "$gpu_rc"
  echo
} >>"$REPORT"

# 2. Kernel benchmarks (alone on the GPU), leaving ENGINE_RESERVE_S for step 3. The bench prints
#    each section when measured and starts no sweep case past its deadline.
ENGINE_RESERVE_S=${GPU_CHECK_ENGINE_RESERVE_S:-120}
t=$(cap 200)
((t > $(remaining) - ENGINE_RESERVE_S - TP_RESERVE_S)) && t=$(($(remaining) - ENGINE_RESERVE_S - TP_RESERVE_S))
((t < 120)) && QUICK="--quick"
((t < 30)) && t=30
echo "[gpu_check] kernel bench (limit ${t}s) $QUICK"
echo "## Kernel benchmarks" >>"$REPORT"
echo >>"$REPORT"
[[ -n "$QUICK" ]] && echo "_--quick: only ${t}s left for this step (no tile sweeps)._" >>"$REPORT"
timeout -k 10 "$t" "$PY" bench/kernel_bench.py $QUICK --deadline-at $(($(date +%s) + t - 20)) \
  >"$LOGS/bench.md" 2>"$LOGS/bench.err"
bench_rc=$?
cat "$LOGS/bench.md" >>"$REPORT"
if ((bench_rc)); then
  # Cut at its limit is not a failure: what it printed was measured, the rest is missing.
  why="failed (exit $bench_rc)"
  ((bench_rc == 124)) && why="stopped at its ${t}s limit; the sections above were measured" || status=1
  { echo; echo "**kernel_bench $why:**"; echo; echo '```'
    tail -n 40 "$LOGS/bench.err"; echo '```'; } >>"$REPORT"
fi
echo >>"$REPORT"

# 3. Engine benchmark, written by the engine's owner; it prints markdown.
if [[ -f bench/gpu_engine.py ]]; then
  t=$(($(remaining) - 5 - TP_RESERVE_S))
  echo "[gpu_check] engine bench (limit ${t}s)"
  echo "## Engine (bench/gpu_engine.py)" >>"$REPORT"
  echo >>"$REPORT"
  if ((t < 30)); then
    echo "_skipped: only ${t}s of the time budget left_" >>"$REPORT"
  else
    run_markdown_bench engine "$t" bench/gpu_engine.py
  fi
fi

# 4. Tensor parallel: the engine at -tp 2 (rank i on GPU i, NCCL) against -tp 1, when 2 GPUs are visible.
echo "## Tensor parallel (bench/gpu_tensor_parallel.py)" >>"$REPORT"
echo >>"$REPORT"
if ((gpus < TP_SIZE)); then
  why="skipped: $gpus GPU(s) visible, -tp $TP_SIZE needs $TP_SIZE (one per rank)"
  echo "[gpu_check] tensor parallel $why"
  echo "_${why}._" >>"$REPORT"
else
  t=$(($(remaining) - 5))
  echo "[gpu_check] tensor parallel -tp $TP_SIZE on $gpus GPUs (limit ${t}s)"
  if ((t < 30)); then
    echo "_skipped: only ${t}s of the time budget left_" >>"$REPORT"
  else
    run_markdown_bench tp "$t" bench/gpu_tensor_parallel.py --tp "$TP_SIZE"
  fi
fi

echo >>"$REPORT"
echo "_gpu_check finished in ${SECONDS}s, exit status $status._" >>"$REPORT"
echo "[gpu_check] wrote $REPORT in ${SECONDS}s (exit $status)"
rm -rf "$LOGS"
exit "$status"
