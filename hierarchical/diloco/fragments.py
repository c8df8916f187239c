"""Which parameters sync together: the model's blocks dealt into fragments, strided.

Streaming DiLoCo syncs one fragment at a time. Block ``i`` goes to fragment ``i mod P``, so every fragment holds
layers from the whole depth of the model (Douillard et al. 2025, "strided" fragments). Pure: no process group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The ordered blocks of ``model``: its ``pipeline_blocks()`` when it has one, else its top-level children.

    A module with a single child (a DDP wrapper, a LightningModule holding ``self.model``) is looked through, at
    every level, so the blocks are those of the model inside it.
    """
    while True:
        blocks = getattr(model, "pipeline_blocks", None)
        if callable(blocks):
            return list(blocks())
        children = list(model.children())
        if len(children) != 1:
            return children
        model = children[0]


def split_fragments(
    model: nn.Module, fragments: int, blocks: Sequence[nn.Module] | None = None
) -> list[list[nn.Parameter]]:
    """The trainable parameters of ``model`` in ``fragments`` lists: block ``i`` in list ``i mod fragments``.

    Parameters outside every block (e.g. a final norm beside ``pipeline_blocks()``) join fragment 0. A parameter
    shared by several blocks (tied embeddings) belongs to the first. Order inside a fragment is
    ``model.parameters()`` order, identical on every rank holding the same model.

    Raises:
        ValueError: more fragments than blocks, or a fragment with no trainable parameter (naming the field).
    """
    blocks = model_blocks(model) if blocks is None else list(blocks)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("DiLoCo: the model has no trainable parameter (requires_grad=True) to synchronize.")
    if fragments > 1 and fragments > len(blocks):
        raise ValueError(
            f"DiLoCoConfig.fragments={fragments} but the model has {len(blocks)} blocks (its pipeline_blocks(), else "
            f"its top-level children); use fragments <= {len(blocks)}, or pass blocks= to DiLoCo."
        )
    fragment_of: dict[int, int] = {}
    for index, block in enumerate(blocks):
        for p in block.parameters():
            fragment_of.setdefault(id(p), index % fragments)
    split: list[list[nn.Parameter]] = [[] for _ in range(fragments)]
    for p in trainable:
        split[fragment_of.get(id(p), 0)].append(p)
    empty = [i for i, params in enumerate(split) if not params]
    if empty:
        raise ValueError(
            f"DiLoCoConfig.fragments={fragments}: fragment(s) {empty} hold no trainable parameter (their blocks "
            f"{[i for i in range(len(blocks)) if i % fragments in empty]} are frozen or empty); use fewer fragments."
        )
    return split


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds for ``p``: a DTensor's local shard (FSDP2 / tensor parallelism), else ``p``."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


def digest(params: Sequence[torch.Tensor]) -> str:
    """SHA-256 (hex) of the raw bytes of this rank's tensors of ``params`` (``local_tensor``), in order: equal
    digests mean bitwise-equal values (dtype bytes, so ``-0.0`` differs from ``0.0``). Reads each tensor on the CPU
    once (SHA-256: about 1 to 2 GB/s per core)."""
    h = hashlib.sha256()
    for p in params:
        t = local_tensor(p).detach().reshape(-1)
        h.update(memoryview(t.view(torch.uint8).cpu().numpy()))
    return h.hexdigest()
