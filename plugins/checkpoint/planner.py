"""DCP planners: striped saving of replicated state, and loading that never runs arbitrary unpickling.

Striping: DCP's default planner gives each replicated tensor (the same key and offset proposed by several
ranks: DDP parameters, HSDP shards repeated across replicas, optimizer state of replicated parameters) to one
rank whole. A model dominated by a few large tensors then leaves one rank uploading most of the bytes while the
others idle. :class:`StripedSavePlanner` instead cuts every replicated tensor of at least ``stripe_min_bytes``
into row ranges (dim 0), one per replica, so each replica uploads an equal share; only one copy is stored, as
ordinary DCP chunks, so any reader (and any later layout) reassembles it through DCP's resharding.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import re
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType

from multidc.hierarchical.diloco.auto import check_auto_saved
from multidc.hierarchical.diloco.rounds import check_rounds_saved
from multidc.plugins.checkpoint.state import SITE_PREFIX

_log = logging.getLogger("multidc.plugins.checkpoint")  # where users look for checkpoint messages
# DiLoCo's per-rank state, as ``DiLoCo.state_dict`` names it: top-k error-feedback residuals (``"residual"`` ->
# ``"rank_<global rank>"`` -> ...) and the samples trained since each fragment's last sync (``"trained"`` ->
# ``"rank_<global rank>"``), anywhere under a checkpoint's ``"diloco"`` entry (per shard under a layout).
_ROUNDS = re.compile(r"^diloco\.(?:.+\.)?rounds\.")  # DiLoCo's round plan: saved with rounds by time only
_AUTO = re.compile(r"^diloco\.(?:.+\.)?auto\.")  # DiLoCo's "auto" plan: saved with "auto" settings only
_RESIDUAL = re.compile(r"^diloco\.(?:.+\.)?(?:residual|trained|in_flight_local)\.rank_\d+(?:\.|$)")


class StripedSavePlanner(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` that splits replicated tensors across the replicas holding them.

    Args:
        stripe_min_bytes: replicated tensors smaller than this go to one replica whole (the least loaded).
    """

    def __init__(self, *, stripe_min_bytes: int = 1 << 20) -> None:
        super().__init__(enable_plan_caching=False)
        if stripe_min_bytes < 0:
            raise ValueError(f"stripe_min_bytes={stripe_min_bytes} must be >= 0.")
        self.stripe_min_bytes = stripe_min_bytes
        self._local_chunks: dict[str, list[WriteItem]] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._local_items = {item.index: item for item in plan.items}
        self._local_chunks = defaultdict(list)
        for item in plan.items:
            if item.tensor_data is not None:
                self._local_chunks[item.index.fqn].append(item)
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], object]:
        return super().create_global_plan(stripe_plans(all_plans, self.stripe_min_bytes))

    def resolve_data(self, write_item: WriteItem):
        local = self._local_items.get(write_item.index)
        if local is not None and (local.tensor_data is None or local.tensor_data.chunk.sizes
                                  == write_item.tensor_data.chunk.sizes):
            return super().resolve_data(write_item)  # a whole local item (the first piece shares its index)
        original = self._containing_local_item(write_item)
        tensor = super().resolve_data(original)
        start = write_item.tensor_data.chunk.offsets[0] - original.tensor_data.chunk.offsets[0]
        return tensor.narrow(0, start, write_item.tensor_data.chunk.sizes[0])

    def _containing_local_item(self, item: WriteItem) -> WriteItem:
        """The local chunk a row-range piece was cut from (same trailing dims, rows inside)."""
        chunk = item.tensor_data.chunk
        for local in self._local_chunks.get(item.index.fqn, ()):
            own = local.tensor_data.chunk
            if own.offsets[1:] == chunk.offsets[1:] and own.sizes[1:] == chunk.sizes[1:] and (
                    own.offsets[0] <= chunk.offsets[0]
                    and chunk.offsets[0] + chunk.sizes[0] <= own.offsets[0] + own.sizes[0]):
                return local
        raise AssertionError(f"no local chunk of {item.index.fqn} contains {chunk}")


def stripe_plans(all_plans: list[SavePlan], stripe_min_bytes: int) -> list[SavePlan]:
    """Deduplicate items proposed by several ranks, splitting large tensors by rows across those ranks.

    Deterministic in its input. Every item ends up in exactly one plan (or split into row ranges, each in one).
    """
    proposers: dict[MetadataIndex, list[int]] = defaultdict(list)
    first: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            proposers[item.index].append(rank)
            first.setdefault(item.index, item)
    load = [0] * len(all_plans)
    assigned: list[list[WriteItem]] = [[] for _ in all_plans]
    for index, item in first.items():
        ranks = proposers[index]
        size = item.tensor_storage_size() or 1
        rows = item.tensor_data.chunk.sizes[0] if item.tensor_data and len(item.tensor_data.chunk.sizes) else 0
        if len(ranks) > 1 and item.type != WriteItemType.BYTE_IO and size >= stripe_min_bytes and rows >= 2:
            chosen = sorted(ranks, key=lambda r: (load[r], r))[: min(len(ranks), rows)]
            for rank, piece in zip(chosen, _row_pieces(item, len(chosen))):
                assigned[rank].append(piece)
                load[rank] += piece.tensor_storage_size() or 1
        else:
            rank = min(ranks, key=lambda r: (load[r], r))
            assigned[rank].append(item)
            load[rank] += size
    return [dataclasses.replace(plan, items=items) for plan, items in zip(all_plans, assigned)]


