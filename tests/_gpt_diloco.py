"""The tiny GPT, its data and the full-tensor view that the parallel_3d DiLoCo test and its Trainer script share."""

from __future__ import annotations

import torch

from tests._tiny_models import TinyGPT

LR, ROWS, SEQ_TOKENS, VOCAB = 0.1, 4, 4, 32


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(2)


def rows(site: int, local: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows data-parallel replica ``local`` of ``site`` trains on at inner step ``step`` (1-based)."""
    g = torch.Generator().manual_seed(10_000 * site + 100 * local + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ_TOKENS + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def full(named) -> dict[str, torch.Tensor]:
    """Full values of (possibly DTensor) tensors; collective over their meshes (inside the site)."""
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for n, t in named}
