"""Weights in and out of a worker's model, sharded or not, without any rank holding the whole model.

* **Initial weights** come from a Hugging Face folder's safetensors: each rank reads only its own
  shard of each tensor (a slice of the file) and casts it to the float32 master weights; the
  model was built on the meta device, so no rank ever materialises the full model.
* **Serving weights** go out as safetensors in the served dtype: each tensor is gathered in turn,
  cast, and rank 0 writes files of at most ``SHARD_BYTES`` (with an index when there are several),
  so rank 0 holds one file's worth at a time.
* **Training state** (master weights and optimizer state) is a torch distributed checkpoint: each
  rank writes and reads its own shards, and a state saved by any number of ranks (or by the
  one-process ``hf`` engine) loads into any other.

Tensor names are the model's own ``state_dict`` names, which for the dense architectures this
learner trains (Qwen2, Llama and kin) are the checkpoint's.
"""

from __future__ import annotations

import copy
import json
import shutil
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from consumers.weight_transfer import TensorMeta

__all__ = ["CARRIED", "SHARD_BYTES", "TRAINING_STATE_DIR", "ModuleSource", "load_safetensors", "load_training_state",
           "materialize", "parameters_on_meta", "save_training_state", "served_dtype", "write_model_files",
           "write_serving_weights"]

SHARD_BYTES = 2 * 1024**3
"""Largest serving safetensors file: what rank 0 holds at once while writing them."""
TRAINING_STATE_DIR = "distcp"
"""Subfolder of a training-state folder holding the distributed checkpoint (one file per rank)."""
# Files of a model folder that an engine or tokenizer needs besides config and weights.
CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
           "vocab.json", "merges.txt", "generation_config.json", "added_tokens.json")
_INDEX = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def served_dtype(setting: str, config: Any) -> torch.dtype:
    """The dtype of the serving weights: ``setting``, or with ``auto`` the dtype the model's config names."""
    if setting != "auto":
        return _DTYPES[setting]
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, torch.dtype):
        return named
    return _DTYPES.get(str(named).removeprefix("torch."), torch.float32)


_META_LOCK = threading.Lock()


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside put their parameters on the meta device (no memory) and their buffers on the host.

    Buffers stay real because some are computed at construction and carried by no checkpoint
    (rotary frequencies). A parameter is moved as it is registered, so its initialisation then
    runs on the meta device and costs nothing. Patches ``nn.Module.register_parameter`` for the
    duration (one model at a time in a process).
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    with _META_LOCK:
        setattr(nn.Module, "register_parameter", on_meta)  # noqa: B010 (a method patched for a while)
        try:
            yield
        finally:
            setattr(nn.Module, "register_parameter", register)  # noqa: B010


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give a module built on the meta device real (uninitialised) storage on ``device``.

    Buffers were built for real (only parameters go to the meta device) and hold computed values
    that no checkpoint carries (rotary frequencies): they are kept.
    """
    buffers = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    module.to_empty(device=device)
    with torch.no_grad():
        for name, buf in module.named_buffers():
            buf.copy_(buffers[name])


def _persistent_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter once (a tied one under its first name) and each persistent buffer, by state-dict name."""
    names = set(module.state_dict(keep_vars=True))
    yield from ((n, p) for n, p in module.named_parameters() if n in names)
    yield from ((n, b) for n, b in module.named_buffers() if n in names)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / _INDEX
    if index.is_file():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors files")
    return files


