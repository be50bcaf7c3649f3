#!/usr/bin/env bash
# Install LiteLLM's proxy server (the peer of `python -m bench.proxy`) into its own virtual environment.
#
# `pip install "litellm[proxy]==1.110.2"` cannot work from PyPI: the `proxy` extra requires
# `litellm-proxy==1.110.2`, which the registry does not serve. So this script installs
# `litellm==1.110.2` itself plus the `proxy` extra's other requirements, read from litellm's own
# METADATA, with two pins relaxed to the newest versions served (`litellm-proxy-extras`,
# `litellm-enterprise`), and adds `opentelemetry-sdk` and `prisma`, without which two imports fail
# on every request.
#
# The environment lives at
#     ${OPENFORGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/openforge}/litellm-venv
# and the downloaded wheels at <cache>/litellm-wheels (pip's HTTP cache at <cache>/pip), so a
# second install on the same machine downloads nothing.
#
# Steps (each is idempotent):
#   1. create the venv with a Python in [3.11, 3.14) and pin pip;
#   2. install litellm==1.110.2 with its own (non-extra) dependencies;
#   3. install the `proxy` extra's requirements from litellm's METADATA (markers evaluated for this
#      machine), minus `litellm-proxy`, with the relaxed pins below, plus the two additions;
#   4. import check of the proxy server module, then write a marker file. With the marker present
#      and matching, a rerun exits at once.
#
# Run the proxy offline (no telemetry, no model-cost download, no database) with
#     LITELLM_TELEMETRY_DISABLED=True LITELLM_OFFLINE_MODE=True LITELLM_LOCAL_MODEL_COST_MAP=True \
#     LITELLM_LOG=ERROR LITELLM_MODE=PRODUCTION LITELLM_MASTER_KEY=sk-... \
#     "$LITELLM_PY" -m litellm.proxy.proxy_cli --config config.yaml --host 127.0.0.1 --port 4000
# (it refuses to start without a master key; see README.md beside this file).
#
# Environment:
#   OPENFORGE_CACHE           cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_LITELLM_VENV    venv path (default <cache>/litellm-venv)
#   OPENFORGE_LITELLM_PYTHON  interpreter to build the venv from (default: first of python3.11 .. python3.13, python3)
#   OPENFORGE_LITELLM_FORCE=1 ignore the marker and re-run every step
#
# Prints the venv's python path as the last line of stdout, so callers can do
#     LITELLM_PY="$(scripts/litellm/install.sh | tail -n 1)"
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" litellm-install

LITELLM_VERSION="1.110.2"
PIP_VERSION="25.3"
# The `proxy` extra pins these to versions the registry does not serve; the newest served instead.
RELAXED=(
    "litellm-proxy-extras==0.4.110"
    "litellm-enterprise==0.1.83"
)
# Imported by the proxy on every request although no extra of litellm lists them for `proxy`.
ADDED=(
    "opentelemetry-sdk==1.45.2"
    "prisma==0.15.0"
)
# Bump when the steps below change, so existing environments are rebuilt.
RECIPE_REVISION="1"
STAMP="recipe=${RECIPE_REVISION} litellm==${LITELLM_VERSION} ${RELAXED[*]} ${ADDED[*]}"

FORCE="${OPENFORGE_LITELLM_FORCE:-0}"
VENV="${OPENFORGE_LITELLM_VENV:-$CACHE/litellm-venv}"
MARKER="$VENV/.openforge-litellm-installed"

marker_ok() { [ -x "$VENV/bin/python" ] && stamp_matches "$MARKER" "$STAMP"; }

exit_if_installed "$FORCE" marker_ok "$VENV/bin/python"
lock_then_exit_if_installed "$CACHE/litellm-install.lock" "$FORCE" marker_ok "$VENV/bin/python"
rm -f "$MARKER"

# The registry answers without cache headers, so pip's own HTTP cache stores little: keep the
# downloaded wheels in a wheelhouse and install from it with --no-index.
WHEELS="$CACHE/litellm-wheels"
mkdir -p "$WHEELS"
export PIP_CACHE_DIR="$CACHE/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1
export PIP_PROGRESS_BAR=off

