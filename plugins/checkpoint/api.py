"""The one-call API: ``save`` / ``load`` / ``wait`` / ``list_checkpoints`` / ``latest`` by URL, over one
:class:`Checkpointer` per ``(url, process_group)``."""

from __future__ import annotations

import torch.distributed as dist

from multidc.plugins.checkpoint.checkpointer import Checkpointer, _committed
from multidc.plugins.checkpoint.handle import CheckpointInfo, SaveHandle
from multidc.plugins.checkpoint.object_store import ObjectStore

_BY_URL: dict[tuple[str, int], Checkpointer] = {}


def _checkpointer(url: str, process_group, storage_options, **kwargs) -> Checkpointer:
    key = (str(url).rstrip("/"), id(process_group))
    ckpt = _BY_URL.get(key)
    if ckpt is None or ckpt.comm.group is None and dist.is_available() and dist.is_initialized():
        ckpt = _BY_URL[key] = Checkpointer(url, process_group=process_group, storage_options=storage_options,
                                           **kwargs)
    return ckpt


def save(url: str, state: dict, *, step: int, process_group=None, async_save: bool = False,
         keep_last_k: int | None = None, storage_options: dict | None = None, extra: dict | None = None
         ) -> SaveHandle:
    """Save ``state`` under ``url`` as checkpoint ``step``; see :class:`Checkpointer`. Collective.

    Reuses one :class:`Checkpointer` per ``(url, process_group)``, so an async save is awaited (and its error
    raised) by the next ``save`` / ``load`` of the same URL, by ``wait(url)``, or at interpreter exit.
    """
    ckpt = _checkpointer(url, process_group, storage_options)
    ckpt.keep_last_k = keep_last_k
    return ckpt.save(state, step=step, async_save=async_save, extra=extra)


def load(url: str, state: dict, which: str | int | CheckpointInfo = "latest", *, process_group=None,
         storage_options: dict | None = None, trusted: bool = False, allow_partial: bool = False
         ) -> CheckpointInfo:
    """Load checkpoint ``which`` (default the newest committed one) under ``url`` into ``state``. Collective."""
    ckpt = _checkpointer(url, process_group, storage_options)
    return ckpt.load(state, which, trusted=trusted, allow_partial=allow_partial)


def wait(url: str, *, process_group=None) -> CheckpointInfo | None:
    """Wait for the pending async save to ``url`` started by :func:`save`; raise its error."""
    ckpt = _BY_URL.get((str(url).rstrip("/"), id(process_group)))
    return ckpt.wait() if ckpt is not None else None


def list_checkpoints(url: str, *, storage_options: dict | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints under ``url``, oldest first. Not collective; half-written ones are not listed."""
    return _committed(ObjectStore(url, storage_options=storage_options))


def latest(url: str, *, storage_options: dict | None = None) -> CheckpointInfo | None:
    """The newest committed checkpoint under ``url``, or ``None``. Not collective."""
    return next(reversed(list_checkpoints(url, storage_options=storage_options)), None)



__all__ = ["latest", "list_checkpoints", "load", "save", "wait"]
