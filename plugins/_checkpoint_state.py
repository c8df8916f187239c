"""Stateful helpers for what a training run must resume: model + optimizer (any layout) and RNG streams."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist


class ModelState:
    """Model and optimizer state through ``torch.distributed.checkpoint.state_dict`` (DDP, FSDP2, TP, plain).

    Keys are fully qualified parameter names without wrapper prefixes (``module.``, ``_orig_mod.``), so a
    checkpoint written from one layout (4-rank DDP, FSDP2, TP) loads into another (2 ranks, one process).
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
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd} if self.optimizers else {"model": model_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizers, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict.get("optim", {}))


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


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy
