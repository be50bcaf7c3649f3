"""The ``fsdp`` worker: the ``hf`` worker's step on a model sharded with FSDP2 the way veRL shards it.

What this is, exactly: veRL 0.9.1's FSDP *engine* (``verl.workers.engine.fsdp.FSDPEngine``) is not
driven here. It is built to be constructed inside veRL's Ray worker groups (``engine_workers``),
takes its batches as nested ``TensorDict`` with veRL's padding modes, and pulls in LoRA, Ulysses and
offload machinery this learner does not use. Instead the model is wrapped with torch FSDP2
(``fully_shard``) much as that engine's ``fsdp2`` strategy does:

* each decoder layer (``_no_split_modules``), the input embeddings when they are not tied to the
  output projection, and the root are sharded with a ``MixedPrecisionPolicy`` (float32 reduce;
  float32 or bfloat16 compute by ``OPENFORGE_LEARNER_FSDP_PARAM_DTYPE``) on a one-dimensional
  device mesh over all ranks, while the model is still on the meta device;
* each rank then reads its own slices of the safetensors (or of a training state) into its
  shards (:mod:`learner.workers.weights`): no rank holds the full model;
* ``verl.utils.fsdp_utils.fsdp2_clip_grad_norm_`` clips the sharded gradients;
* serving weights are gathered one tensor at a time; training states are torch distributed
  checkpoints, each rank writing its own shards.

Forward, losses, rollout correction and micro-batching are the ``hf`` worker's (it is the base
class), so both engines compute the same step. Process group: when ``torch.distributed`` is not
initialised the worker starts a group of size 1 itself (gloo on CPU, NCCL on CUDA) from an
in-process store, so one process needs no launcher; under ``torchrun`` the group is already there
(or is created from torchrun's environment) and each rank trains its share of the batch's rows.

On CPU veRL needs a platform shim: its device helpers assume an accelerator (``get_device_id``
calls ``torch.cuda.current_device``), so :class:`CpuPlatform` is registered with veRL's platform
manager when the device is ``cpu``. CPU runs use gloo, float32 and sdpa attention: they are the
tests' real FSDP2 code path, not a simulation of it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from learner.settings import LearnerSettings
from learner.workers.hf import HFPolicyWorker
from learner.workers.model import PolicyModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def use_cpu_platform() -> None:
    """Point veRL's device helpers at the CPU (before veRL's FSDP helpers are used).

    veRL auto-detects an accelerator platform and, finding none, falls back to CUDA, whose
    ``current_device()`` fails without a driver. Idempotent.
    """
    from verl.plugin.platform import platform_manager

    current = platform_manager._current_platform  # set_platform warns when replacing one
    if current is None or current.device_name != "cpu":
        platform_manager.set_platform(_cpu_platform())


def _cpu_platform() -> Any:
    from verl.plugin.platform.platform_base import PlatformBase

    class CpuPlatform(PlatformBase):
        """veRL platform for a CPU-only process: device "cpu", gloo, no profiler, no IPC."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return CpuPlatform()


def ensure_process_group(device_type: str, timeout: timedelta | None = None) -> bool:
    """Initialise ``torch.distributed`` unless it already is; return whether this call did it.

    Under ``torchrun`` (``WORLD_SIZE`` in the environment) the group is made from torchrun's
    rendezvous; otherwise a one-process group from an in-process store, which needs no port.

    Args:
        device_type: ``cpu`` (gloo) or ``cuda`` (NCCL).
        timeout: How long a collective waits for its peers before failing; torch's default when None.
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "WORLD_SIZE" in _launcher_env():
        if timeout is None:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    return True


def _launcher_env() -> dict[str, str]:
    # The launcher's contract (torchrun sets these), not a setting of ours.
    import os

    return {k: v for k, v in os.environ.items() if k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}


class FSDPPolicyWorker(HFPolicyWorker):
    """The ``hf`` worker's step on an FSDP2-sharded model (see the module docstring)."""

    def __init__(self, settings: LearnerSettings, model_dir: Path) -> None:
        super().__init__(settings, model_dir)

    def _setup_device(self) -> torch.device:
        requested = torch.device(self.settings.device)
        if requested.type not in ("cpu", "cuda"):
            raise ValueError(f"the fsdp engine runs on cpu or cuda, not {self.settings.device!r}")
        if requested.type == "cpu":
            use_cpu_platform()
        self.owns_group = ensure_process_group(requested.type)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if requested.type == "cuda":
            if requested.index is None or self.world_size > 1:
                requested = torch.device("cuda", dist.get_node_local_rank(fallback_rank=0))
            torch.cuda.set_device(requested)
        return requested

    def _wrap(self, model: PolicyModel) -> PolicyModel:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("fsdp",))
        policy = MixedPrecisionPolicy(param_dtype=_DTYPES[self.settings.fsdp_param_dtype],
                                      reduce_dtype=torch.float32, cast_forward_inputs=True)
        options: dict[str, Any] = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": True}
        # Still on the meta device: sharding allocates nothing, and each rank then reads only its
        # own shards (learner.workers.weights). veRL's apply_fsdp2 also shards the output
        # projection on its own; here it stays with the root, gathered for the whole forward and
        # backward, because the chunked logprobs use its weight outside its own forward.
        layers = set(getattr(model.lm, "_no_split_modules", None) or ())
        for module in model.lm.modules():
            if type(module).__name__ in layers:
                fully_shard(module, **options)
        embeddings = model.lm.get_input_embeddings()
        if embeddings.weight is not model.lm.get_output_embeddings().weight:
            fully_shard(embeddings, **options)
        fully_shard(model, **options)
        return model

    def _clip_grad_norm(self) -> float:
        from verl.utils.fsdp_utils import fsdp2_clip_grad_norm_

        norm = fsdp2_clip_grad_norm_(self.model.parameters(), max_norm=self.settings.grad_clip)  # type: ignore[no-untyped-call]
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _micro_batch_count(self, local: int) -> int:
        if self.world_size == 1:
            return local
        count = torch.tensor([local], dtype=torch.long, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item())

    def _sum_across_ranks(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return [float(v) for v in tensor.tolist()]

    def close(self) -> None:
        """Destroy the process group if this worker created it (tests, repeated workers in one process)."""
        if getattr(self, "owns_group", False) and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
