"""Verify a committed checkpoint against its commit record without loading it into a model.

Every shard object is read in slices of ``slice_bytes`` (``concurrency`` ranged GETs in flight), and the CRC-32 of
each item is combined from the CRCs of its parts in the slices it spans (``crc.crc32_combine``): host memory stays
at ``concurrency * slice_bytes`` whatever the size of the checkpoint or of its largest tensor.
"""

from __future__ import annotations

import bisect
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from multidc.plugins.checkpoint.crc import combine
from multidc.plugins.checkpoint.format import COMMIT, Commit, RegionalCommit, decode_any
from multidc.plugins.checkpoint.object_store import ObjectStore, ObjectStoreNotFoundError

SLICE_BYTES = 8 << 20


@dataclass
class Verdict:
    """What :func:`verify` found: ``problems`` is empty for a sound checkpoint."""

    name: str
    commit: Commit
    items: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)


def verify(store: ObjectStore, name: str, *, commit: Commit | None = None, slice_bytes: int = SLICE_BYTES,
           concurrency: int = 8) -> Verdict:
    """Check every shard object's size and every item's CRC-32 of checkpoint folder ``name``.

    ``commit``: the record to check against (default: ``name``'s ``COMMIT.json`` in ``store``); for a region-local
    checkpoint the region's part (``RegionalCommit.parts[region]``), whose shard names are that region's objects.

    Raises ``CheckpointCorruptError`` if the commit record itself is unreadable, ``ObjectStoreError`` subclasses
    if the store cannot be read (credentials, missing bucket); missing or short objects and CRC mismatches are
    reported in the verdict's ``problems``, each naming the object, the byte range and the item. ValueError: the
    record is a regional one (or a load's view of it, whose shards span regions): pass one region's part.
    """
    if slice_bytes < 1 or concurrency < 1:
        raise ValueError(f"slice_bytes={slice_bytes} and concurrency={concurrency} must be >= 1.")
    if commit is None:
        commit = decode_any(store.get(f"{name}/{COMMIT}"), store.where(f"{name}/{COMMIT}"))
    if isinstance(commit, RegionalCommit) or not all(isinstance(file, str) for file in commit.files):
        raise ValueError(f"{store.where(name)} is checked one region at a time: pass commit=<the region's part> "
                         "(RegionalCommit.parts[region]); a load's view names shards of several regions.")
    verdict = Verdict(name=name, commit=commit, items=len(commit.locations))
    items: dict[str, list] = {}
    for index, loc in commit.locations.items():
        label = index.fqn + (f" (chunk at offset {list(index.offset)})" if index.offset is not None else "")
        items.setdefault(loc.file, []).append((loc.offset, loc.offset + loc.length, loc, label))
    jobs = []
    for file, size in sorted(commit.files.items()):
        try:
            actual = store.size(f"{name}/{file}")
        except ObjectStoreNotFoundError:
            verdict.problems.append(f"shard {store.where(f'{name}/{file}')} is missing")
            items.pop(file, None)
            continue
        if actual < size:
            verdict.problems.append(f"shard {store.where(f'{name}/{file}')} has {actual} bytes, the commit record "
                                    f"says at least {size}")
            items.pop(file, None)
            continue
        jobs += [(file, start, min(size, start + slice_bytes)) for start in range(0, size, slice_bytes)]
    parts: dict[tuple, list] = {}
    lock = threading.Lock()
    for entries in items.values():
        entries.sort(key=lambda e: (e[0], e[1]))

    def check_slice(job) -> None:
        file, start, end = job
        buffer = torch.empty(end - start, dtype=torch.uint8)
        from multidc.plugins.checkpoint.storage import byte_view

        view = byte_view(buffer, writable=True)
        store.read_into(f"{name}/{file}", start, view)
        entries = items.get(file, [])
        first = bisect.bisect_right([e[1] for e in entries], start)  # items ending after this slice's start
        for lo, hi, loc, label in entries[first:]:
            if lo >= end:
                break
            a, b = max(lo, start), min(hi, end)
            crc = zlib.crc32(view[a - start:b - start])
            with lock:
                parts.setdefault((file, lo, hi, label, loc.crc32), []).append((a, crc, b - a))

    with ThreadPoolExecutor(concurrency, thread_name_prefix="multidc-ckpt-verify") as pool:
        list(pool.map(check_slice, jobs))
    verdict.bytes_read = sum(end - start for _, start, end in jobs)
    for (file, lo, hi, label, expected), pieces in sorted(parts.items()):
        pieces.sort()
        crc = combine((piece_crc, length) for _, piece_crc, length in pieces)
        if crc != expected:
            verdict.problems.append(f"shard {store.where(f'{name}/{file}')}: bytes [{lo}, {hi}) holding {label} have "
                                    f"crc32 {crc:08x}, the commit record says {expected:08x}")
    return verdict
