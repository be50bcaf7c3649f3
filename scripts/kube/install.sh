#!/usr/bin/env bash
# Build a real kube-apiserver and etcd from the Go module proxy, for the integration tests.
#
# There is no Docker and no internet beyond package registries on the machines that run the suite, so
# the API server the tests talk to is compiled from source served by the Go module proxy:
#
#   kube-apiserver  k8s.io/kubernetes/cmd/kube-apiserver. `go install pkg@version` refuses it because
#                   k8s.io/kubernetes' go.mod replaces its staging modules (k8s.io/api, k8s.io/apiserver, ...)
#                   with local directories. A throwaway local module requires k8s.io/kubernetes and replaces
#                   each staging module it requires at v0.0.0 with the published k8s.io/<name> v0.<minor>.<patch>.
#   etcd            go.etcd.io/etcd/server/v3/etcdmain, wrapped by a three-line main in a second local module
#                   (etcd's own main module has local replaces too). Debian's etcd is too old for Kubernetes.
#
# The binaries land in <cache>/kube/<k8s-version>/bin and a rerun exits at once when both exist.
# The build is niced and compiles as many packages at once as there are cores; it prints its wall time
# and the peak RSS of the compiler processes (from /usr/bin/time when available).
#
# Environment:
#   OPENFORGE_CACHE          cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_KUBE_VERSION   Kubernetes version (default v1.37.2)
#   OPENFORGE_ETCD_VERSION   etcd version (default v3.7.3)
#   OPENFORGE_KUBE_BUILD_P   packages built in parallel (go build -p; default: the core count)
#   OPENFORGE_KUBE_FORCE=1   rebuild even if the binaries exist
#
# Prints the bin directory as the last line of stdout, so callers can do
#     KUBE_BIN="$(scripts/kube/install.sh | tail -n 1)"
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" kube-install

KUBE_VERSION="${OPENFORGE_KUBE_VERSION:-v1.37.2}"
ETCD_VERSION="${OPENFORGE_ETCD_VERSION:-v3.7.3}"
PARALLEL="${OPENFORGE_KUBE_BUILD_P:-$(nproc)}"
FORCE="${OPENFORGE_KUBE_FORCE:-0}"
ROOT="$CACHE/kube/$KUBE_VERSION"
BIN="$ROOT/bin"

command -v go >/dev/null || die "go is not on PATH (Go 1.26+ is needed to build kube-apiserver $KUBE_VERSION)"

built() { [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/etcd" ]; }

exit_if_installed "$FORCE" built "$BIN" "already built"
mkdir -p "$BIN" "$ROOT/src"
lock_then_exit_if_installed "$ROOT/install.lock" "$FORCE" built "$BIN"

export GOFLAGS="-mod=mod -buildvcs=false"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export CGO_ENABLED=0
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"
TIME=()
if [ -x /usr/bin/time ]; then TIME=(/usr/bin/time -f '%e s wall, %M KiB peak RSS (largest single process)'); fi
STAGING_MINOR="v0.${KUBE_VERSION#v1.}"

build_module() {  # build_module DIR OUT PKG [EXTRA_LDFLAGS]
    local dir="$1" out="$2" pkg="$3" extra="${4:-}" t0=$SECONDS
    log "building $pkg -> $out (go build -p $PARALLEL, GOMAXPROCS=$GOMAXPROCS)"
    (cd "$dir" && nice -n 10 "${TIME[@]}" go build -p "$PARALLEL" -trimpath -ldflags "-s -w $extra" -o "$out.tmp" "$pkg")
    mv -f "$out.tmp" "$out"
    log "built $(basename "$out") in $((SECONDS - t0)) s ($(du -h "$out" | cut -f1))"
}

# --- etcd ---------------------------------------------------------------------------------------------
if [ ! -x "$BIN/etcd" ] || [ "$FORCE" = "1" ]; then
    ETCD_SRC="$ROOT/src/etcd"
    mkdir -p "$ETCD_SRC"
    cat >"$ETCD_SRC/main.go" <<'GO'
// Command etcd runs etcd's own server entry point; it exists so the Go module proxy can build it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
    rm -f "$ETCD_SRC/go.mod" "$ETCD_SRC/go.sum"
    (cd "$ETCD_SRC" && go mod init openforge.local/etcd >/dev/null 2>&1 \
        && go mod edit -require "go.etcd.io/etcd/server/v3@$ETCD_VERSION" \
        && nice -n 10 go mod tidy)
    build_module "$ETCD_SRC" "$BIN/etcd" .
fi

# --- kube-apiserver -----------------------------------------------------------------------------------
if [ ! -x "$BIN/kube-apiserver" ] || [ "$FORCE" = "1" ]; then
    KUBE_SRC="$ROOT/src/kube-apiserver"
    mkdir -p "$KUBE_SRC"
    rm -f "$KUBE_SRC/go.mod" "$KUBE_SRC/go.sum"
    (cd "$KUBE_SRC" && go mod init openforge.local/kube-apiserver >/dev/null 2>&1)
    # The staging modules k8s.io/kubernetes requires at the placeholder version v0.0.0 are the ones its
    # own go.mod replaces with ./staging/...; map each to its published version.
    KUBE_MOD="$(cd "$KUBE_SRC" && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
    [ -f "$KUBE_MOD" ] || die "could not download k8s.io/kubernetes@$KUBE_VERSION's go.mod"
    mapfile -t STAGING < <(sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) v0\.0\.0$#\1#p' "$KUBE_MOD")
    [ "${#STAGING[@]}" -gt 10 ] || die "found only ${#STAGING[@]} staging modules in $KUBE_MOD"
    EDITS=(-require "k8s.io/kubernetes@$KUBE_VERSION")
    for m in "${STAGING[@]}"; do EDITS+=(-replace "$m=$m@$STAGING_MINOR"); done
    (cd "$KUBE_SRC" && go mod edit "${EDITS[@]}" && go mod edit -go="$(sed -n 's/^go \(.*\)/\1/p' "$KUBE_MOD")")
    cat >"$KUBE_SRC/tools.go" <<'GO'
//go:build tools


// Package tools pins k8s.io/kubernetes so `go mod tidy` keeps it; the binary is built by package path.
package tools

import _ "k8s.io/kubernetes/cmd/kube-apiserver"
GO
    (cd "$KUBE_SRC" && nice -n 10 go mod tidy)
    # What Kubernetes' own release build stamps in; without it the server reports v0.0.0-master.
    MINOR="${KUBE_VERSION#v1.}"; MINOR="${MINOR%%.*}"
    VERSION_PKG="k8s.io/component-base/version"
    STAMP="-X $VERSION_PKG.gitVersion=$KUBE_VERSION -X $VERSION_PKG.gitMajor=1 -X $VERSION_PKG.gitMinor=$MINOR"
    STAMP="$STAMP -X $VERSION_PKG.gitTreeState=clean"
    build_module "$KUBE_SRC" "$BIN/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver "$STAMP"
fi

"$BIN/etcd" --version | head -n 1 >&2
"$BIN/kube-apiserver" --version >&2
log "done in $((SECONDS - START_S)) s; binaries in $BIN"
echo "$BIN"
