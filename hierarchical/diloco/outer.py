"""The outer optimizers' state: created up front, saved as plain tensors, loaded back, and the inner optimizer's
state-initialization step told apart from a training step.

The invariant it protects: a DiLoCo checkpoint always holds every outer optimizer's state (created at construction
by one zero-gradient step at lr 0, as ``torch.distributed.checkpoint`` does), as string keys and tensors only, so a
distributed checkpoint loads it in place.
"""

from __future__ import annotations

import torch


def init_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create ``optimizer``'s state for ``params`` by one step at lr 0 with zero gradients (exact for SGD; Adam-like
    step counters start at 1)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def outer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer``'s per-parameter state with string keys and tensor values (numbers become 0-d tensors)."""
    return {
        str(i): {name: value if torch.is_tensor(value) else torch.tensor(value) for name, value in entry.items()}
        for i, entry in optimizer.state_dict()["state"].items()
    }


def load_outer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load ``outer_state`` output (copied: the caller's tensors may be a checkpoint loader's buffers)."""
    state = optimizer.state_dict()
    state["state"] = {int(i): {name: value.clone() for name, value in entry.items()} for i, entry in saved.items()}
    optimizer.load_state_dict(state)


def is_state_init_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this step is torch's optimizer-state initialization, not training: ``torch.distributed.checkpoint``
    (``get_/set_optimizer_state_dict``, so every checkpoint load) steps an optimizer without state once, with every
    lr set to 0 and every gradient zero. Such a step must not count as an inner step (nor start a sync)."""
    groups = optimizer.param_groups
    if any(float(group.get("lr", 1.0)) != 0.0 for group in groups):
        return False  # a training step: the cheap test decides almost always
    return all(p.grad is None or not p.grad.any() for group in groups for p in group["params"])
