#!/usr/bin/env bash
# Build Jaeger from the Go module proxy, for the trace tests and `make observe`.
#
# `jaeger` (github.com/jaegertracing/jaeger/cmd/jaeger) is Jaeger's one binary: an OpenTelemetry
# collector with an OTLP receiver, in-memory trace storage and the query API (/api/traces). Jaeger's
# go.mod has a replace line, so `go install pkg@version` refuses it; a throwaway local module requires
# it as a tool and repeats that replace. The UI's JavaScript is not part of the module (Jaeger's release
# build compiles it with npm), so this build serves the query API and a placeholder page.
#
# The binary lands in <cache>/jaeger/<version>/bin and a rerun exits at once when it exists.
#
# Environment:
#   OPENFORGE_CACHE           cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_JAEGER_VERSION  Go module version (default v1.75.0)
#   OPENFORGE_JAEGER_FORCE=1  rebuild even if the binary exists
#   OPENFORGE_GO_BUILD_P      packages built in parallel (default: the core count)
#
# Prints the bin directory as the last line of stdout, so callers can do
#     JAEGER_BIN="$(scripts/jaeger/install.sh | tail -n 1)"
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" jaeger-install

VERSION="${OPENFORGE_JAEGER_VERSION:-v1.75.0}"
FORCE="${OPENFORGE_JAEGER_FORCE:-0}"
ROOT="$CACHE/jaeger/$VERSION"
BIN="$ROOT/bin"
MODULE="github.com/jaegertracing/jaeger"

built() { [ -x "$BIN/jaeger" ]; }

exit_if_installed "$FORCE" built "$BIN" "already built"
command -v go >/dev/null || die "go is not on PATH (Go 1.24+ is needed to build Jaeger $VERSION)"
lock_then_exit_if_installed "$ROOT/install.lock" "$FORCE" built "$BIN"

export GOFLAGS="-mod=mod -buildvcs=false -trimpath"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
go_tool_module "$ROOT/src" jaeger "$MODULE/cmd/jaeger@$VERSION"
# Jaeger's own go.mod pins sarama this way; a dependency's replace lines do not apply, so repeat it.
(cd "$ROOT/src" && go mod edit -replace github.com/Shopify/sarama=github.com/Shopify/sarama@v1.33.0 \
)
go_lean_build "$ROOT/src" "$BIN" "-X $MODULE/internal/version.latestVersion=$VERSION" "$MODULE/cmd/jaeger"

built || die "built into $BIN but the binary is missing"
"$BIN/jaeger" version 2>/dev/null | head -n 3 >&2 || true
log "done in $((SECONDS - START_S)) s; binary in $BIN"
echo "$BIN"