pick_python() {
    if [ -n "${OPENFORGE_LITELLM_PYTHON:-}" ]; then
        echo "$OPENFORGE_LITELLM_PYTHON"
        return
    fi
    local cand
    for cand in python3.11 python3.12 python3.13 python3; do
        if command -v "$cand" >/dev/null 2>&1 \
            && "$cand" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 14)))' \
                >/dev/null 2>&1; then
            echo "$cand"
            return
        fi
    done
    return 1
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    log "reusing existing venv $VENV (no marker: finishing the install)"
else
    PY="$(pick_python)" || die "no Python 3.11-3.13 found; set OPENFORGE_LITELLM_PYTHON"
    log "creating venv $VENV with $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
VPIP=("$VPY" -m pip)

# pip_get ARGS...: install ARGS from the wheelhouse alone; when something is missing there,
# download it (with its dependencies) and install again.
pip_get() {
    if "${VPIP[@]}" install --quiet --no-index --find-links "$WHEELS" "$@" >/dev/null 2>&1; then
        log "  installed from the wheelhouse"
        return 0
    fi
    local before after
    before="$(du -sm "$WHEELS" | cut -f1)"
    log "  downloading into $WHEELS"
    "${VPIP[@]}" download --quiet --dest "$WHEELS" "$@"
    after="$(du -sm "$WHEELS" | cut -f1)"
    log "  downloaded $((after - before)) MiB; installing"
    "${VPIP[@]}" install --quiet --no-index --find-links "$WHEELS" "$@"
}

log "step 1/4: pip==$PIP_VERSION"
pip_get "pip==$PIP_VERSION"

log "step 2/4: litellm==$LITELLM_VERSION"
pip_get "litellm==$LITELLM_VERSION"

log "step 3/4: the proxy extra's requirements from litellm's METADATA"
REQS_FILE="$VENV/openforge-litellm-requirements.txt"
"$VPY" - "$LITELLM_VERSION" "${RELAXED[@]}" -- "${ADDED[@]}" >"$REQS_FILE" <<'PY'
import sys
from importlib.metadata import distribution

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement

version, rest = sys.argv[1], sys.argv[2:]
split = rest.index("--")
relaxed = {Requirement(r).name.lower(): r for r in rest[:split]}
added = rest[split + 1:]
dist = distribution("litellm")
if dist.version != version:
    sys.exit(f"litellm {dist.version} installed, expected {version}")
print(f"litellm=={version}")
seen = set()
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker is None or not req.marker.evaluate({"extra": "proxy"}):
        continue  # a base requirement (installed in step 2), another extra, or another platform
    if req.marker.evaluate({"extra": ""}):
        continue  # a base requirement, already installed
    name = req.name.lower()
    if name == "litellm-proxy":
        continue  # not served by the registry; the proxy server ships inside litellm itself
    req.marker = None
    text = relaxed.pop(name, str(req))
    if text not in seen:
        seen.add(text)
        print(text)
if relaxed:
    sys.exit(f"the proxy extra no longer lists {sorted(relaxed)}: update RELAXED")
for text in added:
    print(text)
PY
log "  $(wc -l <"$REQS_FILE") requirements -> $REQS_FILE"
pip_get -r "$REQS_FILE"

log "step 4/4: checks"
"$VPY" - <<'PY' >&2
import importlib.metadata as md
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY_DISABLED", "True")
import litellm.proxy.proxy_server  # noqa: F401
import opentelemetry.sdk  # noqa: F401
import prisma  # noqa: F401

print(f"[litellm-install] litellm {md.version('litellm')}, fastapi {md.version('fastapi')}, "
      f"uvicorn {md.version('uvicorn')}")
PY
"${VPIP[@]}" freeze >"$VENV/openforge-freeze.txt"
{
    echo "$STAMP"
    echo "installed $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - START_S)) s"
} >"$MARKER"
log "done: $VENV ($((SECONDS - START_S)) s)"
echo "$VPY"
