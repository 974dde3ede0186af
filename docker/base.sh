#!/usr/bin/env bash
# Build the local image `pagemesh-base` from Debian's packages, for machines that reach Debian's
# mirrors and PyPI but no image registry (Docker Hub pulls fail there):
#
#   debootstrap --variant=minbase bookworm   python3 (3.11), python3-venv, gcc, libc6-dev, ca-certificates
#   | docker import                          -> pagemesh-base-rootfs:bookworm
#   docker build FROM that (offline)          -> pagemesh-base: a venv at /opt/venv first on PATH, so
#                                                `pip install` works (no PEP 668 refusal)
#
# Then: PAGEMESH_BASE_IMAGE=pagemesh-base docker compose up --build
#
# Cached: an existing `pagemesh-base` image is kept as it is; `--rebuild` builds it again.
#   docker/base.sh [--rebuild] [--tag NAME]
# Environment:
#   PAGEMESH_DEBIAN_MIRROR   Debian mirror (default: the first bookworm one in this host's apt sources,
#                            else http://deb.debian.org/debian)
#   PAGEMESH_DEBIAN_SUITE    default bookworm (Python 3.11)
#   PAGEMESH_BASE_HOST_CAS   1 (default): the CA certificates this host added to its trust store
#                            (/usr/local/share/ca-certificates/*.crt) are trusted in the image too,
#                            so pip reaches PyPI through a TLS-inspecting egress proxy as the host
#                            does; 0: Debian's CA bundle only
# Needs root (debootstrap), debootstrap and a running Docker engine.
set -euo pipefail

TAG=pagemesh-base
REBUILD=0
while [ $# -gt 0 ]; do
    case "$1" in
        --rebuild) REBUILD=1 ;;
        --tag) TAG="$2"; shift ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "base.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

SUITE="${PAGEMESH_DEBIAN_SUITE:-bookworm}"
ROOTFS_TAG="${TAG}-rootfs:${SUITE}"
PACKAGES="python3,python3-venv,gcc,libc6-dev,ca-certificates"

log() { printf '[base.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [ "$REBUILD" = 0 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    log "image $TAG exists: kept (--rebuild builds it again)"
    exit 0
fi

[ "$(id -u)" = 0 ] || { log "debootstrap needs root"; exit 1; }
command -v debootstrap >/dev/null || { log "debootstrap is not installed (apt-get install debootstrap)"; exit 1; }

# one build at a time (two compose checks starting together share it)
exec 9>"/tmp/pagemesh-base.lock"
flock 9
if [ "$REBUILD" = 0 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    log "image $TAG was built meanwhile: kept"
    exit 0
fi

mirror_from_apt_sources() {
    # deb822 (*.sources: URIs/Suites) and one-line (*.list: deb URI SUITE ...) sources alike
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        awk -v suite="$SUITE" '
            /^[[:space:]]*#/ { next }
            /^deb[[:space:]]/ { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i ~ /:\/\//) {
                                    if ($(i + 1) == suite) { print $i; exit } break } }
            /^URIs:/ { uri = $2 }
            /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite && uri != "") { print uri; exit } }
            /^[[:space:]]*$/ { uri = "" }
        ' "$f"
    done | head -n 1
}
MIRROR="${PAGEMESH_DEBIAN_MIRROR:-$(mirror_from_apt_sources)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
MIRROR="${MIRROR%/}"
case "$MIRROR" in
    */debian) SECURITY="${MIRROR%/debian}/debian-security" ;;
    *) SECURITY="http://deb.debian.org/debian-security" ;;
esac

# what --rebuild replaces: removed once the new images are tagged (if nothing else uses them)
OLD_IMAGES="$(docker image inspect -f '{{.Id}}' "$TAG" "$ROOTFS_TAG" 2>/dev/null || true)"
START=$(date +%s)
WORK="$(mktemp -d /tmp/pagemesh-base.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
ROOT="$WORK/rootfs"

log "debootstrap --variant=minbase $SUITE from $MIRROR (+ $PACKAGES)"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
    tail -n 40 "$WORK/debootstrap.log" >&2
    [ -f "$ROOT/debootstrap/debootstrap.log" ] && tail -n 40 "$ROOT/debootstrap/debootstrap.log" >&2
    log "debootstrap failed"
    exit 1
}
log "debootstrap done in $(($(date +%s) - START)) s"

# the image's own apt sources (with security updates), so `apt-get install` works in it
cat >"$ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
EOF
# what docker images of Debian leave out: caches, package lists, logs
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/lib/apt/lists/* \
    "$ROOT"/var/log/* "$ROOT"/tmp/* "$ROOT"/root/.cache
: >"$ROOT/etc/hostname"
: >"$ROOT/etc/resolv.conf"  # the engine mounts its own

log "docker import -> $ROOTFS_TAG"
tar --numeric-owner -C "$ROOT" -c . \
    | docker import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' \
        --message "debootstrap --variant=minbase $SUITE ($PACKAGES) by docker/base.sh" - "$ROOTFS_TAG" >/dev/null
rm -rf "$WORK"

log "docker build -> $TAG (venv at /opt/venv)"
# the build context is empty: the Dockerfile comes on stdin; FROM a local image needs no registry
CONTEXT="$(mktemp -d /tmp/pagemesh-base-ctx.XXXXXX)"
trap 'rm -rf "$WORK" "$CONTEXT"' EXIT
mkdir "$CONTEXT/cas"
if [ "${PAGEMESH_BASE_HOST_CAS:-1}" = 1 ]; then
    for ca in /usr/local/share/ca-certificates/*.crt; do
        [ -f "$ca" ] || continue
        cp "$ca" "$CONTEXT/cas/"
        log "trusting this host's CA $(basename "$ca") in the image"
    done
fi
cat >"$CONTEXT/Dockerfile" <<EOF
FROM $ROOTFS_TAG
# the host's own trust anchors, if any (an egress proxy's CA); pip and Python's ssl use the system bundle
COPY cas/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
# security and point-release updates first (the containers reach the same Debian mirror)
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get -y upgrade \\
    && apt-get clean && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv && /opt/venv/bin/python -m pip --version
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    LANG=C.UTF-8 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \\
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
LABEL org.opencontainers.image.description="Debian $SUITE minbase with Python 3.11 in /opt/venv, gcc (docker/base.sh)"
CMD ["python3"]
EOF
docker build -q -t "$TAG" "$CONTEXT" >/dev/null 2>"$CONTEXT/build.err" || { cat "$CONTEXT/build.err" >&2; exit 1; }
docker run --rm "$TAG" sh -c 'python --version && pip --version && gcc --version | head -n 1' >&2
if [ "${PAGEMESH_BASE_CHECK_PYPI:-1}" = 1 ]; then  # pip in a container reaches PyPI (pip download six)
    docker run --rm "$TAG" sh -c 'pip download -q --no-deps six -d /tmp/six && ls /tmp/six' >&2 \
        || { log "pip in $TAG cannot reach PyPI (network, DNS or TLS: see above)"; exit 1; }
fi
for old in $OLD_IMAGES; do
    case "$(docker image inspect -f '{{.Id}}' "$TAG" "$ROOTFS_TAG" 2>/dev/null)" in
        *"$old"*) ;;
        *) docker image rm "$old" >/dev/null 2>&1 || true ;;
    esac
done
log "image $TAG built in $(($(date +%s) - START)) s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
