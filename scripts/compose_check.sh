#!/usr/bin/env bash
# The compose deployment, for real: build the image, start the mesh with two decode workers, send
# it traffic through the published port, crash a decode container under a stream, take it all down.
#
#   scripts/compose_check.sh          (as root where the Docker engine has to be installed or started)
#
# Steps (each logged with its time):
#   1. Docker: the engine running (installs docker.io + docker-compose with apt, and starts dockerd,
#      where missing; a dockerd started here is stopped at the end), and a compose: `docker
#      compose` (v2) if there, else `docker-compose` (1.29)
#   2. the base image: docker/base.sh's `pagemesh-base` from Debian's packages (cached: built once);
#      PAGEMESH_BASE_IMAGE names another (python:3.11-slim where a registry is reachable)
#   3. torch: this machine's CPU wheel (/opt/wheels) staged in docker/wheels/ (git-ignored) when
#      there is one; else the image downloads the CPU build
#   4. `<compose> build`, then `up -d --build --scale decode=2`, the gateway published on
#      127.0.0.1:$PAGEMESH_PORT (a free port unless set); waits for /ready and the gateway's
#      healthcheck (the same rule: every kind served is ready)
#   5. scripts/compose_check.py with .venv's python (the openai client): a chat completion, a PNG,
#      both decode workers serving, a stream outliving its decode container twice: `docker kill`
#      (the other worker finishes it; compose starts the container again) and a crash (the
#      restart policy brings it back)
#   6. `down -v`, and no container, network or volume of the project left
# Environment: PAGEMESH_PORT, PAGEMESH_BASE_IMAGE, PAGEMESH_THREADS (default: cores / 4), PAGEMESH_COMPOSE_PROJECT (default pagemesh-check),
#   PAGEMESH_READY_TIMEOUT (s, default 900), PAGEMESH_KEEP_UP=1 (leave the mesh running),
#   PAGEMESH_KEEP_DOCKERD=1 (leave a dockerd started here running), PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

PROJECT=${PAGEMESH_COMPOSE_PROJECT:-pagemesh-check}
READY_TIMEOUT=${PAGEMESH_READY_TIMEOUT:-900}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
T_START=$(date +%s)
STEP_T=$T_START
STEP_NAME=""

log() { printf '[compose_check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
step() {
    local now
    now=$(date +%s)
    [ -n "$STEP_NAME" ] && log "-- done: $STEP_NAME ($((now - STEP_T)) s)"
    STEP_NAME="$1"
    STEP_T=$now
    [ -z "$1" ] || log "== $1"
}
end_step() { step ""; }

# ---- 1. Docker ---------------------------------------------------------------------------
step "docker engine"
as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi
}
if ! command -v dockerd >/dev/null || { ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; } \
    || ! command -v debootstrap >/dev/null; then
    log "installing docker.io docker-compose debootstrap (apt)"
    as_root apt-get update -q
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -q docker.io docker-compose debootstrap
fi
STARTED_DOCKERD=""
FORWARD_POLICY=""
if ! docker info >/dev/null 2>&1; then
    # dockerd sets iptables' FORWARD policy to DROP: put back what it was when we stop it
    FORWARD_POLICY=$(as_root iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" { print $3; exit }' || true)
    log "starting dockerd (log: /tmp/pagemesh-dockerd.log)"
    as_root sh -c 'nohup dockerd >/tmp/pagemesh-dockerd.log 2>&1 & echo $! >/tmp/pagemesh-dockerd.pid'
    STARTED_DOCKERD=$(cat /tmp/pagemesh-dockerd.pid)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -n 30 /tmp/pagemesh-dockerd.log; log "dockerd did not start"; exit 1; }
fi
if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
else
    COMPOSE=(docker-compose)
fi
# without the buildx plugin, a CLI asked for BuildKit fails: the classic builder does (the
# Dockerfiles need nothing of BuildKit's)
if ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=1
fi
log "engine $(docker version -f '{{.Server.Version}}'), client $(docker version -f '{{.Client.Version}}'), compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short 2>/dev/null || "${COMPOSE[@]}" version | head -n 1))"

