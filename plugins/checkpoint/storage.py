"""DCP ``StorageWriter`` over :class:`ObjectStore`, with per-item CRC-32 and a JSON commit.

Writing is split in two so async saves block training only for the first part:

* :func:`stage` lays this rank's share of the plan out as the shard object will be stored: for an async save
  copied into one host buffer (the snapshot), for a sync save referring to the tensors themselves (no copy);
* :func:`upload` checksums the items and uploads the shard (multipart, in parallel), with no collectives.

``ObjectStoreWriter.finish`` (coordinator, after every rank's results are in) writes ``COMMIT.json`` last. Reading
is ``reader``'s.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from multidc.plugins.checkpoint.format import (
    COMMIT,
    ItemLocation,
    dtype_name,
    encode_commit,
    shard_file,
)
from multidc.plugins.checkpoint.object_store import ObjectStore
from multidc.plugins.checkpoint.segments import Segments
from multidc.plugins.checkpoint.stop import check_stop

_ALIGN = 64


@dataclass
class Staged:
    """One rank's shard, ready to upload: ``data`` holds every item of ``plan`` back to back (the future shard
    object), ``entries`` where each item lies in it."""

    file: str
    data: Segments
    entries: list  # (WriteItem, offset, length, dtype name or None, sizes or None)


class SnapshotBuffer:
    """The host buffer an async save copies its share into, kept for the next one: reusing it spares the page
    faults of fresh memory, most of a snapshot's time. Take it again only once the upload that read it ended."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes``: the kept buffer if it holds them and is at most a quarter larger, else a new
        one (the old one is freed first, so the two are never held together)."""
        if self.tensor is None or not nbytes <= self.tensor.numel() <= nbytes + nbytes // 4:
            self.tensor = None
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        return self.tensor[:nbytes]

    def release(self) -> None:
        self.tensor = None


def stage(plan: SavePlan, planner: SavePlanner, file: str, *, snapshot: SnapshotBuffer | None = None) -> Staged:
    """This rank's items of ``plan``, laid out as the shard object will be stored.

    With ``snapshot`` (an async save) they are copied into its buffer; once this returns, training may change the
    state. Without (a sync save), the shard refers to the tensors themselves where they are plain CPU tensors
    (contiguous, strided, no lazy conj/neg, not a subclass or quantized); only the others (GPU, views) are copied,
    item by item. The state must then stay unchanged until the upload is done.
    """
    blobs, layout, total = {}, [], 0
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            blobs[item.index] = planner.resolve_data(item).getvalue()
            length, dtype, sizes = len(blobs[item.index]), None, None
        else:
            props, sizes = item.tensor_data.properties, tuple(item.tensor_data.chunk.sizes)
            length = _numel(sizes) * torch.empty((), dtype=props.dtype).element_size()
            dtype = dtype_name(props.dtype)
        total = -(-total // _ALIGN) * _ALIGN
        layout.append((item, total, length, dtype, sizes))
        total += length
    if snapshot is not None:
        buffer = snapshot.take(total)
        for item, offset, length, _, sizes in layout:
            if length:
                target = buffer[offset:offset + length]
                if item.index in blobs:
                    target.copy_(torch.frombuffer(bytearray(blobs[item.index]), dtype=torch.uint8))
                else:
                    tensor = _resolved(planner, item, sizes)
                    target.view(tensor.dtype).view(sizes).copy_(tensor)
        return Staged(file=file, data=Segments([byte_view(buffer)]), entries=layout)
    views, end = [], 0
    for item, offset, length, _, sizes in layout:
        views.append(bytes(offset - end))  # the alignment padding
        end = offset + length
        if item.index in blobs:
            views.append(blobs[item.index])
        elif length:
            tensor = _resolved(planner, item, sizes)
            if not _plain(tensor):
                tensor = torch.empty(sizes, dtype=tensor.dtype).copy_(tensor)
            views.append(byte_view(tensor.reshape(-1).view(torch.uint8)))
            if len(views[-1]) != length:  # every later item would be misplaced in the shard
                raise AssertionError(f"{item.index.fqn}: {len(views[-1])} bytes resolved, {length} planned")
    return Staged(file=file, data=Segments(views), entries=layout)


def subset(staged: Staged, keys, file: str) -> Staged:
    """The items of ``staged`` whose key (FQN) is in ``keys``, laid out back to back as the object ``file`` (another
    region's copy of them); shares ``staged``'s buffers, so it is valid as long as they are (no copy)."""
    views, entries, end = [], [], 0
    for item, offset, length, dtype, sizes in staged.entries:
        if item.index.fqn not in keys:
            continue
        at = -(-end // _ALIGN) * _ALIGN
        views += [bytes(at - end), *staged.data.slice(offset, offset + length).views]
        entries.append((item, at, length, dtype, sizes))
        end = at + length
    return Staged(file=file, data=Segments(views), entries=entries)


def _resolved(planner: SavePlanner, item, sizes: tuple) -> torch.Tensor:
    tensor = planner.resolve_data(item).detach()
    if tuple(tensor.shape) != sizes:
        raise AssertionError(f"{item.index.fqn}: resolved shape {tuple(tensor.shape)} != planned {sizes}")
    return tensor


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds exactly its bytes as stored: a plain CPU tensor (no subclass: a wrapper's
    own storage is empty; not quantized), strided, contiguous, no lazy conj/neg."""
    return (type(tensor) is torch.Tensor and not tensor.is_quantized and tensor.device.type == "cpu"
            and tensor.layout == torch.strided and tensor.is_contiguous() and not tensor.is_conj()
            and not tensor.is_neg())


def byte_view(tensor: torch.Tensor, *, writable: bool = False) -> memoryview:
    """A zero-copy memoryview of a contiguous CPU uint8 tensor's bytes (no NumPy needed), read-only unless
    ``writable``. The view keeps ``tensor`` alive.
    """
    if tensor.dtype != torch.uint8 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise AssertionError(f"byte_view needs a contiguous CPU uint8 tensor, got {tensor.dtype} on {tensor.device}")
    if tensor.numel() == 0:
        return memoryview(bytearray() if writable else b"")
    if not tensor.data_ptr():  # a wrapper subclass: no memory of its own to view
        raise AssertionError(f"byte_view of a {type(tensor).__name__} without storage")
    array = (ctypes.c_uint8 * tensor.numel()).from_address(tensor.data_ptr())
    array._keep_alive = tensor  # the memory belongs to the tensor
    view = memoryview(array).cast("B")
    return view if writable else view.toreadonly()


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def upload(staged: Staged, store: ObjectStore, checkpoint: str, stop=None) -> list[WriteResult]:
    """Checksum and upload one staged shard; returns DCP write results carrying :class:`ItemLocation`.

    ``stop``: an optional ``threading.Event`` (or anything with ``is_set()``); once set (the save was abandoned, or
    failed on another rank), a multipart upload cancels its parts, in flight too, and is aborted.
    """
    if not staged.entries:
        return []
    data, crcs = staged.data, []
    # zlib releases the GIL: the checksums are computed while the parts upload, not before
    checksums = threading.Thread(target=lambda: crcs.extend(data.slice(offset, offset + length).crc32()
                                                            for _, offset, length, _, _ in staged.entries),
                                 name="multidc-ckpt-crc", daemon=True)
    check_stop(stop, f"uploading {staged.file}")
    checksums.start()
    try:
        store.put(f"{checkpoint}/{staged.file}", data, stop=stop)
    finally:
        checksums.join()
    results = []
    for (item, offset, length, dtype, sizes), crc in zip(staged.entries, crcs, strict=True):
        location = ItemLocation(file=staged.file, offset=offset, length=length, crc32=crc, dtype=dtype, sizes=sizes)
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=location))
    return results


