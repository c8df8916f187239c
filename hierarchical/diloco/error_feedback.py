"""Error feedback for the top-k codecs: per fragment, this rank's residual (what the codec dropped from its share of
the fragment's last sync), saved and loaded with the layout it was taken under.

The invariant it protects: a residual is only ever added back to the elements it was taken from. Its slots follow
the all-reduce's chunk plan (the fragment's length, ``WanConfig.chunk_mb``, the rails, this rank's rail), so a
residual saved under one plan and loaded under another would add each dropped value to a different parameter: such a
residual restarts at zero (logged on the rank), as one never saved does.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from multidc.hierarchical.all_reduce import residual_numel
from multidc.hierarchical.chunking import MIB
from multidc.hierarchical.compression import is_sparse
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.topology import Topology

_log = logging.getLogger("multidc.hierarchical.diloco")


def residual(fragment, topology: Topology, wan: WanConfig) -> torch.Tensor | None:
    """``fragment``'s residual for a sync over ``topology`` (kept on the fragment), or None when the codec needs
    none; zero when new or when the plan changed its length."""
    if not is_sparse(wan.compression):
        return None
    numel = residual_numel(fragment.global_flat.numel(), fragment.global_flat.element_size(), topology, wan)
    if fragment.residual is None or fragment.residual.numel() != numel:
        fragment.residual = fragment.global_flat.new_zeros(numel)
    return fragment.residual


def layout(fragments: list, topology: Topology, wan: WanConfig) -> torch.Tensor:
    """int64 ``[fragments, 4]``: per fragment its length, the chunk budget in bytes, the rails and this rank's rail
    (-1: none): what decides which element each residual slot belongs to."""
    rail = -1 if topology.rail is None else topology.rail
    return torch.tensor([[f.global_flat.numel(), int(wan.chunk_mb * MIB), topology.num_rails, rail]
                         for f in fragments], dtype=torch.int64)


def state(fragments: list, topology: Topology, wan: WanConfig) -> dict:
    """``{"rank_<global rank>": {"layout": ..., "fragment_<i>": residual}}`` (live tensors: a checkpoint loader
    fills them in place), ``{}`` when the codec keeps no residual. Keyed by the global rank, so a distributed
    checkpoint stores every rank's."""
    residuals = [residual(f, topology, wan) for f in fragments]
    if residuals[0] is None:
        return {}
    mine = {"layout": layout(fragments, topology, wan)}
    mine.update({f"fragment_{i}": r for i, r in enumerate(residuals)})
    return {f"rank_{dist.get_rank()}": mine}


def load(fragments: list, saved: dict, topology: Topology, wan: WanConfig) -> None:
    """Take this rank's residuals from ``saved`` (``state`` output, maybe from another run) when they were taken under
    this run's layout; else every residual restarts at zero, and the reason is logged."""
    mine = saved.get(f"rank_{dist.get_rank()}", {})
    live = [residual(f, topology, wan) for f in fragments]
    if live[0] is None:
        return
    expected = layout(fragments, topology, wan)
    found = mine.get("layout")
    pieces = [mine.get(f"fragment_{i}") for i in range(len(fragments))]
    if found is not None and torch.equal(found.to(expected.dtype), expected) and all(
        p is not None and p.numel() == r.numel() for p, r in zip(pieces, live)
    ):
        for piece, r in zip(pieces, live):
            if piece.data_ptr() != r.data_ptr():
                r.copy_(piece)
        return
    if found is None or any(p is None for p in pieces):  # a checkpoint's loader says so, naming the keys
        _log.debug("DiLoCo: no top-k residuals were saved for this rank: they restart at zero.")
    else:
        _log.warning("DiLoCo: this rank's top-k error-feedback residuals restart at zero: they were taken under "
                     "another chunk plan ([length, chunk bytes, rails, rail] per fragment: saved %s, now %s).",
                     found.tolist(), expected.tolist())
    for r in live:
        r.zero_()