def _row_pieces(item: WriteItem, parts: int) -> list[WriteItem]:
    chunk = item.tensor_data.chunk
    rows = chunk.sizes[0]
    bounds = [rows * i // parts for i in range(parts + 1)]
    pieces = []
    for start, end in zip(bounds, bounds[1:]):
        offsets = torch.Size([chunk.offsets[0] + start, *chunk.offsets[1:]])
        sizes = torch.Size([end - start, *chunk.sizes[1:]])
        data = TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                               properties=item.tensor_data.properties, size=item.tensor_data.size)
        pieces.append(WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                                tensor_data=data))
    return pieces


def safe_load_bytes(value: io.BytesIO):
    """Deserialize a non-tensor value with torch's safe unpickler only (tensors, containers, primitives)."""
    return torch.load(value, weights_only=True, map_location="cpu")


class _SafeBytes:
    """Mixin for DCP load planners: non-tensor values go through torch's safe unpickler unless ``trusted``."""

    trusted: bool = False

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=False) if self.trusted else safe_load_bytes(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values go through ``torch.load(weights_only=True)``.

    With ``trusted=True`` (a store you fully control, e.g. Lightning's ``weights_only=False``) values are
    unpickled without restriction. As strict as ``allow_partial_load`` says, but for DiLoCo top-k residuals: those
    this rank wants and the checkpoint lacks (or holds in another size) restart at zero, logged.
    """

    def __init__(self, *, trusted: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.trusted = trusted

    def create_local_plan(self):
        _check_sites(self.state_dict, self.metadata.state_dict_metadata, self.allow_partial_load)
        _check_rounds(self.state_dict, self.metadata.state_dict_metadata)
        self._restart_residuals()
        return super().create_local_plan()

    def _restart_residuals(self) -> None:
        """The one exception to a strict load: DiLoCo's per-rank state (residuals, samples trained) this rank wants
        that the checkpoint lacks (saved without a top-k codec or with equal weighting, or by other ranks) or holds
        in another size (another layout or world size) is dropped from the request, so ``DiLoCo.load_state_dict``
        restarts residuals at zero and counts the steps since each fragment's sync; logged. Everything else stays as
        strict as the caller asked."""
        saved = self.metadata.state_dict_metadata
        restart = [fqn for fqn, value in self.state_dict.items() if _RESIDUAL.match(fqn) and (
            fqn not in saved or getattr(saved[fqn], "size", None) != getattr(value, "shape", None))]
        for fqn in restart:
            del self.state_dict[fqn]
            if self.flatten_state_dict:  # and from what load_state_dict receives: there it reads "not saved"
                *parents, leaf = self.mappings.pop(fqn)
                container = self.original_state_dict
                for key in parents:
                    container = container[key]
                del container[leaf]
        rank = dist.get_rank() if dist.is_initialized() else 0
        residuals = [fqn for fqn in restart if ".residual." in fqn and fqn.rsplit(".", 1)[-1].startswith("fragment_")]
        layouts = [fqn for fqn in restart if ".residual." in fqn and fqn not in residuals]
        if residuals:
            _log.warning(
                "rank %s: %d DiLoCo error-feedback residual(s) are not in this checkpoint for this rank (saved without "
                "a top-k codec, or by another layout or number of ranks): they restart at zero (%s).",
                rank, len(residuals), ", ".join(residuals[:4]))
        elif layouts:
            _log.warning("rank %s: this rank's DiLoCo error-feedback residuals were saved without their chunk plan "
                         "(%s): they restart at zero.", rank, ", ".join(layouts[:4]))
        if any(".trained." in fqn or fqn.endswith(".trained") for fqn in restart):
            _log.info("rank %s: the DiLoCo samples this rank trained since each fragment's last sync are not in this "
                      "checkpoint (saved with equal weighting, or by another number of ranks): counted as one per "
                      "inner step since then.", rank)


def _check_sites(wanted: dict, saved: dict, allow_partial: bool) -> None:
    """A per-site key (``site_<k>``, see ``state.site_key``) the checkpoint lacks: name the sites it holds."""
    if allow_partial:
        return
    held = sorted({k.split(".", 1)[0] for k in saved if k.startswith(SITE_PREFIX)})
    missing = sorted({k.split(".", 1)[0] for k in wanted if k.startswith(SITE_PREFIX) and k not in saved} - set(held))
    if missing:
        holds = f"the states of {len(held)} site(s): {', '.join(held)}" if held else "no per-site states"
        raise ValueError(
            f"this checkpoint has no state for {missing[0]}: it holds {holds}. A DiLoCo checkpoint resumes only "
            "with the sites it was saved with; relaunch with that number of sites (num_sites / MULTIDC_NUM_SITES)."
        )


def _check_rounds(wanted: dict, saved: dict) -> None:
    """A DiLoCo state of rounds by time into a run of fixed rounds, or the reverse: refused (``check_rounds_saved``),
    also where the loader would drop or lack the round keys silently; the same for "auto" settings
    (``check_auto_saved``)."""
    def has(keys, pattern=_ROUNDS) -> bool:
        return any(pattern.match(k) for k in keys)

    if any(k.startswith("diloco.") for k in wanted):
        check_rounds_saved(has(saved), has(wanted))
        check_auto_saved(has(saved, _AUTO), has(wanted, _AUTO))


class SafeRebuildLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole saved state dict from the commit record (no template), with safe value loading."""

    def __init__(self, *, trusted: bool = False) -> None:
        super().__init__()
        self.trusted = trusted
