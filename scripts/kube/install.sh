#!/usr/bin/env bash
# Build a real control plane (kube-apiserver, kube-scheduler, kube-controller-manager, etcd) and kwok
# from the Go module proxy, for the integration tests and the simulated cluster (docs/kube.md).
#
# There is no Docker and no internet beyond package registries on the machines that run the suite, so
# the API server the tests talk to is compiled from source served by the Go module proxy:
#
#   kube-apiserver, kube-scheduler, kube-controller-manager
#                   k8s.io/kubernetes/cmd/<name>. `go install pkg@version` refuses them because
#                   k8s.io/kubernetes' go.mod replaces its staging modules (k8s.io/api, k8s.io/apiserver, ...)
#                   with local directories. A throwaway local module requires k8s.io/kubernetes and replaces
#                   each staging module it requires at v0.0.0 with the published k8s.io/<name> v0.<minor>.<patch>;
#                   the three are built by one `go build`, so they share every compiled package.
#   etcd            go.etcd.io/etcd/server/v3/etcdmain, wrapped by a three-line main in a second local module
#                   (etcd's own main module has local replaces too). Debian's etcd is too old for Kubernetes.
#
# The binaries land in <cache>/kube/<k8s-version>/bin and a rerun exits at once when both exist.
# The build is niced and compiles as many packages at once as there are cores; it logs each wall time.
#
# Environment:
#   OPENFORGE_CACHE          cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_KUBE_VERSION   Kubernetes version (default v1.37.2)
#   OPENFORGE_ETCD_VERSION   etcd version (default v3.7.3)
#   OPENFORGE_KWOK_VERSION   kwok version (default v0.8.0)
#   OPENFORGE_KUBE_BUILD_P   packages built in parallel (go build -p; default: the core count)
#   OPENFORGE_KUBE_FORCE=1   rebuild even if the binaries exist
#
# Prints the bin directory as the last line of stdout, so callers can do
#     KUBE_BIN="$(scripts/kube/install.sh | tail -n 1)"
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" kube-install

KUBE_VERSION="${OPENFORGE_KUBE_VERSION:-v1.37.2}"
ETCD_VERSION="${OPENFORGE_ETCD_VERSION:-v3.7.3}"
KWOK_VERSION="${OPENFORGE_KWOK_VERSION:-v0.8.0}"
PARALLEL="${OPENFORGE_KUBE_BUILD_P:-$(nproc)}"
FORCE="${OPENFORGE_KUBE_FORCE:-0}"
ROOT="$CACHE/kube/$KUBE_VERSION"
BIN="$ROOT/bin"

command -v go >/dev/null || die "go is not on PATH (Go 1.26+ is needed to build kube-apiserver $KUBE_VERSION)"

KUBE_CMDS=(kube-apiserver kube-scheduler kube-controller-manager)
kube_built() { local c; for c in "${KUBE_CMDS[@]}"; do [ -x "$BIN/$c" ] || return 1; done; }
built() { kube_built && [ -x "$BIN/etcd" ] && [ -x "$BIN/kwok" ]; }

exit_if_installed "$FORCE" built "$BIN" "already built"
mkdir -p "$BIN" "$ROOT/src"
lock_then_exit_if_installed "$ROOT/install.lock" "$FORCE" built "$BIN"

export GOFLAGS="-mod=mod -buildvcs=false -trimpath"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"
export OPENFORGE_GO_BUILD_P="$PARALLEL"
STAGING_MINOR="v0.${KUBE_VERSION#v1.}"

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
    go_lean_build "$ETCD_SRC" "$BIN" "" .
fi

# --- kube-apiserver, kube-scheduler, kube-controller-manager -------------------------------------------
if ! kube_built || [ "$FORCE" = "1" ]; then
    KUBE_SRC="$ROOT/src/kubernetes"
    mkdir -p "$KUBE_SRC"
    rm -f "$KUBE_SRC/go.mod" "$KUBE_SRC/go.sum"
    (cd "$KUBE_SRC" && go mod init openforge.local/kubernetes >/dev/null 2>&1)
    # The staging modules k8s.io/kubernetes requires at the placeholder version v0.0.0 are the ones its
    # own go.mod replaces with ./staging/...; map each to its published version.
    KUBE_MOD="$(cd "$KUBE_SRC" && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
    [ -f "$KUBE_MOD" ] || die "could not download k8s.io/kubernetes@$KUBE_VERSION's go.mod"
    mapfile -t STAGING < <(sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) v0\.0\.0$#\1#p' "$KUBE_MOD")
    [ "${#STAGING[@]}" -gt 10 ] || die "found only ${#STAGING[@]} staging modules in $KUBE_MOD"
    EDITS=(-require "k8s.io/kubernetes@$KUBE_VERSION")
    for m in "${STAGING[@]}"; do EDITS+=(-replace "$m=$m@$STAGING_MINOR"); done
    (cd "$KUBE_SRC" && go mod edit "${EDITS[@]}" && go mod edit -go="$(sed -n 's/^go \(.*\)/\1/p' "$KUBE_MOD")")
    {
        printf '//go:build tools\n\n'
        printf '// Package tools pins k8s.io/kubernetes so `go mod tidy` keeps it; the binaries are built by package path.\n'
        printf 'package tools\n\nimport (\n'
        for c in "${KUBE_CMDS[@]}"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$c"; done
        printf ')\n'
    } >"$KUBE_SRC/tools.go"
    (cd "$KUBE_SRC" && nice -n 10 go mod tidy)
    # What Kubernetes' own release build stamps in; without it the server reports v0.0.0-master.
    MINOR="${KUBE_VERSION#v1.}"; MINOR="${MINOR%%.*}"
    VERSION_PKG="k8s.io/component-base/version"
    STAMP="-X $VERSION_PKG.gitVersion=$KUBE_VERSION -X $VERSION_PKG.gitMajor=1 -X $VERSION_PKG.gitMinor=$MINOR"
    STAMP="$STAMP -X $VERSION_PKG.gitTreeState=clean"
    PKGS=(); for c in "${KUBE_CMDS[@]}"; do PKGS+=("k8s.io/kubernetes/cmd/$c"); done
    go_lean_build "$KUBE_SRC" "$BIN" "$STAMP" "${PKGS[@]}"
fi

# --- kwok ---------------------------------------------------------------------------------------------
if [ ! -x "$BIN/kwok" ] || [ "$FORCE" = "1" ]; then
    go_tool_module "$ROOT/src/kwok" kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
    go_lean_build "$ROOT/src/kwok" "$BIN" "" sigs.k8s.io/kwok/cmd/kwok
fi

built || die "built into $BIN but a binary is missing"
"$BIN/etcd" --version | head -n 1 >&2
for c in "${KUBE_CMDS[@]}"; do "$BIN/$c" --version >&2; done
"$BIN/kwok" --version >&2
log "done in $((SECONDS - START_S)) s; binaries in $BIN"
echo "$BIN"
