"""How a checkpoint's weights reach a paused replica: two backends behind one interface.

The publisher pauses a replica, asks its :class:`WeightTransfer` to load a version, then verifies,
relabels and resumes it; only the loading differs between backends.

* ``disk`` (:class:`DiskTransfer`): the replica reads the serving folder itself
  (``collective_rpc reload_weights``). Needs storage the learner and the replicas share; the one
  backend that runs on CPU.
* ``nccl`` (:class:`NcclTransfer`): vLLM's native weight-transfer endpoints. The sender (this
  process, on a GPU) opens an NCCL group with each replica's workers
  (``/init_weight_transfer_engine``, once per replica), then per update sends
  ``/start_weight_update``, one ``/update_weights`` per bucket of at most ``bucket_bytes`` while
  broadcasting that bucket's tensors (packed, as vLLM's own trainer engine does), and
  ``/finish_weight_update``. The tensors come from a :class:`TensorSource`: the serving folder
  (:class:`FolderSource`) or a live model whose FSDP shards are gathered tensor by tensor
  (``learner.workers.weights.ModuleSource``).

One NCCL group per replica, not one for all: a broadcast to several replicas at once waits for
the slowest, and a hung one would hang every replica. Each group costs the sender one send per
replica instead.

Nothing waits without a limit: every HTTP step has one, and each bucket's broadcast runs in a
thread that is awaited for at most ``timeout_s``. NCCL cannot abort a broadcast from outside, so
after a timeout the group is abandoned (the replica is told to shut it down, and the next update
opens a new one on a fresh port); the timeout is raised as :class:`TransferError` (an error event)
and counted in ``openforge.publisher.timeouts``.

**Dry mode** (``dry_run``, for machines without GPUs or NCCL): everything but the collective
runs, against the real source: the plan of buckets and their ``/update_weights`` payloads, the
lockstep iteration (gathers included) checked against the declared metadata, the timeouts. What
would have crossed the wire is hashed instead and must equal the checkpoint's digests (the bytes
the replica is verified against after loading), and the replica then loads the same version from
disk, so the rest of a publish (verify, relabel, resume) runs as it would.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from opentelemetry import metrics
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumers.checkpoint_files import weight_files
from consumers.weight_digests import PACKED, expected_digests

if TYPE_CHECKING:
    import torch

__all__ = ["Backend", "DiskTransfer", "EngineCall", "FolderSource", "NcclSettings", "NcclTransfer", "StreamDigests",
           "TensorMeta", "TensorSource", "TransferError", "WeightTransfer", "buckets"]

logger = logging.getLogger(__name__)

Backend = Literal["disk", "nccl"]
"""The weight transfer backends."""

_meter = metrics.get_meter("openforge.publisher")
timeouts = _meter.create_counter(
    "openforge.publisher.timeouts", unit="{step}",
    description="Steps of an update that hit their limit (HTTP calls to a replica, NCCL rendezvous and "
                "broadcasts), by step.")
transferred_bytes = _meter.create_counter(
    "openforge.publisher.transferred_bytes", unit="By",
    description="Bytes of weights sent over NCCL (or hashed, in dry mode), by backend.")


class TransferError(RuntimeError):
    """A weight transfer failed or timed out; the message says which step."""


class EngineCall(Protocol):
    """One HTTP call to a replica (the publisher's), raising on a non-200 answer or a timeout."""

    async def __call__(self, url: str, method: str, path: str, *, timeout_s: float | None = None,
                       params: dict[str, str] | None = None,
                       json: dict[str, Any] | None = None) -> dict[str, Any]:
        """The answer's JSON object (empty when it has none)."""
        ...


class WeightTransfer(Protocol):
    """Loads a version's weights into a paused replica; the publisher does the rest."""

    name: str
    """Backend name (``disk``, ``nccl``), for logs and metrics."""

    async def load(self, url: str, folder: Path) -> None:
        """Replace the replica's weights with those of the serving folder ``folder``.

        Raises:
            TransferError: a step failed or hit its limit.
            httpx.HTTPError: the replica could not be reached.
        """
        ...

    async def close(self) -> None:
        """Release what the backend holds (NCCL groups); idempotent."""
        ...


class DiskTransfer:
    """The replica reloads from the folder (shared storage)."""

    name = "disk"

    def __init__(self, call: EngineCall, reload_timeout_s: float) -> None:
        self._call = call
        self._timeout_s = reload_timeout_s

    async def load(self, url: str, folder: Path) -> None:
        """``collective_rpc reload_weights`` with the folder, limited by ``reload_timeout_s``."""
        await self._call(url, "POST", "/collective_rpc", timeout_s=self._timeout_s,
                         json={"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})

    async def close(self) -> None:
        """Nothing held."""


# -- what is sent ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMeta:
    """One tensor as it goes over the wire: checkpoint name, torch dtype name, full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Its size on the wire."""
        size = _DTYPE_BYTES[self.dtype]
        for dim in self.shape:
            size *= dim
        return size


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class TensorSource(Protocol):
    """The weights of one version, declared up front and materialised in buckets.

    Where materialising is a collective (an FSDP gather), every rank calls :meth:`tensors` with
    the same names in the same order; only the sending rank's tensors are sent.
    """

    def metadata(self) -> list[TensorMeta]:
        """Every tensor, in the order they are sent, without materialising any."""
        ...

    def tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The named tensors, full and contiguous, in that order."""
        ...


class FolderSource:
    """The tensors of a serving folder's safetensors, read one at a time onto ``device``."""

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        self.folder = folder
        self.device = device
        self._where: dict[str, Path] = {}
        self._meta: list[TensorMeta] = []
        import json
        import struct

        for file in weight_files(folder):
            with file.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                self._where[name] = file
                self._meta.append(TensorMeta(name, _SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])))

    def metadata(self) -> list[TensorMeta]:
        """The folder's tensors in file and header order."""
        return list(self._meta)

    def tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each named tensor read from its file (memory-mapped), then moved to ``device``."""
        from safetensors import safe_open

        for file, group in itertools.groupby(names, key=lambda n: self._where[n]):
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in group:
                    yield name, handle.get_tensor(name).to(self.device).contiguous()


def buckets(meta: Sequence[TensorMeta], limit_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive tensors grouped into buckets of at most ``limit_bytes`` (a larger tensor goes alone)."""
    plan: list[list[TensorMeta]] = []
    filled = 0
    for item in meta:
        if not plan or (plan[-1] and filled + item.nbytes > limit_bytes):
            plan.append([])
            filled = 0
        plan[-1].append(item)
        filled += item.nbytes
    return plan


def _update_info(bucket: Sequence[TensorMeta]) -> dict[str, Any]:
    """The ``/update_weights`` payload of one bucket (vLLM's ``NCCLWeightTransferUpdateInfo``)."""
    return {"names": [m.name for m in bucket], "dtype_names": [m.dtype for m in bucket],
            "shapes": [list(m.shape) for m in bucket]}


def _checked(pairs: Iterator[tuple[str, torch.Tensor]], bucket: Sequence[TensorMeta]) -> Iterator[tuple[str, Any]]:
    """The source's tensors, each checked against what the replica was told to expect.

    The receiver sizes its buffers from the declared metadata: a tensor that differs would split
    the packed stream differently on the two sides and hang the broadcast or load garbage.
    """
    sent = 0
    for name, tensor in pairs:
        if sent >= len(bucket):
            raise TransferError(f"the source yielded more tensors than declared; first extra {name!r}")
        want = bucket[sent]
        got = TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        if got != want:
            raise TransferError(f"the source yielded {got} where {want} was declared")
        sent += 1
        yield name, tensor
    if sent != len(bucket):
        raise TransferError(f"the source yielded {sent} of the {len(bucket)} tensors declared")


class StreamDigests:
    """Digests of tensors as they stream past, in the engine's parameter names (as the folder's are).

    Fused engine parameters (see :data:`consumers.weight_digests.PACKED`) hash their parts' bytes in
    the fused order whatever order the parts arrive in, so the parts are held until all arrived.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._fused: dict[str, tuple[str, list[str]]] = {}
        present = set(names)
        for name in names:
            for engine_name, parts in PACKED.items():
                head, dot, tail = name.partition(f".{parts[0]}.")
                group = [f"{head}.{part}.{tail}" for part in parts]
                if dot and all(n in present for n in group):
                    for n in group:
                        self._fused[n] = (f"{head}.{engine_name}.{tail}", group)
        self._held: dict[str, bytes] = {}
        self.digests: dict[str, str] = {}
        self.bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Account for one tensor's bytes."""
        import torch

        data = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        self.bytes += len(data)
        if name not in self._fused:
            self.digests[name] = hashlib.sha256(data).hexdigest()
            return
        engine_name, group = self._fused[name]
        self._held[name] = data
        if all(n in self._held for n in group):
            digest = hashlib.sha256()
            for n in group:
                digest.update(self._held.pop(n))
            self.digests[engine_name] = digest.hexdigest()


# -- NCCL --------------------------------------------------------------------------------------


class NcclSettings(BaseSettings):
    """The ``nccl`` backend (``OPENFORGE_PUBLISHER_NCCL_*``)."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_PUBLISHER_NCCL_", frozen=True, extra="ignore")

    master_address: str = "127.0.0.1"
    """Address of this process as the replicas' workers reach it for the NCCL rendezvous."""

    port_base: int = Field(default=29600, ge=1024, le=65000)
    """First TCP port of the rendezvous; each new group (one per replica, a new one after a
    failure) takes the next, cycling through ``port_span`` ports."""

    port_span: int = Field(default=256, ge=1)
    """Ports the rendezvous cycles through from ``port_base``."""

    device: str = "cuda:0"
    """Device the sender's tensors and its end of the groups live on."""

    bucket_bytes: int = Field(default=1 << 30, ge=1 << 20)
    """Largest bucket: tensors sent by one ``/update_weights`` call and materialised at once on the
    sender (with FSDP, gathered). Also the packed broadcast's buffer size."""

    timeout_s: float = Field(default=120.0, gt=0)
    """Limit of one bucket's broadcast and of one group's rendezvous, in seconds."""

    dry_run: bool = False
    """Run everything but the collective (CPU machines, tests); see the module docstring."""


@dataclass
class _Group:
    """One replica's NCCL group, as this process holds it."""

    port: int
    world_size: int
    communicator: Any = None
    """vLLM's ``PyNcclCommunicator`` (None in dry mode)."""


@dataclass
class DryRunReport:
    """What a dry update did instead of broadcasting (read by tests)."""

    buckets: int = 0
    bytes: int = 0
    digests: dict[str, str] = field(default_factory=dict)


class NcclTransfer:
    """vLLM's native NCCL weight transfer, one group per replica; see the module docstring."""

    name = "nccl"

    def __init__(self, call: EngineCall, settings: NcclSettings, *, request_timeout_s: float,
                 finish_timeout_s: float, source: Callable[[Path], TensorSource] | None = None,
                 disk: DiskTransfer | None = None) -> None:
        """Set up the backend; groups open on each replica's first update.

        Args:
            call: The publisher's HTTP call to a replica.
            settings: The backend's settings.
            request_timeout_s: Limit of the short control calls (start, shutdown, world size).
            finish_timeout_s: Limit of ``/finish_weight_update`` (the replica post-processes every
                layer, as after a reload).
            source: The tensors of a serving folder; default :class:`FolderSource` on ``settings.device``.
            disk: Dry mode's loader of the same version (default: a :class:`DiskTransfer`).
        """
        self._call = call
        self.settings = settings
        self._request_timeout_s = request_timeout_s
        self._finish_timeout_s = finish_timeout_s
        self._source = source or (lambda folder: FolderSource(folder, "cpu" if settings.dry_run else settings.device))
        self._disk = disk or DiskTransfer(call, finish_timeout_s)
        self._groups: dict[str, _Group] = {}
        self._ports = itertools.cycle(range(settings.port_base, settings.port_base + settings.port_span))
        self.last_dry_run: DryRunReport | None = None

    async def load(self, url: str, folder: Path) -> None:
        """Send the folder's tensors to the replica in buckets; see the module docstring."""
        source = self._source(folder)
        meta = source.metadata()
        plan = buckets(meta, self.settings.bucket_bytes)
        if self.settings.dry_run:
            await self._dry_run(url, folder, source, plan)
            return
        group = await self._group(url)
        await self._step(url, "/start_weight_update", self._request_timeout_s)
        try:
            for bucket in plan:
                await self._send(url, group, source, bucket)
        except TransferError:
            await self._abandon(url)
            raise
        await self._step(url, "/finish_weight_update", self._finish_timeout_s)

    async def close(self) -> None:
        """Shut every group down on this side (the replicas keep theirs until told or restarted)."""
        groups, self._groups = self._groups, {}
        for group in groups.values():
            _destroy(group)

    async def _send(self, url: str, group: _Group, source: TensorSource, bucket: list[TensorMeta]) -> None:
        """One bucket: the replica's receive and this side's broadcast, which meet inside NCCL."""
        receive = asyncio.ensure_future(self._call(url, "POST", "/update_weights", timeout_s=self.settings.timeout_s,
                                                   json={"update_info": _update_info(bucket)}))
        names = [m.name for m in bucket]
        broadcast = asyncio.ensure_future(asyncio.to_thread(
            _broadcast, group.communicator, _checked(source.tensors(names), bucket), self.settings))
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await asyncio.gather(receive, broadcast)
        except TimeoutError:
            timeouts.add(1, {"step": "broadcast"})
            raise TransferError(f"{url}: the broadcast of {len(bucket)} tensors ({names[0]} ...) did not finish "
                                f"within {self.settings.timeout_s:.0f}s") from None
        except Exception as exc:  # the receive's HTTP error or the broadcast's own
            raise TransferError(f"{url}: sending {len(bucket)} tensors ({names[0]} ...) failed: "
                                f"{type(exc).__name__}: {exc}") from exc
        finally:
            for task in (receive, broadcast):
                task.cancel()  # a thread stuck in NCCL cannot be stopped; its group is abandoned
        transferred_bytes.add(sum(m.nbytes for m in bucket), {"backend": "nccl"})

    async def _group(self, url: str) -> _Group:
        """The replica's group, opened on first use: the replica joins while this side opens rank 0."""
        group = self._groups.get(url)
        if group is not None:
            return group
        size = await self._call(url, "GET", "/get_world_size", timeout_s=self._request_timeout_s,
                                params={"include_dp": "true"})
        world_size = 1 + int(size.get("world_size", 1))
        group = _Group(port=next(self._ports), world_size=world_size)
        init_info = {"master_address": self.settings.master_address, "master_port": group.port,
                     "rank_offset": 1, "world_size": world_size, "packed": True,
                     "packed_buffer_size_bytes": self.settings.bucket_bytes, "packed_num_buffers": 2}
        join = asyncio.ensure_future(self._call(url, "POST", "/init_weight_transfer_engine",
                                                timeout_s=self.settings.timeout_s, json={"init_info": init_info}))
        open_ = asyncio.ensure_future(asyncio.to_thread(_open_group, self.settings, group))
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                _, group.communicator = await asyncio.gather(join, open_)
        except TimeoutError:
            timeouts.add(1, {"step": "rendezvous"})
            raise TransferError(f"{url}: the NCCL rendezvous on port {group.port} did not complete within "
                                f"{self.settings.timeout_s:.0f}s") from None
        except Exception as exc:
            raise TransferError(f"{url}: opening the NCCL group failed: {type(exc).__name__}: {exc}") from exc
        finally:
            join.cancel()
            open_.cancel()
        self._groups[url] = group
        logger.info("%s: NCCL group open (port %d, world size %d)", url, group.port, world_size)
        return group

    async def _abandon(self, url: str) -> None:
        """Drop a group a failed collective left unusable; the next update opens a new one."""
        group = self._groups.pop(url, None)
        if group is None:
            return
        try:
            await self._call(url, "POST", "/shutdown_weight_transfer_engine", timeout_s=self._request_timeout_s)
        except Exception as exc:  # noqa: BLE001 (best effort: the replica may be the one that hung)
            logger.warning("%s: shutting its NCCL group down failed: %s", url, exc)
        threading.Thread(target=_destroy, args=(group,), daemon=True, name=f"nccl-destroy:{url}").start()

    async def _step(self, url: str, path: str, timeout_s: float) -> None:
        await self._call(url, "POST", path, timeout_s=timeout_s)  # its timeout is counted by the caller's call

    async def _dry_run(self, url: str, folder: Path, source: TensorSource, plan: list[list[TensorMeta]]) -> None:
        """Every step but the collective; what would have been sent must be the checkpoint's bytes."""
        names = [m.name for bucket in plan for m in bucket]
        digests = StreamDigests(names)
        for bucket in plan:
            _update_info(bucket)  # the payload each bucket's /update_weights would carry

            def consume(bucket: list[TensorMeta] = bucket) -> None:
                for name, tensor in _checked(source.tensors([m.name for m in bucket]), bucket):
                    digests.add(name, tensor)

            try:
                await asyncio.wait_for(asyncio.to_thread(consume), timeout=self.settings.timeout_s)
            except TimeoutError:
                timeouts.add(1, {"step": "broadcast"})
                raise TransferError(f"{url}: (dry run) materialising {len(bucket)} tensors ({bucket[0].name} ...) "
                                    f"did not finish within {self.settings.timeout_s:.0f}s") from None
        expected, _ = await asyncio.to_thread(expected_digests, folder)
        differ = sorted(n for n in expected.keys() | digests.digests.keys()
                        if expected.get(n) != digests.digests.get(n))
        if differ:
            raise TransferError(f"{url}: (dry run) the tensors to send differ from the checkpoint's: {differ[:5]}")
        transferred_bytes.add(digests.bytes, {"backend": "nccl-dry-run"})
        self.last_dry_run = DryRunReport(buckets=len(plan), bytes=digests.bytes, digests=digests.digests)
        await self._disk.load(url, folder)


def _open_group(settings: NcclSettings, group: _Group) -> Any:
    """This process's end (rank 0) of a replica's group: vLLM's own trainer-side helper."""
    import torch
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    torch.cuda.set_device(torch.device(settings.device))
    return trainer_init({"master_address": settings.master_address, "master_port": group.port,
                         "world_size": group.world_size})


def _broadcast(communicator: Any, pairs: Iterator[tuple[str, Any]], settings: NcclSettings) -> None:
    """Send one bucket as vLLM's trainer engine does: packed into buffers, double-buffered on streams."""
    import torch
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    torch.cuda.set_device(torch.device(settings.device))  # the current device is per thread
    packed_nccl_broadcast_producer(iterator=pairs, group=communicator, src=0, post_iter_func=lambda item: item[1],
                                   buffer_size_bytes=settings.bucket_bytes, num_buffers=2)
    torch.cuda.current_stream().synchronize()


def _destroy(group: _Group) -> None:
    if group.communicator is not None:
        try:
            group.communicator.destroy()
        except Exception as exc:  # noqa: BLE001 (a group a failed collective left behind)
            logger.warning("destroying an NCCL group failed: %s", exc)
        group.communicator = None

