#!/usr/bin/env bash
# llama.cpp's llama-server as a peer, built from the source that the llama-cpp-python sdist
# carries (vendor/llama.cpp), in its own folder outside the project.
#
#   bench/peers/llama_cpp.sh build            download the sdist, build llama-server + llama-quantize,
#                                             and make an F16 GGUF of the default model
#   bench/peers/llama_cpp.sh serve PORT [q4_1|f16] [SLOTS]
#                                             run llama-server on 127.0.0.1:PORT (foreground)
#   bench/peers/llama_cpp.sh describe [q4_1|f16] [SLOTS]
#                                             one line: how `serve` runs it
#   bench/peers/llama_cpp.sh perplexity [CTX] [QUANT...]
#                                             build llama-perplexity (and a Q4_K_M GGUF when QUANT
#                                             names q4_k_m), run it on the quality texts: the F16
#                                             GGUF saves its log-probs (--kl-divergence-base), then
#                                             each QUANT (default q4_1) gives its KL divergence,
#                                             top-token agreement and perplexity against them; logs
#                                             and the base file in $PEERS_DIR/llama_cpp/quality
#
# PEERS_DIR (default /work/peers) holds everything; PYTHON is the interpreter that can import
# the project (to find the default GGUF). Its AMX kernels crash on this VM: always --no-repack.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-/work/peers}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
ROOT=$PEERS_DIR/llama_cpp
BUILD=$ROOT/build
JOBS=${JOBS:-2}

default_gguf() {
    (cd "$REPO" && "$PYTHON" -c 'from common.model_files import default_model_path; print(default_model_path())')
}

build() {
    mkdir -p "$ROOT"
    cd "$ROOT"
    if [ ! -d src ]; then
        rm -rf dl && mkdir dl
        "$PYTHON" -m pip download --no-deps --no-binary :all: --dest dl llama-cpp-python
        mkdir src && tar -xzf dl/llama_cpp_python-*.tar.gz -C src --strip-components=1
    fi
    cmake -S src/vendor/llama.cpp -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build "$BUILD" -j "$JOBS" --target llama-server llama-quantize
    local q41 f16
    q41=$(default_gguf)
    f16=$ROOT/$(basename "${q41%.Q4_1.gguf}").F16.gguf
    if [ ! -f "$f16" ]; then
        "$BUILD/bin/llama-quantize" --allow-requantize --pure "$q41" "$f16" F16
    fi
    echo "llama.cpp ready: $BUILD/bin/llama-server, models $q41 $f16"
}

serve() {
    local port=${1:?port} variant=${2:-q4_1} slots=${3:-32} model q41
    q41=$(default_gguf)
    case $variant in
        q4_1) model=$q41 ;;
        f16) model=$ROOT/$(basename "${q41%.Q4_1.gguf}").F16.gguf ;;
        *) echo "variant must be q4_1 or f16" >&2; exit 2 ;;
    esac
    # -c is the total context over all slots: 32 slots x (128 prompt + 128 out) needs 8192;
    # 16384 leaves room for longer runs.
    exec "$BUILD/bin/llama-server" -m "$model" --host 127.0.0.1 --port "$port" \
        -np "$slots" -c "${CTX:-16384}" -t "${THREADS:-2}" --no-repack --no-webui 2>&1
}

describe() {
    local variant=${1:-q4_1} slots=${2:-32} version=unknown
    [ -f "$ROOT/src/vendor/llama.cpp/CMakeLists.txt" ] && version=$(ls "$ROOT"/dl/llama_cpp_python-*.tar.gz 2>/dev/null | sed 's/.*python-\(.*\)\.tar\.gz/llama-cpp-python \1 sdist/' | head -n 1)
    echo "llama-server ($version), $variant, -np $slots -c ${CTX:-16384} -t ${THREADS:-2} --no-repack (its AMX repack crashes on this VM), GGML_NATIVE build"
}

quant_gguf() {  # the GGUF of one quantization: q4_1 is the shipped file, others made from F16
    local q41 stem
    q41=$(default_gguf)
    stem=$ROOT/$(basename "${q41%.Q4_1.gguf}")
    case $1 in
        q4_1) echo "$q41" ;;
        f16) echo "$stem.F16.gguf" ;;
        *)
            local upper
            upper=$(echo "$1" | tr '[:lower:]' '[:upper:]')
            if [ ! -f "$stem.$upper.gguf" ]; then
                cmake --build "$BUILD" -j "$JOBS" --target llama-quantize >&2
                # its log says which tensors fell back to other types (SmolLM2's 576 columns are
                # not a multiple of 256, so a Q4_K_M file is mostly Q5_0 and Q8_0)
                "$BUILD/bin/llama-quantize" "$stem.F16.gguf" "$stem.$upper.gguf" "$upper" \
                    > "$stem.$upper.quantize.log" 2>&1
                echo "made $stem.$upper.gguf (log: $stem.$upper.quantize.log)" >&2
            fi
            echo "$stem.$upper.gguf"
            ;;
    esac
}

perplexity() {
    local ctx=${1:-512} out=$ROOT/quality quant model
    shift || true
    [ $# -gt 0 ] || set -- q4_1
    [ -x "$BUILD/bin/llama-server" ] && [ -f "$(quant_gguf f16)" ] || build
    [ -x "$BUILD/bin/llama-perplexity" ] || cmake --build "$BUILD" -j "$JOBS" --target llama-perplexity
    mkdir -p "$out"
    (cd "$REPO" && "$PYTHON" bench/quantized.py texts --out "$out/texts.txt")
    # -b CTX: one chunk per batch (the scores do not depend on it); --no-repack: the AMX repack crashes here
    local common=(-f "$out/texts.txt" -c "$ctx" -b "$ctx" -t "${THREADS:-2}" --no-repack)
    "$BUILD/bin/llama-perplexity" -m "$(quant_gguf f16)" "${common[@]}" \
        --kl-divergence-base "$out/f16-c$ctx.logits" > "$out/f16-c$ctx.log" 2>&1
    grep "Final estimate" "$out/f16-c$ctx.log" | sed 's/^.* I /f16: /'
    for quant in "$@"; do
        model=$(quant_gguf "$quant")
        "$BUILD/bin/llama-perplexity" -m "$model" "${common[@]}" --kl-divergence-base "$out/f16-c$ctx.logits" \
            --kl-divergence > "$out/$quant-c$ctx.log" 2>&1
        echo "$quant ($model):"
        grep -E "^(Mean PPL\((Q|base)\) +:|Mean +KLD|Same top p:)" "$out/$quant-c$ctx.log"
    done
    echo "base log-probs: $out/f16-c$ctx.logits (bench/quantized.py llama-positions --base-logits)"
}

case ${1:-} in
    build) build ;;
    perplexity) shift; perplexity "$@" ;;
    serve) shift; serve "$@" ;;
    describe) shift; describe "$@" ;;
    *) sed -n '2,21p' "$0"; exit 2 ;;
esac
