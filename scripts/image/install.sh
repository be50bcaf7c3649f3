#!/usr/bin/env bash
# Install OpenForge's processes into a new virtual environment: what the container image holds.
#
# Usage: scripts/image/install.sh VENV
#
# The Dockerfile runs this; so does the test that checks the result runs from outside the source
# tree (tests/integration/processes/test_image_install.py). Into VENV go the openforge package (every
# process of the Helm chart is `openforge <name>`) and the learner's training stack
# (scripts/learner/install.sh), then a check that all of it imports from a folder that is not the
# source tree.
#
# Environment:
#   OPENFORGE_IMAGE_LEARNER=0   leave the learner's stack out (some 5 GiB; the test does, since
#                               `make learner` installs the same stack with the same script)
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" image-install

VENV="${1:?usage: scripts/image/install.sh VENV}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${OPENFORGE_IMAGE_PYTHON:-python3.11}"

command -v "$PYTHON" >/dev/null || { log "ERROR: $PYTHON not found (OpenForge runs on Python 3.11)"; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

log "creating $VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade "pip>=24"
log "installing openforge"
# setuptools builds in the source tree's build/ unless told otherwise, and copies into it over
# what an earlier build left: a module since deleted would ship again. So openforge's wheel alone
# is built in a fresh folder (alone: a dependency pip builds from source must not share it), then
# installed with its dependencies.
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
printf '[build]\nbuild_base = %s/build\n[egg_info]\negg_base = %s\n' "$STAGE" "$STAGE" > "$STAGE/setup.cfg"
DIST_EXTRA_CONFIG="$STAGE/setup.cfg" "$VENV/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$STAGE/wheel" "$ROOT"
"$VENV/bin/python" -m pip install --quiet "$STAGE"/wheel/openforge-*.whl
if [ "${OPENFORGE_IMAGE_LEARNER:-1}" != "0" ]; then
    log "installing the learner's training stack"
    OPENFORGE_LEARNER_PYTHON="$VENV/bin/python" bash "$ROOT/scripts/learner/install.sh"
fi
log "checking the install runs outside the source tree"
(cd / && OPENFORGE_IMAGE_LEARNER="${OPENFORGE_IMAGE_LEARNER:-1}" "$VENV/bin/python" - <<'PY'
import importlib
import os

modules = ["openforge.cli", "proxy.app", "producers.shipper", "consumers.assembler.cli",
           "consumers.publisher_cli", "consumers.rollouts.cli", "openforge.watcher"]
if os.environ["OPENFORGE_IMAGE_LEARNER"] != "0":
    modules.append("learner.main")
for module in modules:
    importlib.import_module(module)
PY
)
log "done: $VENV/bin/openforge"
