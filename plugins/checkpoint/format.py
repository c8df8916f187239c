"""The on-storage format of one checkpoint: names, the JSON commit record, and its (safe) decoding.

The commit record (``COMMIT.json``) holds DCP's metadata (every tensor's dtype, global size and the chunks it was
saved in) together with where each chunk lives (object, byte range) and its CRC-32. It is plain JSON: loading a
checkpoint never unpickles anything from storage except the small non-tensor values, and those only through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

FORMAT = "multidc-checkpoint/1"
COMMIT = "COMMIT.json"
_NAME = re.compile(r"^step_(\d{10,})$")


class CheckpointCorruptError(RuntimeError):
    """A committed checkpoint does not match its commit record (bad checksum, short object, bad record)."""


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint of ``step``: ``step_0000000042``. Sorts by step as text and as number."""
    return f"step_{step:010d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint folder name, or ``None`` if ``name`` is not one."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def shard_file(writer_rank: int, tag: str | None = None) -> str:
    """The shard object of ``writer_rank`` in a checkpoint folder; ``tag`` marks the shards of a save that replaces
    a committed checkpoint in place (the old shards stay, under their names, until the new commit)."""
    return f"data/rank{writer_rank:05d}.distcp" if tag is None else f"data/rank{writer_rank:05d}-{tag}.distcp"


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved item lives: ``length`` bytes at ``offset`` of object ``file`` (relative to the checkpoint).

    Tensors are stored as raw little-endian bytes of a contiguous tensor of ``dtype`` and ``sizes``; other
    values as a ``torch.save`` archive (``dtype`` is ``None``).
    """

    file: str
    offset: int
    length: int
    crc32: int
    dtype: str | None = None
    sizes: tuple[int, ...] | None = None
    region: str | None = None
    """The region (site name) whose store holds ``file``; ``None``: the checkpoint's one store. Not stored: a
    regional commit record lists each region's items under that region."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointCorruptError(f"unknown dtype {name!r} in commit record")
    return value


def encode_commit(metadata: Metadata, locations: dict[MetadataIndex, ItemLocation], *, step: int,
                  world_size: int, files: dict[str, int], extra: dict | None = None) -> bytes:
    """The JSON commit record for ``metadata`` whose items were written to ``locations``."""
    record = commit_record(metadata, locations, step=step, world_size=world_size, files=files, extra=extra)
    return json.dumps(record, separators=(",", ":")).encode()


def commit_record(metadata: Metadata, locations: dict[MetadataIndex, ItemLocation], *, step: int,
                  world_size: int, files: dict[str, int], extra: dict | None = None) -> dict:
    """The commit record of :func:`encode_commit`, as a JSON-ready dict."""
    entries = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            entries[fqn] = {"kind": "bytes", "at": _loc(locations[MetadataIndex(fqn)])}
            continue
        chunks = [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                   "at": _loc(locations[MetadataIndex(fqn, c.offsets)])} for c in md.chunks]
        entries[fqn] = {"kind": "tensor", "dtype": dtype_name(md.properties.dtype), "size": list(md.size),
                        "requires_grad": bool(md.properties.requires_grad), "chunks": chunks}
    record = {
        "format": FORMAT, "step": step, "world_size": world_size, "created_unix": time.time(),
        "torch_version": torch.__version__, "dcp_version": getattr(metadata, "version", None),
        "files": files, "extra": extra or {}, "entries": entries,
        "planner_data": {k: list(v) for k, v in (metadata.planner_data or {}).items()},
    }
    return record


def _loc(loc: ItemLocation) -> list:
    return [loc.file, loc.offset, loc.length, loc.crc32, loc.dtype, list(loc.sizes) if loc.sizes is not None else None]


@dataclass(frozen=True)
class Commit:
    """A decoded commit record."""

    step: int
    world_size: int
    created_unix: float
    files: dict[str, int]
    extra: dict
    metadata: Metadata
    locations: dict[MetadataIndex, ItemLocation]
    elsewhere: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """A regional view's keys held only by regions outside the view (unavailable ones, or ones the job has no URL
    for): key -> those regions. Empty for one store."""


