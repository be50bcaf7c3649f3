#!/usr/bin/env bash
# Install the learner's training stack into the project's virtual environment.
#
# What the learner imports: torch, transformers (<5.11, veRL's bound), safetensors, and veRL 0.9.1's
# CPU-safe modules (verl.trainer.ppo.core_algos, verl.trainer.ppo.rollout_corr_helper). veRL declares
# wandb, datasets, tensorboard, peft, ... as hard requirements; none of them is imported by those
# modules, so veRL is installed with --no-deps plus the few packages its import chain really needs
# (ray, tensordict, omegaconf/hydra, codetiming, ...). The import check at the end proves the list.
#
# torch==2.13.0 is PyPI's CUDA-linked Linux wheel (it runs on CPU); the vLLM install keeps the same
# wheel and its CUDA libraries in <cache>/vllm-wheels, which is used as an extra source when present.
#
# Environment:
#   OPENFORGE_CACHE          cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/openforge)
#   OPENFORGE_LEARNER_PYTHON interpreter of the target venv (default .venv/bin/python)
#   OPENFORGE_LEARNER_FORCE=1  re-run even when the marker matches
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" learner-install

TORCH_VERSION="2.13.0"
VERL_VERSION="0.9.1"
REQUIREMENTS=(
    "torch==${TORCH_VERSION}"
    "transformers>=5.5.3,<5.11,!=5.6.0"   # veRL 0.9.1's bound
    "safetensors>=0.4"
    "numpy>=2.0.0"
    "packaging>=20.0"
    # veRL's import chain (verl.protocol, verl.utils, verl.workers.config):
    "ray>=2.41.0"
    "tensordict>=0.8.0,<=0.10.0,!=0.9.0"
    "omegaconf"
    "hydra-core"
    "codetiming"
    "dill"
    "cachetools"
    # The fsdp engine's verl.utils.fsdp_utils imports peft at module level (accelerate and psutil
    # come with it):
    "peft>=0.17"
)
RECIPE_REVISION="1"
STAMP="recipe=${RECIPE_REVISION} verl==${VERL_VERSION} ${REQUIREMENTS[*]}"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${OPENFORGE_LEARNER_PYTHON:-$ROOT/.venv/bin/python}"
VENV="$(dirname "$(dirname "$PY")")"
MARKER="$VENV/.openforge-learner-installed"

marker_ok() { stamp_matches "$MARKER" "$STAMP"; }

[ -x "$PY" ] || die "$PY not found; run 'make install' first"
exit_if_installed "${OPENFORGE_LEARNER_FORCE:-0}" marker_ok "" "already installed in $VENV"
rm -f "$MARKER"

export PIP_DISABLE_PIP_VERSION_CHECK=1
FIND_LINKS=()
if [ -d "$CACHE/vllm-wheels" ]; then
    FIND_LINKS=(--find-links "$CACHE/vllm-wheels")
fi
log "installing ${REQUIREMENTS[*]}"
"$PY" -m pip install --quiet "${FIND_LINKS[@]}" "${REQUIREMENTS[@]}"
log "installing verl==${VERL_VERSION} without its declared dependencies"
"$PY" -m pip install --quiet --no-deps "verl==${VERL_VERSION}"
log "import check"
"$PY" - <<'PY'
import torch, transformers, safetensors  # noqa: F401
from verl.trainer.ppo import core_algos, rollout_corr_helper  # noqa: F401
from verl.utils import fsdp_utils  # noqa: F401
print(f"torch {torch.__version__}, transformers {transformers.__version__}")
PY
printf '%s\n' "$STAMP" > "$MARKER"
log "done in $((SECONDS - START_S)) s"
