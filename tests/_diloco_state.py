"""DiLoCo's state read back for the tests: the global copy (kept per fragment) by parameter name."""

from __future__ import annotations

from torch import nn

from multidc.hierarchical.diloco.fragments import split_fragments


def named_global(model: nn.Module, fragments: int, state: dict) -> dict:
    """``state["global"]`` (``DiLoCo.state_dict()``'s flat buffer per fragment) by parameter name, in model order, as
    ``tests/diloco_reference.py`` holds it."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    named = {}
    for params, flat in zip(split_fragments(model, fragments), state["global"].values()):
        for p, piece in zip(params, flat.split([p.numel() for p in params])):
            named[name_of[id(p)]] = piece.view(p.shape)
    return {n: named[n] for n in name_of.values()}
