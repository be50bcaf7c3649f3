#!/usr/bin/env bash
# Build Prometheus and promtool from the Go module proxy, for the dashboard tests and `make observe`.
#
# Prometheus publishes its Go module as v0.<major><minor>.<patch> (v0.316.0 is Prometheus 3.16.0). Its
# OTLP receiver (--web.enable-otlp-receiver) takes the processes' OpenTelemetry metrics directly, so no
# collector sits between them. The web UI's JavaScript is not part of the module (Prometheus' release
# build compiles it with npm), so this build serves the HTTP API but no web UI; point Grafana, or curl,
# at the API.
#
# The binaries land in <cache>/prometheus/<version>/bin and a rerun exits at once when both exist.
#
# Environment:
#   OPENFORGE_CACHE               cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_PROMETHEUS_VERSION  Go module version (default v0.316.0)
#   OPENFORGE_PROMETHEUS_FORCE=1  rebuild even if the binaries exist
#   OPENFORGE_GO_BUILD_P          packages built in parallel (default: the core count)
#
# Prints the bin directory as the last line of stdout, so callers can do
#     PROM_BIN="$(scripts/prometheus/install.sh | tail -n 1)"
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" prometheus-install

VERSION="${OPENFORGE_PROMETHEUS_VERSION:-v0.316.0}"
FORCE="${OPENFORGE_PROMETHEUS_FORCE:-0}"
ROOT="$CACHE/prometheus/$VERSION"
BIN="$ROOT/bin"
MODULE="github.com/prometheus/prometheus"

built() { [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ]; }

exit_if_installed "$FORCE" built "$BIN" "already built"
command -v go >/dev/null || die "go is not on PATH (Go 1.26+ is needed to build Prometheus $VERSION)"
lock_then_exit_if_installed "$ROOT/install.lock" "$FORCE" built "$BIN"

# remove_all_sd leaves out the cloud service discoveries (AWS, Azure, GCE, Kubernetes, ... : most of the
# compile time); file and HTTP discovery stay. The processes push over OTLP, so nothing is discovered.
export GOFLAGS="-mod=mod -buildvcs=false -trimpath -tags=remove_all_sd"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
go_tool_module "$ROOT/src" prometheus "$MODULE/cmd/prometheus@$VERSION" "$MODULE/cmd/promtool@$VERSION"
# What Prometheus' own release build stamps in, so `prometheus --version` and /api/v1/status/buildinfo
# report the release: v0.316.0 -> 3.16.0.
RELEASE="${VERSION#v0.}"; RELEASE="${RELEASE:0:1}.$((10#${RELEASE:1:2}))${RELEASE:3}"
STAMP="-X github.com/prometheus/common/version.Version=$RELEASE -X github.com/prometheus/common/version.Branch=release"
go_lean_build "$ROOT/src" "$BIN" "$STAMP" "$MODULE/cmd/prometheus" "$MODULE/cmd/promtool"

built || die "built into $BIN but a binary is missing"
"$BIN/prometheus" --version 2>&1 | head -n 1 >&2
log "done in $((SECONDS - START_S)) s; binaries in $BIN"
echo "$BIN"
