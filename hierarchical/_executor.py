"""A single daemon thread that runs submitted jobs one after another.

Hierarchical collectives issue several process-group operations each; every rank must issue them in the same
order. Running every job of a topology on one thread, in submission order, keeps that order identical on all
ranks even when callers (the autograd engine calling DDP hooks, the training loop) submit from several threads.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

_STOP = object()


class SerialExecutor:
    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> torch.futures.Future:
        """Queue ``fn``; the returned future holds its result or raises its exception from ``wait()``."""
        future: torch.futures.Future = torch.futures.Future()
        self._jobs.put((fn, future))
        return future

    def shutdown(self) -> None:
        """Finish queued jobs, then stop the thread."""
        self._jobs.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, future = job
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller through the future, never dropped
                future.set_exception(exc)
            else:
                future.set_result(result)
