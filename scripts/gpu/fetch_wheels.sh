#!/usr/bin/env bash
# Download the wheels check_learner.sh installs on a GPU machine that has torch and transformers
# but not this project's environment (and no network): veRL 0.9.1 without its dependencies, and
# the packages the learner's import chain needs beyond torch/transformers (pydantic, aiokafka,
# OpenTelemetry, tensordict, omegaconf, peft, ...). Ray is left out on purpose (about 70 MB; see
# check_learner.py for the stand-in). Compiled packages come for CPython 3.11-3.13 on x86_64
# Linux, so the folder fits whatever python3 the machine has; pip picks the matching one there.
#
# Usage: scripts/gpu/fetch_wheels.sh [DEST]   (default scripts/gpu/wheels, git-ignored; < 20 MB)
set -Eeuo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="${1:-$HERE/wheels}"
PY="${PYTHON:-$HERE/../../.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PIP_DISABLE_PIP_VERSION_CHECK=1

PURE=(
    "verl==0.9.1" "peft==0.21.2" "accelerate==1.15.0" "codetiming==1.4.0" "omegaconf==2.3.1"
    "cloudpickle==3.1.3" "pyvers==0.1.0" "pydantic==2.14.4" "pydantic-settings==2.16.3"
    "python-dotenv==1.2.4" "typing-inspection==0.4.5" "annotated-types==0.8.0" "async-timeout==5.0.1"
    "opentelemetry-api==1.45.2" "opentelemetry-sdk==1.45.2" "opentelemetry-semantic-conventions==0.66b2"
    "importlib-metadata" "zipp" "attrs==26.1.0"
)
SDIST_ONLY=("antlr4-python3-runtime==4.9.3")   # omegaconf's parser runtime: built into a wheel here
COMPILED=("pydantic-core==2.50.5" "aiokafka==0.14.0" "tensordict==0.10.0" "orjson==3.13.0" "psutil==7.2.2")
PYTHONS=(3.11 3.12 3.13)   # the project needs 3.11+

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$DEST" "${PURE[@]}"
"$PY" -m pip wheel --quiet --no-deps -w "$DEST" "${SDIST_ONLY[@]}"
for v in "${PYTHONS[@]}"; do
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$v" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$DEST" "${COMPILED[@]}"
done
# What check_learner.sh installs, by name: pip chooses each compiled wheel for the running Python.
printf '%s\n' "${PURE[@]}" "${SDIST_ONLY[@]}" "${COMPILED[@]}" > "$DEST/requirements.txt"
du -sh "$DEST" >&2