PORT=${PAGEMESH_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export PAGEMESH_PORT=$PORT PAGEMESH_PUBLISH_IP=127.0.0.1 COMPOSE_PROJECT_NAME=$PROJECT
export PAGEMESH_BASE_IMAGE=${PAGEMESH_BASE_IMAGE:-pagemesh-base}
# the 4 compute workers (prefill, 2 decode, diffusion) share this machine's cores, as `pagemesh up`
# shares them: each with every core would oversubscribe them, and OpenMP's spinning threads crawl
THREADS_DEFAULT=$(($(nproc) / 4))
export PAGEMESH_THREADS=${PAGEMESH_THREADS:-$((THREADS_DEFAULT > 0 ? THREADS_DEFAULT : 1))}
log "PAGEMESH_THREADS=$PAGEMESH_THREADS per worker ($(nproc) cores)"
compose() { "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/compose.yaml" "$@"; }

leftovers() {
    local label="label=com.docker.compose.project=$PROJECT"
    {
        docker ps -a -q --filter "$label" | sed 's/^/container /'
        docker network ls -q --filter "$label" | sed 's/^/network /'
        docker network ls -q --filter "name=^${PROJECT}_" | sed 's/^/network /'
        docker volume ls -q --filter "$label" | sed 's/^/volume /'
    } | sort -u
}
UP=""
cleanup() {
    local rc=$?
    if [ -n "$UP" ] && [ "${PAGEMESH_KEEP_UP:-0}" != 1 ]; then
        if [ "$rc" != 0 ]; then
            log "failed (exit $rc): the last logs of every service"
            compose logs --no-color --tail 40 2>&1 | tail -n 300 || true
        fi
        log "taking the mesh down"
        compose down -v --remove-orphans --timeout 40 >/dev/null 2>&1 || true
    fi
    if [ -n "$STARTED_DOCKERD" ] && [ "${PAGEMESH_KEEP_DOCKERD:-0}" != 1 ]; then
        log "stopping the dockerd started here (pid $STARTED_DOCKERD)"
        as_root kill "$STARTED_DOCKERD" 2>/dev/null || true
        if [ -n "$FORWARD_POLICY" ]; then
            as_root iptables -P FORWARD "$FORWARD_POLICY" 2>/dev/null || true
            log "iptables FORWARD policy back to $FORWARD_POLICY"
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT

# a project of the same name left by an earlier run goes first
if [ -n "$(leftovers)" ]; then
    log "an earlier $PROJECT project is still there: down -v"
    compose down -v --remove-orphans --timeout 10 >/dev/null 2>&1 || true
fi

# ---- 2. the base image -----------------------------------------------------------------------
step "base image ($PAGEMESH_BASE_IMAGE)"
T=$(date +%s)
if [ "$PAGEMESH_BASE_IMAGE" = pagemesh-base ]; then
    docker/base.sh
fi
BASE_S=$(($(date +%s) - T))

# ---- 3. torch --------------------------------------------------------------------------------
step "torch wheel"
mkdir -p docker/wheels
WHEEL=$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$WHEEL" ]; then
    if ! cmp -s "$WHEEL" "docker/wheels/$(basename "$WHEEL")"; then
        cp "$WHEEL" docker/wheels/
    fi
    log "docker/wheels/$(basename "$WHEEL") staged"
else
    log "no local torch wheel: the image downloads the CPU build from download.pytorch.org"
fi

# ---- 4. build and start ----------------------------------------------------------------------
step "image build"
T=$(date +%s)
BUILD_LOG=$(mktemp /tmp/pagemesh-build.XXXXXX.log)
OLD_IMAGE=$(docker image inspect -f '{{.Id}}' pagemesh:latest 2>/dev/null || true)
if ! compose build >"$BUILD_LOG" 2>&1; then
    tail -n 60 "$BUILD_LOG"
    log "image build failed (log: $BUILD_LOG)"
    exit 1
fi
# the image this build replaced is untagged now: 3.6 GB a run on a machine that runs this often
if [ -n "$OLD_IMAGE" ] && [ "$OLD_IMAGE" != "$(docker image inspect -f '{{.Id}}' pagemesh:latest)" ]; then
    docker image rm "$OLD_IMAGE" >/dev/null 2>&1 && log "removed the pagemesh:latest this build replaced" || true
fi
# the steps of the first build (the other services' are the same, from its cache)
awk '/^Successfully tagged/ && ++n == 1 { print; exit } { print }' "$BUILD_LOG" \
    | grep -E '^(Building|Step [0-9]+/|Successfully|torch|default model|Using cache)' | grep -v '^ ---> Using cache' || true
log "build log: $BUILD_LOG ($(grep -c '^Successfully tagged' "$BUILD_LOG") services built)"
BUILD_S=$(($(date +%s) - T))
log "image pagemesh:latest: $(docker image inspect -f '{{.Size}}' pagemesh:latest | awk '{printf "%.0f MB", $1/1e6}')"

step "up (gateway on 127.0.0.1:$PORT)"
T=$(date +%s)
UP=1
compose up -d --build --scale decode=2 >>"$BUILD_LOG" 2>&1 || { tail -n 40 "$BUILD_LOG"; exit 1; }
compose ps
GATEWAY=$(docker ps -q --filter "label=com.docker.compose.project=$PROJECT" --filter label=com.docker.compose.service=gateway)
[ -n "$GATEWAY" ] || { log "no gateway container"; exit 1; }
last=""
deadline=$(($(date +%s) + READY_TIMEOUT))
while :; do
    ready=$(python3 - "$PORT" <<'EOF'
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/ready", timeout=5) as r:
        print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode()[:200])
except Exception as e:
    print("-", type(e).__name__)
EOF
)
    health=$(docker inspect -f '{{.State.Health.Status}}' "$GATEWAY")
    if [ "$ready $health" != "$last" ]; then
        log "/ready: $ready   healthcheck: $health"
        last="$ready $health"
    fi
    [ "${ready%% *}" = 200 ] && [ "$health" = healthy ] && break
    if [ "$(date +%s)" -gt "$deadline" ]; then log "not ready after $READY_TIMEOUT s"; exit 1; fi
    sleep 2
done
UP_S=$(($(date +%s) - T))

# ---- 5. traffic --------------------------------------------------------------------------------
step "traffic check"
T=$(date +%s)
"$PYTHON" scripts/compose_check.py --base-url "http://127.0.0.1:$PORT" --project "$PROJECT" \
    --compose "${COMPOSE[*]} -p $PROJECT -f $ROOT/compose.yaml"
CHECK_S=$(($(date +%s) - T))

# ---- 6. down ---------------------------------------------------------------------------------
step "down -v"
if [ "${PAGEMESH_KEEP_UP:-0}" = 1 ]; then
    log "PAGEMESH_KEEP_UP=1: the mesh stays up (${COMPOSE[*]} -p $PROJECT down -v takes it down)"
else
    compose down -v --remove-orphans --timeout 40
    UP=""
    left=$(leftovers)
    [ -z "$left" ] || { log "left behind: $left"; exit 1; }
    log "no container, network or volume of project $PROJECT is left"
fi
end_step

log "timings: base image ${BASE_S} s, image build ${BUILD_S} s, up to ready ${UP_S} s, traffic check ${CHECK_S} s, total $(($(date +%s) - T_START)) s"
log "compose check passed"
