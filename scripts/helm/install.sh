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
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" helm-install

HELM_VERSION="${OPENFORGE_HELM_VERSION:-v4.3.1}"
MODULE="helm.sh/helm/v4/cmd/helm"
FORCE="${OPENFORGE_HELM_FORCE:-0}"
PREFIX="$CACHE/helm/$HELM_VERSION"
BIN="$PREFIX/bin/helm"

binary_ok() { [ -x "$BIN" ] && "$BIN" version --short >/dev/null 2>&1; }

exit_if_installed "$FORCE" binary_ok "$BIN" "already built"
command -v go >/dev/null 2>&1 || die "go is not on PATH; install Go 1.24+ (Debian: golang-go, or go.dev's tarball)"
mkdir -p "$PREFIX/bin"
lock_then_exit_if_installed "$CACHE/helm-install.lock" "$FORCE" binary_ok "$BIN"

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
