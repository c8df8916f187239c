"""Stateful helpers for what a training run must resume: model + optimizer (any layout) and RNG streams."""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

T = TypeVar("T")

# Per-parameter optimizer keys (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``). Unflattened, every pipeline
# stage would write the same ``param_groups`` key, only one copy would be stored, and the other stages would load
# hyper-parameters (lr, betas) of parameters they do not hold.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state_dict(model: torch.nn.Module, optimizers) -> dict:
    """The state of ``optimizers`` (one or a list, over ``model``'s parameters) as this rank holds it, flattened to
    per-parameter keys, so stages and shards of different ranks never write the same key. The one code path for
    ``ModelState`` (Accelerate, plain loops) and the Lightning strategies."""
    return get_optimizer_state_dict(model, optimizers, options=_FLAT)


def load_optimizer_state_dict(model: torch.nn.Module, optimizers, state_dict: dict) -> None:
    """Restore what :func:`optimizer_state_dict` returned (possibly written by another layout) into ``optimizers``.

    A parameter group with no parameters on this rank (a group of another pipeline stage's parameters) has no
    per-parameter keys to restore from: it keeps its current hyper-parameters, which affect no parameter here.
    """
    optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    with _without_empty_groups(optimizers):
        set_optimizer_state_dict(model, optimizers, state_dict, options=_FLAT)


@contextmanager
def _without_empty_groups(optimizers: list):
    """Hide empty parameter groups (torch's flattened loading indexes each group's first parameter)."""
    hidden = []
    for optimizer in optimizers:
        empty = [(i, g) for i, g in enumerate(optimizer.param_groups) if not g["params"]]
        if empty:
            optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
            hidden.append((optimizer, empty))
    try:
        yield
    finally:
        for optimizer, empty in hidden:  # loading replaced the list: put them back where they were
            for index, group in empty:
                optimizer.param_groups.insert(index, group)


class ModelState:
    """Model and optimizer state through ``torch.distributed.checkpoint.state_dict`` (DDP, FSDP2, TP, PP, plain).

    Keys are fully qualified parameter names without wrapper prefixes (``module.``, ``_orig_mod.``), and the
    optimizer state is flattened to per-parameter keys (hyper-parameters included), so a checkpoint written from
    one layout (4-rank DDP, FSDP2, TP, pipeline stages) loads into another (2 ranks, other stages, one process).
    Put it in the state dict passed to ``save`` / ``load``: ``{"model": ModelState(model, optimizer)}``.

    Args:
        model: the (possibly wrapped or sharded) module.
        optimizer: an optimizer over ``model``'s parameters, or a list of them, or ``None``.
    """

    def __init__(self, model: torch.nn.Module, optimizer=None) -> None:
        self.model = model
        self.optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) \
            else [optimizer]

    def state_dict(self) -> dict:
        state = {"model": get_model_state_dict(self.model)}
        if self.optimizers:
            state["optim"] = optimizer_state_dict(self.model, self.optimizers)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        set_model_state_dict(self.model, state_dict["model"])
        if self.optimizers:
            load_optimizer_state_dict(self.model, self.optimizers, state_dict["optim"])


SITE_PREFIX = "site_"


def site_key(site: int) -> str:
    """The top-level checkpoint key of one site's own state (``site_<k>``).

    Under DiLoCo each site trains alone between syncs, so model and inner-optimizer states differ between sites
    while the DiLoCo state (global parameters, outer optimizer) is the same everywhere (but for top-k residuals:
    each rank's own, under its global rank). Put the per-site states
    under ``site_key(topology.site)`` and the DiLoCo state under ``"diloco"``: each site's copy is stored once
    (striped over that site's ranks), and a load reads its own site's key. Loading a checkpoint that has no key
    for this site raises a ``ValueError`` naming the sites it holds (see ``SafeLoadPlanner``).
    """
    return f"{SITE_PREFIX}{site}"


def _default_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RNGState:
    """This rank's random number generators: torch (CPU and every CUDA device), Python ``random``, NumPy.

    Each rank stores its own streams under ``rank<r>``. When a checkpoint written by ``W`` ranks is loaded by
    rank ``r``, it resumes the streams of saved rank ``r % W`` (identical continuation for an unchanged
    layout; a deterministic, documented choice for a changed one). Everything is stored as tensors and ints,
    so loading needs no unpickling.

    Args:
        rank: the rank whose streams this is; default the global rank (0 without a process group).
    """

    def __init__(self, rank: int | None = None) -> None:
        self.rank = _default_rank() if rank is None else rank
        self._key_rank = self.rank  # differs from rank only between select_source and load_state_dict

    def select_source(self, saved_world_size: int) -> None:
        """Called by ``load`` before reading: which saved rank's streams to restore."""
        self._key_rank = self.rank % max(saved_world_size, 1)

    def state_dict(self) -> dict:
        version, mt, gauss = random.getstate()
        state = {
            "torch": torch.get_rng_state(),
            "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64),
                       "gauss": gauss if gauss is not None else float("nan")},
        }
        if torch.cuda.is_available():
            state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        numpy = _numpy()
        if numpy is not None:
            kind, keys, pos, has_gauss, cached = numpy.random.get_state()
            state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                              "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        return {f"rank{self._key_rank}": state}

    def load_state_dict(self, state_dict: dict) -> None:
        state = state_dict[f"rank{self._key_rank}"]
        self._key_rank = self.rank
        torch.set_rng_state(state["torch"])
        py = state["python"]
        gauss = None if py["gauss"] != py["gauss"] else py["gauss"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["mt"].tolist()), gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([state["cuda"][str(i)] for i in range(len(state["cuda"]))])
        numpy = _numpy()
        if numpy is not None and "numpy" in state:
            np_state = state["numpy"]
            numpy.random.set_state((np_state["kind"], np_state["keys"].numpy().astype("uint32"), np_state["pos"],
                                    np_state["has_gauss"], np_state["cached_gaussian"]))


def with_streams_of_now(call: Callable[[], T]) -> Callable[[], T]:
    """``call``, to run later under this rank's random streams as they are now, with the streams of its own time
    put back after: a checkpoint save deferred to the next quorum (``ElasticSite.save_once``) stores the streams of
    the moment it was asked for, not those after the next batch was drawn."""
    streams = RNGState()
    then = streams.state_dict()

    def run() -> T:
        now = streams.state_dict()
        streams.load_state_dict(then)
        try:
            return call()
        finally:
            streams.load_state_dict(now)

    return run


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class StatefulDict:
    """Several Stateful objects (and plain values) saved and loaded under one checkpoint key, e.g. the per-site
    ``{site_key(site): StatefulDict({"model0": ModelState(...)})}`` of a DiLoCo run."""

    def __init__(self, items: dict) -> None:
        self.items = items

    def state_dict(self) -> dict:
        return state_dicts(self.items)

    def load_state_dict(self, state_dict: dict) -> None:
        restore(self.items, state_dict)


def state_dicts(state: dict) -> dict:
    """``state`` with every Stateful replaced by its ``state_dict()`` (what DCP saves / loads into)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def restore(state: dict, loaded: dict) -> None:
    """Hand loaded values back: ``load_state_dict`` for Stateful objects, replacement for the rest (as DCP does)."""
    for key, value in state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]