def commit_bytes(metadata: Metadata, results: list[list[WriteResult]], *, step: int, world_size: int,
                 extra: dict | None = None) -> bytes:
    locations, files = {}, {}
    for rank_results in results:
        for result in rank_results:
            loc: ItemLocation = result.storage_data
            locations[result.index] = loc
            files[loc.file] = max(files.get(loc.file, 0), loc.offset + loc.length)
    metadata.storage_data = locations
    return encode_commit(metadata, locations, step=step, world_size=world_size, files=files, extra=extra)


class ObjectStoreWriter(StorageWriter):
    """DCP storage writer for one checkpoint folder ``checkpoint`` under ``store`` (also usable with ``dcp.save``).

    Every rank writes one shard object; the coordinator writes ``COMMIT.json`` in ``finish``, which DCP calls
    only after every rank's writes succeeded. ``step`` and ``extra`` go into the commit record.
    """

    def __init__(self, store: ObjectStore, checkpoint: str, *, step: int = 0, extra: dict | None = None,
                 shard_tag: str | None = None) -> None:
        super().__init__()
        self.store, self.checkpoint, self.step, self.extra = store, checkpoint, step, extra
        self.shard_tag = shard_tag  # see shard_file: set when replacing a committed checkpoint in place
        self.world_size = 1

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.checkpoint:
            raise ValueError("ObjectStoreWriter is bound to one checkpoint; create a new writer for another.")

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.world_size = len(plans)
        return [_with_file(plan, shard_file(rank, self.shard_tag)) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        # DCP's own write: synchronous (dcp.async_save has copied the state already), so no snapshot is needed
        staged = stage(plan, planner, plan.storage_data)
        future.set_result(upload(staged, self.store, self.checkpoint))
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        data = commit_bytes(metadata, results, step=self.step, world_size=self.world_size, extra=self.extra)
        self.store.put(f"{self.checkpoint}/{COMMIT}", data, atomic=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked implicitly by dcp.save: construct it explicitly


def _with_file(plan: SavePlan, file: str) -> SavePlan:
    import dataclasses

    return dataclasses.replace(plan, storage_data=file)
