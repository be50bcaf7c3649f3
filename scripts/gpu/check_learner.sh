#!/usr/bin/env bash
# GPU check of the learner (hf and fsdp engines side by side), runnable with a machine's own
# python3 that has CUDA torch and transformers but not this project's environment, and no network.
#
# It installs the wheel folder made by fetch_wheels.sh (veRL 0.9.1 and the learner's small
# dependencies) with `pip --no-index --no-deps --target` into a temporary folder, puts that folder
# and the repository on PYTHONPATH (nothing of the system is touched), and runs check_learner.py,
# which writes learner_gpu_check.json to $OUT when set. Budget: under 4 minutes on one H200.
#
# Usage: scripts/gpu/check_learner.sh [check_learner.py args: --device cpu --small --steps N ...]
# Environment: PYTHON (default python3), OPENFORGE_GPU_WHEELS (default scripts/gpu/wheels).
set -Eeuo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${OPENFORGE_GPU_WHEELS:-$HERE/wheels}"
START_S=$SECONDS
log() { printf '[check-learner.sh +%ss] %s\n' "$((SECONDS - START_S))" "$*" >&2; }

if [ ! -f "$WHEELS/requirements.txt" ]; then
    log "ERROR: no wheel folder at $WHEELS; run scripts/gpu/fetch_wheels.sh where a registry is reachable"
    log "       and bring the folder along (it is git-ignored)"
    exit 2
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    log "ERROR: $("$PY" --version 2>&1) is too old: the learner needs Python 3.11+ (set PYTHON=...)"
    exit 2
fi
SITE="$(mktemp -d "${TMPDIR:-/tmp}/openforge-gpu-site-XXXXXX")"
trap 'rm -rf "$SITE"' EXIT
log "installing $(grep -c . "$WHEELS/requirements.txt") packages from $WHEELS into $SITE"
if "$PY" -m pip --version >/dev/null 2>&1; then
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --quiet --no-index --no-deps --no-compile \
        --find-links "$WHEELS" --target "$SITE" -r "$WHEELS/requirements.txt"
else
    # No pip: a wheel is a zip archive; unpack the ones whose tag fits this interpreter.
    log "no pip for $PY; unpacking the wheels directly"
    "$PY" - "$WHEELS" "$SITE" <<'PY'
import sys, zipfile
from pathlib import Path
wheels, site = Path(sys.argv[1]), Path(sys.argv[2])
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
for wheel in sorted(wheels.glob("*.whl")):
    python_tag, abi_tag = wheel.stem.split("-")[-3:-1]
    if python_tag.startswith("py3") or abi_tag == "abi3" or python_tag == tag:
        zipfile.ZipFile(wheel).extractall(site)
PY
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# veRL's package __init__ loads plugins from entry points and logs at import; keep it quiet and local.
export VERL_USE_EXTERNAL_PLUGINS=none TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
log "running check_learner.py $*"
set +e
"$PY" "$HERE/check_learner.py" "$@"
rc=$?
set -e
log "done in $((SECONDS - START_S)) s (exit $rc)"
exit $rc