def _local_slices(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The part of the full tensor this rank holds (None: all of it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + s) for s, o in zip(shape, offset, strict=True))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def load_safetensors(module: nn.Module, folder: Path) -> None:
    """Fill ``module``'s parameters and persistent buffers (sharded or not) from ``folder``'s safetensors.

    Each rank reads only the slices it holds and casts them to the parameter's dtype.

    Raises:
        ValueError: a tensor the model has is missing from the files, or has another shape.
    """
    from safetensors import safe_open

    with ExitStack() as stack:
        where: dict[str, Any] = {}
        for file in _weight_files(folder):
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            where.update(dict.fromkeys(handle.keys(), handle))
        missing = [name for name, _ in _persistent_tensors(module) if name not in where]
        if missing:
            raise ValueError(f"{folder} lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, tensor in _persistent_tensors(module):
                part = where[name].get_slice(name)
                if list(part.get_shape()) != list(tensor.shape):
                    raise ValueError(f"{name}: {folder} has shape {part.get_shape()}, the model {list(tensor.shape)}")
                slices = _local_slices(tensor)
                values = part[:] if slices is None else part[slices]
                _local(tensor).copy_(values)


def write_serving_weights(module: nn.Module, folder: Path, dtype: torch.dtype, rank: int) -> None:
    """Write ``module``'s weights as safetensors in ``dtype`` into ``folder`` (rank 0 writes; all gather).

    Collective when the module is sharded: every rank must call it, in the same order of tensors.
    One file ``model.safetensors`` when it fits in ``SHARD_BYTES``, else
    ``model-0000k-of-0000n.safetensors`` files and their index, as Hugging Face writes them.
    """
    from safetensors.torch import save_file

    tensors = list(_persistent_tensors(module))
    sizes = [t.numel() * dtype.itemsize for _, t in tensors]
    plan: list[list[int]] = [[]]
    filled = 0
    for i, size in enumerate(sizes):
        if plan[-1] and filled + size > SHARD_BYTES:
            plan.append([])
            filled = 0
        plan[-1].append(i)
        filled += size
    names = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))])
    weight_map: dict[str, str] = {}
    for file, members in zip(names, plan, strict=True):
        part: dict[str, torch.Tensor] = {}
        for i in members:
            name, tensor = tensors[i]
            full = _full(tensor)  # collective for a sharded tensor
            if rank == 0:
                part[name] = full.detach().to(device="cpu", dtype=dtype).contiguous()
                weight_map[name] = file
            del full
        if rank == 0:
            save_file(part, str(folder / file), metadata={"format": "pt"})
        del part
    if rank == 0 and len(plan) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (folder / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


class ModuleSource:
    """A live model's weights in the served dtype, for the ``nccl`` weight transfer (a ``TensorSource``).

    The same tensors, names and order as :func:`write_serving_weights` writes, so what goes over the
    wire hashes to the serving folder's digests. Sharded tensors are gathered one at a time
    (collective: every rank iterates the same names in the same order; only rank 0's are sent).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self._tensors = dict(_persistent_tensors(module))
        self._dtype = dtype
        self._device = torch.device(device)

    def metadata(self) -> list[TensorMeta]:
        """Every tensor's name, served dtype and full shape, without gathering any."""
        dtype = str(self._dtype).removeprefix("torch.")
        return [TensorMeta(name, dtype, tuple(tensor.shape)) for name, tensor in self._tensors.items()]

    def tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each named tensor, gathered whole, cast and contiguous on the device."""
        for name in names:
            full = _full(self._tensors[name])
            yield name, full.detach().to(device=self._device, dtype=self._dtype).contiguous()
            del full


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def write_model_files(config: Any, dtype: torch.dtype, source: Path, folder: Path) -> None:
    """Write ``config.json`` (naming ``dtype``) and copy the tokenizer and generation files from ``source``."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(folder)
    for name in CARRIED:
        src = source / name
        if src.exists() and not (folder / name).exists():
            shutil.copy2(src, folder / name)


def _state(lm: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(lm), "optimizer": get_optimizer_state_dict(lm, optimizer)}


def _single_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _single_process_is_meant() -> Iterator[None]:
    # The one-process engine has no process group, and a state it writes loads into any number of
    # ranks: torch's warning that it assumes a single process says nothing here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save_training_state(lm: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Write master weights and optimizer state under ``folder`` (collective: each rank writes its shards)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    with _single_process_is_meant():
        save(_state(lm, optimizer), checkpoint_id=folder / TRAINING_STATE_DIR, no_dist=_single_process())


def load_training_state(lm: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load master weights and optimizer state saved by :func:`save_training_state`, resharded as needed."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    state = _state(lm, optimizer)  # initialises the optimizer's moments, which the load then overwrites
    with _single_process_is_meant():
        load(state, checkpoint_id=folder / TRAINING_STATE_DIR, no_dist=_single_process())
    set_model_state_dict(lm, state["model"])
    set_optimizer_state_dict(lm, optimizer, state["optimizer"])
