"""DCP ``StorageReader`` over :class:`ObjectStore`: striped ranged reads straight into the destination tensors.

``prepare_global_plan`` (coordinator) turns every rank's DCP read plan into one :class:`ReadSchedule`
(``read_plan``): who GETs which byte ranges and to whom they are sent inside the site. ``read_data`` runs this
rank's part (``striped_read``) and copies each piece, as it arrives, into the tensors DCP resolved for it (the
caller's, preallocated): no whole shard, no whole item and no second copy of the state is ever held. Values
(non-tensors) are unpickled only after their CRC-32 matched, with ``torch.load(weights_only=True)`` unless the
planner is trusted.
"""

from __future__ import annotations

import dataclasses
import io
import os

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from multidc.plugins.checkpoint.format import COMMIT, CheckpointCorruptError, ItemLocation, decode_commit, parse_dtype
from multidc.plugins.checkpoint.read_plan import Piece, ReadSchedule, plan_reads, row_bytes
from multidc.plugins.checkpoint.striped_read import StripedRead

_MIB = 1 << 20


@dataclasses.dataclass(kw_only=True)
class ReadConfig:
    """How a load reads: piece size, memory budgets, parallelism, and which replicated items are striped."""

    piece_bytes: int = 8 * _MIB
    """Bytes per ranged GET (rounded to whole dim-0 rows)."""
    round_bytes: int = 64 * _MIB
    """Most bytes a rank reads, or receives from its site, in one exchange round: bounds the receive buffer (used
    only by pieces that cannot land straight in their destination)."""
    read_ahead_bytes: int = 64 * _MIB
    """Most bytes of GET buffers a rank holds at once, in flight or kept for reuse (raised to ``round_bytes`` if
    below it); buffers of ``piece_bytes`` are reused whatever the exact piece size. Pieces that land straight in
    their destination take no buffer."""
    concurrency: int | None = None
    """Ranged GETs in flight per rank (``None``: the Checkpointer's ``max_concurrency``, else 8)."""
    stripe_min_bytes: int | None = None
    """Items several ranks of a site need are read once per site: cut across several of them from this size on,
    read whole by one of them (and sent to the others) below it (``None``: the Checkpointer's ``stripe_min_mb``,
    else 1 MiB)."""

    def __post_init__(self) -> None:
        for name in ("piece_bytes", "round_bytes", "read_ahead_bytes", "concurrency", "stripe_min_bytes"):
            value, least = getattr(self, name), 0 if name == "stripe_min_bytes" else 1
            if value is None and name in ("concurrency", "stripe_min_bytes"):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                unit, example = ("a count", "8") if name == "concurrency" else ("bytes", "4 << 20")
                raise ValueError(f"ReadConfig.{name}={value!r} must be an int ({unit}), e.g. {name}={example}.")
            if value < least:
                raise ValueError(f"ReadConfig.{name}={value} must be >= {least}; raise it.")
        self.read_ahead_bytes = max(self.read_ahead_bytes, self.round_bytes)  # a round's reads must fit

    def resolved(self, *, concurrency: int = 8, stripe_min_bytes: int = _MIB) -> ReadConfig:
        """This config with the fields left ``None`` set to the given defaults (the Checkpointer's settings)."""
        return dataclasses.replace(
            self, concurrency=concurrency if self.concurrency is None else self.concurrency,
            stripe_min_bytes=stripe_min_bytes if self.stripe_min_bytes is None else self.stripe_min_bytes)


