#!/usr/bin/env bash
# Build the helm CLI from the Go module proxy and cache the binary.
#
# There is no binary download on these machines (no internet beyond package registries), but the
# Go module proxy serves helm's source and `go install` builds it (helm's go.mod has no replace
# lines, so `go install module@version` works). The binary lands in
#     ${OPENFORGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/openforge}/helm/<version>/bin/helm
# and a rerun with the binary present exits at once.
#
# The build runs under `nice`, compiling as many packages at once as there are cores
# (OPENFORGE_HELM_BUILD_P overrides): on two cores `-p 2` built etcd's server 1.4-1.6x faster than
# `-p 1` from a cold build cache.
#
# Environment:
#   OPENFORGE_CACHE          cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_HELM_VERSION   helm release to build (default below)
#   OPENFORGE_HELM_FORCE=1   rebuild even when the binary exists
#   OPENFORGE_HELM_BUILD_P   packages built in parallel (go install -p; default: the core count)
#
# Prints the helm binary's path as the last line of stdout, so callers can do
#     HELM="$(scripts/helm/install.sh | tail -n 1)"
set -Eeuo pipefail

HELM_VERSION="${OPENFORGE_HELM_VERSION:-v4.3.1}"
MODULE="helm.sh/helm/v4/cmd/helm"

CACHE="${OPENFORGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/openforge}"
PREFIX="$CACHE/helm/$HELM_VERSION"
BIN="$PREFIX/bin/helm"
START_S=$SECONDS

log() { printf '[helm-install +%ss] %s\n' "$((SECONDS - START_S))" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
trap 'log "FAILED (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

binary_ok() { [ -x "$BIN" ] && "$BIN" version --short >/dev/null 2>&1; }

if [ "${OPENFORGE_HELM_FORCE:-0}" != "1" ] && binary_ok; then
    log "already built: $BIN ($("$BIN" version --short))"
    echo "$BIN"
    exit 0
fi

command -v go >/dev/null 2>&1 || die "go is not on PATH; install Go 1.24+ (Debian: golang-go, or go.dev's tarball)"

mkdir -p "$PREFIX/bin"
# One build at a time per cache: a second caller waits, then finds the binary.
exec 9>"$CACHE/helm-install.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi
if [ "${OPENFORGE_HELM_FORCE:-0}" != "1" ] && binary_ok; then
    log "built by a concurrent run: $BIN"
    echo "$BIN"
    exit 0
fi

log "building $MODULE@$HELM_VERSION with $(go version | cut -d' ' -f3) into $PREFIX/bin"
# `go install module@version` builds in module mode whatever go.mod surrounds it; -trimpath keeps the
# build machine's paths out of the binary; the version is stamped the way helm's Makefile does, so
# `helm version` reports it.
GOBIN="$PREFIX/bin" CGO_ENABLED=0 nice -n 10 go install -p "${OPENFORGE_HELM_BUILD_P:-$(nproc)}" -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    "$MODULE@$HELM_VERSION" >&2
binary_ok || die "built $BIN but it does not run"
log "done: $BIN ($("$BIN" version --short)) in $((SECONDS - START_S)) s"
echo "$BIN"
