"""Names that moved between the torch releases we support (``torch>=2.7``), and workarounds for torch defects."""

from __future__ import annotations

import atexit
import gc

import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecated the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_EXIT_HANDLER_REGISTERED = False
_BEFORE_EXIT_DESTROY: list = []  # called first by the handler (e.g. finish checkpoint uploads, which need groups)


def destroy_process_groups_at_exit() -> None:
    """End every process group at interpreter exit, while the interpreter is still alive (idempotent).

    torch leaves undestroyed groups to interpreter finalization, where gloo's worker threads can still hold finished
    work whose tensors need the GIL: the process then aborts now and then ("terminate called without an active
    exception", SIGABRT; pytorch/pytorch#179291, abandoned upstream). Lightning registers the same handler for NCCL
    only; the strategies and the accelerator of this package register it for every backend. A script that calls
    ``destroy_process_group()`` itself makes it a no-op. Garbage (a finished run's groups, DDP reducers) is
    collected first, so the groups it holds end with the others.
    """
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(_destroy_process_groups)
        _EXIT_HANDLER_REGISTERED = True


def before_process_groups_end(fn) -> None:
    """Run ``fn()`` in the exit handler before it ends the process groups (once per ``fn``)."""
    if fn not in _BEFORE_EXIT_DESTROY:
        _BEFORE_EXIT_DESTROY.append(fn)


def _destroy_process_groups() -> None:
    errors = []
    for fn in _BEFORE_EXIT_DESTROY:  # each runs, whatever another raised
        try:
            fn()
        except Exception as exc:  # raised below, once the groups ended
            errors.append(exc)
    gc.collect()  # groups only garbage still holds end now, while their worker threads can stop cleanly
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if errors:
        raise errors[0]