def decode_commit(data: bytes, where: str) -> Commit:
    """Parse a commit record; CheckpointCorruptError naming ``where`` if it is not one this code wrote."""
    try:
        record = json.loads(data)
        if record.get("format") != FORMAT:
            raise ValueError(f"format {record.get('format')!r}, expected {FORMAT!r}")
        md, locations = {}, {}
        for fqn, entry in record["entries"].items():
            if entry["kind"] == "bytes":
                md[fqn] = BytesStorageMetadata()
                locations[MetadataIndex(fqn)] = _parse_loc(entry["at"])
                continue
            props = TensorProperties(dtype=parse_dtype(entry["dtype"]), requires_grad=bool(entry["requires_grad"]))
            chunks = []
            for c in entry["chunks"]:
                chunk = ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                chunks.append(chunk)
                locations[MetadataIndex(fqn, chunk.offsets)] = _parse_loc(c["at"])
            md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(entry["size"]), chunks=chunks)
        planner_data = {k: tuple(v) for k, v in record["planner_data"].items()}
        metadata = Metadata(state_dict_metadata=md, planner_data=planner_data, storage_data=locations)
        if record.get("dcp_version") is not None:
            metadata.version = record["dcp_version"]
        return Commit(step=int(record["step"]), world_size=int(record["world_size"]),
                      created_unix=float(record["created_unix"]), files={k: int(v) for k, v in record["files"].items()},
                      extra=dict(record.get("extra") or {}), metadata=metadata, locations=locations)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"commit record {where} is invalid: {exc}") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise CheckpointCorruptError(f"commit record {where} is invalid: {type(exc).__name__}: {exc}") from None


def _parse_loc(raw: list) -> ItemLocation:
    file, offset, length, crc, dtype, sizes = raw
    if not isinstance(file, str) or ".." in file.split("/") or file.startswith("/"):
        raise ValueError(f"bad shard object name {file!r}")
    return ItemLocation(file=file, offset=int(offset), length=int(length), crc32=int(crc),
                        dtype=dtype, sizes=tuple(int(s) for s in sizes) if sizes is not None else None)


REGIONS_FORMAT = "multidc-checkpoint-regions/1"


@dataclass(frozen=True)
class RegionalCommit:
    """A decoded regional commit record (``checkpoint.regions``): one :class:`Commit` per region, each listing the
    items stored in that region (its shard objects are the region's own)."""

    step: int
    world_size: int
    created_unix: float
    extra: dict
    parts: dict[str, Commit]

    def view(self, order: list[str]) -> Commit:
        """One commit whose every item comes from the first region of ``order`` that holds it, its locations
        tagged with that region (``ItemLocation.region``); items held only by regions outside ``order`` are left
        out, their keys listed in ``Commit.elsewhere``."""
        md, locations, planner_data, files = {}, {}, {}, {}
        for region in order:
            part = self.parts.get(region)
            if part is None:
                continue
            for fqn, item in part.metadata.state_dict_metadata.items():
                if fqn in md:
                    continue
                md[fqn] = item
                for index in ([MetadataIndex(fqn)] if isinstance(item, BytesStorageMetadata)
                              else [MetadataIndex(fqn, c.offsets) for c in item.chunks]):
                    loc = part.locations[index]
                    locations[index] = dataclasses.replace(loc, region=region)
                    files[(region, loc.file)] = part.files[loc.file]
            for key, value in (part.metadata.planner_data or {}).items():
                planner_data.setdefault(key, value)
        elsewhere: dict[str, tuple[str, ...]] = {}
        for region, part in self.parts.items():
            for fqn in part.metadata.state_dict_metadata:
                if fqn not in md and region not in order:
                    elsewhere[fqn] = (*elsewhere.get(fqn, ()), region)
        metadata = Metadata(state_dict_metadata=md, planner_data=planner_data, storage_data=locations)
        first = next((self.parts[r] for r in order if r in self.parts), None)
        if first is not None and getattr(first.metadata, "version", None) is not None:
            metadata.version = first.metadata.version
        return Commit(step=self.step, world_size=self.world_size, created_unix=self.created_unix, files=files,
                      extra=self.extra, metadata=metadata, locations=locations, elsewhere=elsewhere)


def encode_regional_commit(parts: dict[str, dict], *, step: int, world_size: int, extra: dict | None) -> bytes:
    """The regional commit record: ``parts[region]`` is that region's :func:`commit_record`."""
    record = {"format": REGIONS_FORMAT, "step": step, "world_size": world_size, "created_unix": time.time(),
              "extra": extra or {}, "regions": parts}
    return json.dumps(record, separators=(",", ":")).encode()


def decode_any(data: bytes, where: str) -> Commit | RegionalCommit:
    """A commit record of either kind (one store, or regional); CheckpointCorruptError naming ``where``."""
    try:
        record = json.loads(data)
    except ValueError as exc:
        raise CheckpointCorruptError(f"commit record {where} is invalid: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != REGIONS_FORMAT:
        return decode_commit(data, where)
    try:
        parts = {str(region): decode_commit(json.dumps(part).encode(), f"{where} (region {region!r})")
                 for region, part in record["regions"].items()}
        return RegionalCommit(step=int(record["step"]), world_size=int(record["world_size"]),
                              created_unix=float(record["created_unix"]), extra=dict(record.get("extra") or {}),
                              parts=parts)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"commit record {where} is invalid: {type(exc).__name__}: {exc}") from None