class ObjectStoreReader(StorageReader):
    """DCP storage reader for one committed checkpoint; verifies each item's CRC-32.

    Args:
        store, checkpoint, commit: where the checkpoint is and its decoded commit record (read if ``None``).
        comm: the checkpoint group's ``Comm``. With it, ``read_data`` runs under its heartbeat and items needed by
            several ranks of a site are read striped and exchanged on ``comm.data_group``; without it each rank
            reads what it needs alone.
        sites: the site of every rank of ``comm``'s group (default: one site).
        config: :class:`ReadConfig`.
        regions: region name -> store, for the locations that name a region (a regional checkpoint, whose ranks
            may each see another view of it: each rank's plan carries its own locations to the coordinator).
    """

    def __init__(self, store, checkpoint: str, commit=None, *, comm=None, sites: list[int] | None = None,
                 config: ReadConfig | None = None, regions: dict | None = None) -> None:
        super().__init__()
        self.store, self.checkpoint, self.commit, self.comm = store, checkpoint, commit, comm
        self.sites, self.config = sites, (config or ReadConfig()).resolved()
        self.regions = regions

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.commit is None:
            where = self.store.where(f"{self.checkpoint}/{COMMIT}")
            self.commit = decode_commit(self.store.get(f"{self.checkpoint}/{COMMIT}"), where)
        return self.commit.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.locations: dict[MetadataIndex, ItemLocation] = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # this rank's locations travel with its plan: under regions each rank resolves items in its own view
        return dataclasses.replace(plan, storage_data=[self.locations[item.storage_index] for item in plan.items])

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        striped = self.comm is not None and getattr(self.comm, "data_group", None) is not None
        sites = (self.sites or [0] * len(plans)) if striped else list(range(len(plans)))  # own site: no exchange
        needs = [{loc: _name(item.storage_index) for item, loc in zip(plan.items, plan.storage_data, strict=True)}
                 for plan in plans]
        schedule = plan_reads(needs, sites, piece_bytes=self.config.piece_bytes,
                              round_bytes=self.config.round_bytes, stripe_min_bytes=self.config.stripe_min_bytes)
        return [dataclasses.replace(plan, storage_data=schedule) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner, *, error: Exception | None = None) -> Future[None]:
        """Read this rank's part of ``plan`` (collective with ``comm``). ``error``: this rank failed before reading
        (e.g. finishing its plan); it still joins the read's collectives, and every rank raises that error."""
        if self.comm is None:
            self._read_all(plan, planner, error)
        else:
            self.comm.alive(self._read_all, plan, planner, error, what="download")
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner, error: Exception | None = None) -> None:
        schedule: ReadSchedule = plan.storage_data
        comm = self.comm
        targets = None
        try:
            if error is None:
                targets = _Targets(schedule, plan, planner, self.locations, self.store.where(self.checkpoint))
        except Exception as exc:  # reported through the read's first round, so no rank waits for this one
            error = exc
        read = StripedRead(self.store, self.checkpoint, schedule, targets.deliver if targets else None,
                           direct=targets.direct if targets else None,
                           rank=comm.rank if comm else 0, group=getattr(comm, "data_group", None),
                           stop=comm.stopped if comm else None, concurrency=self.config.concurrency,
                           read_ahead_bytes=self.config.read_ahead_bytes, piece_bytes=self.config.piece_bytes,
                           peer_failed=getattr(comm, "peer_failed", None),
                           on_abandon=getattr(comm, "abandon_exchange", None), regions=self.regions)
        read.run(error)
        targets.commit(planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


def _name(index: MetadataIndex) -> str:
    return index.fqn + (f" (chunk at offset {list(index.offset)})" if index.offset is not None else "")


class _Targets:
    """This rank's destinations per location: DCP-resolved tensors (views of the caller's) and value buffers."""

    def __init__(self, schedule: ReadSchedule, plan: LoadPlan, planner: LoadPlanner, locations: dict,
                 where: str) -> None:
        position = {loc: i for i, loc in enumerate(schedule.locations)}
        self.schedule = schedule
        self.tensors: dict[int, list] = {}
        self.values: dict[int, tuple[list, bytearray]] = {}
        for item in plan.items:
            index = position[locations[item.storage_index]]
            loc = schedule.locations[index]
            if item.type == LoadItemType.BYTE_IO:
                self.values.setdefault(index, ([], bytearray(loc.length)))[0].append(item)
                continue
            target = planner.resolve_tensor(item).detach()
            if tuple(target.size()) != tuple(item.lengths):
                raise CheckpointCorruptError(
                    f"{item.dest_index.fqn}: stored chunk {tuple(item.lengths)} does not fit the requested "
                    f"{tuple(target.size())} in {where}")
            self.tensors.setdefault(index, []).append((item, target))
        self._shared = _overlapping(self.tensors)  # tied weights: one destination for two items: copy those

    def direct(self, piece: Piece) -> torch.Tensor | None:
        """The destination bytes of ``piece`` as a writable uint8 view, when one destination takes all of them as
        they are stored (a value's buffer; same dtype, whole rows of a contiguous CPU tensor that spans every other
        dimension): its GET or its receive then lands there, with no buffer and no copy. ``None``: use a buffer and
        ``deliver`` (which also reports what is wrong with a destination: this never raises)."""
        if piece.loc in self.values:  # a value's bytes land in its own buffer, verified before it is unpickled
            data = self.values[piece.loc][1]
            return torch.frombuffer(data, dtype=torch.uint8)[piece.start:piece.end] if len(data) else None
        entries = self.tensors.get(piece.loc, ())
        if len(entries) != 1 or piece.loc in self._shared:
            return None
        (item, target), = entries
        try:
            loc = self.schedule.locations[piece.loc]
            if (not loc.sizes or target.dtype != parse_dtype(loc.dtype) or target.device.type != "cpu"
                    or target.layout != torch.strided or target.is_conj() or target.is_neg()
                    or not target.is_contiguous() or any(item.storage_offsets[1:])
                    or tuple(item.lengths[1:]) != tuple(loc.sizes[1:])):
                return None
            row = row_bytes(loc)
            first, last, start = piece.start // row, piece.end // row, item.storage_offsets[0]
            if first < start or last > start + item.lengths[0]:
                return None
            return target.reshape(-1).view(torch.uint8)[(first - start) * row:(last - start) * row]
        except Exception:  # noqa: BLE001  (not a failure: the buffered path copies it, or reports the error)
            return None

    def deliver(self, piece: Piece, buffer: torch.Tensor) -> None:
        """Copy piece bytes (whole dim-0 rows of the stored chunk) into every destination that overlaps them."""
        if piece.loc in self.values:
            self.values[piece.loc][1][piece.start:piece.end] = _bytes_of(buffer)
            return
        loc = self.schedule.locations[piece.loc]
        row = row_bytes(loc)
        first, last = piece.start // row, piece.end // row
        block = buffer.view(parse_dtype(loc.dtype))
        if not loc.sizes:
            for _, target in self.tensors.get(piece.loc, ()):
                target.copy_(block.view(()))
            return
        block = block.view(last - first, *loc.sizes[1:])
        for item, target in self.tensors.get(piece.loc, ()):
            start, length = item.storage_offsets[0], item.lengths[0]
            lo, hi = max(first, start), min(last, start + length)
            if lo >= hi:
                continue
            source = block[lo - first:hi - first]
            for dim in range(1, len(loc.sizes)):
                source = source.narrow(dim, item.storage_offsets[dim], item.lengths[dim])
            target.narrow(0, lo - start, hi - lo).copy_(source)

    def commit(self, planner: LoadPlanner) -> None:
        """Hand verified values and tensors to the planner."""
        for items, data in self.values.values():
            for item in items:
                planner.load_bytes(item, io.BytesIO(bytes(data)))
        for entries in self.tensors.values():
            for item, target in entries:
                planner.commit_tensor(item, target)


def _overlapping(tensors: dict[int, list]) -> set[int]:
    """Locations whose destination shares memory with another destination (tied weights): writing those in place
    would let two transfers write the same bytes at once."""
    spans = []
    for index, entries in tensors.items():
        for _, target in entries:
            if target.device.type == "cpu" and target.numel():
                start = target.data_ptr()
                spans.append((start, start + target.numel() * target.element_size(), index))
    spans.sort()
    shared, reach, owner = set(), -1, None
    for start, end, index in spans:
        if start < reach and index != owner:
            shared |= {index, owner}
        if end > reach:
            reach, owner = end, index
    return shared


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    from multidc.plugins.checkpoint.storage import byte_view

    return byte_view(buffer.contiguous())
