"""A rank's own part of a model's and an optimizer's state, as plain tensors: what an elastic site sends to the
same-index rank of a site that (re)joins, and how that rank loads it.

Under a parallel layout (FSDP2 / tensor parallelism) parameters, gradients and optimizer states are ``DTensor``\\ s:
each rank holds its shard. Two sites with the same layout hold the same shard at the same rank index, so the live
state travels shard by shard, rank to rank, as local tensors (a ``DTensor`` names process groups of its own job,
which mean nothing in another site's). Loading puts each local tensor back into this rank's ``DTensor`` (its mesh
and placements). For a model without ``DTensor``\\ s (DDP) these are ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

import torch
from torch import nn


def _is_dtensor(value) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its local shard if a ``DTensor`` (a layout's parameter or gradient)."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def placed_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part) as a tensor placed like ``param``: a ``DTensor`` on its mesh, with its
    placements, global shape and stride, if ``param`` is one; else ``local`` itself."""
    if not _is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def local_state(value):
    """``value`` (a nested state dict) with every ``DTensor`` replaced by this rank's local tensor."""
    if isinstance(value, torch.Tensor):
        return local_tensor(value)
    if isinstance(value, dict):
        return {key: local_state(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_state(item) for item in value) if not hasattr(value, "_fields") else value
    return value


def module_state(module: nn.Module) -> dict:
    """``module.state_dict()`` with this rank's local shards in place of ``DTensor``\\ s."""
    with torch.no_grad():
        return local_state(module.state_dict())


def load_module_state(module: nn.Module, state: dict) -> None:
    """Load ``module_state`` of the same-index rank of another site (same model, same layout) into ``module``.

    Raises:
        KeyError: a key of this module's state is missing from ``state`` (or the other way round).
        RuntimeError: a shard's shape differs.
    """
    own = module.state_dict()
    if not any(_is_dtensor(value) for value in own.values()):
        module.load_state_dict(state)
        return
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise KeyError(f"the state does not match the model: missing {sorted(missing)[:5]}, unexpected "
                       f"{sorted(unexpected)[:5]}")
    with torch.no_grad():
        for key, target in own.items():
            if isinstance(target, torch.Tensor):
                local = local_tensor(target)
                if local.shape != state[key].shape:
                    raise RuntimeError(f"{key}: shard of shape {tuple(state[key].shape)}, here "
                                       f"{tuple(local.shape)}")
                local.copy_(state[key])


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with this rank's local shards in place of ``DTensor``\\ s."""
    with torch.no_grad():
        return local_state(optimizer.state_dict())


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load ``optimizer_state`` of the same-index rank of another site into ``optimizer``: a per-parameter state
    tensor shaped like a ``DTensor`` parameter's local shard becomes a ``DTensor`` like that parameter (its mesh and
    placements); scalars (``step``) stay as they are. Right for the optimizers whose per-parameter state is shaped
    like the parameter (SGD momentum, Adam / AdamW moments); a state of another shape (factored second moments)
    stays a plain tensor."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(_is_dtensor(p) for p in params):
        optimizer.load_state_dict(state)
        return
    restored = {}
    for index, entry in state["state"].items():
        param = params[int(index)]
        shape = local_tensor(param).shape
        restored[index] = {
            key: placed_like(param, value.to(param.device))
            if isinstance(value, torch.Tensor) and value.shape == shape and value.dim() > 0 else value
            for key, value in entry.items()
        }
    optimizer.load_state_dict({**state, "state": restored})


def check_elastic_layout(layout, owner: str) -> None:
    """A ValueError unless elastic sites can run the resolved ``layout`` (a ``ParallelLayout``): FSDP2 inside the
    site (``dp_shard``) only. Each rank's shards travel to the same-index rank and its gradients are averaged with
    that rank's; replicas inside the site (``dp_replicate``), pipeline stages and tensor-parallel shards would
    follow the same rule, but no test runs them yet, so they are refused rather than promised."""
    extra = {name: size for name, size in (("dp_replicate", layout.dp_replicate),
                                           ("pipeline_parallel_size", layout.pipeline_parallel_size),
                                           ("tensor_parallel_size", layout.tensor_parallel_size)) if size > 1}
    if extra:
        raise ValueError(
            f"{owner} with elastic sites shards inside each site with FSDP2 (dp_shard) only; got {extra}. Set them "
            f"to 1, or drop elastic."
        )
