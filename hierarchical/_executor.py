"""A single daemon thread that runs submitted jobs one after another, and stops trusting its groups after a failure.

Hierarchical collectives issue several process-group operations each; every rank must issue them in the same
order. Running every job of a topology on one thread, in submission order, keeps that order identical on all
ranks even when callers (the autograd engine calling DDP hooks, the training loop) submit from several threads.

A job that fails (a WAN timeout, a lost connection) may leave operations issued on some groups and not on
others, so the next collective would pair up wrongly with the peers or wait out another timeout. After the
first failure every queued and later job therefore fails at once with an error that repeats the first one:
a DDP step with several gradient buckets fails within one timeout, not one timeout per bucket.
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
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def failure(self) -> BaseException | None:
        """The first error a job raised, or ``None``; once set, every job fails without running."""
        return self._failure

    def submit(self, fn: Callable[[], object]) -> torch.futures.Future:
        """Queue ``fn``; the returned future holds its result or raises its exception from ``wait()``."""
        future: torch.futures.Future = torch.futures.Future()
        if self._failure is not None:  # fail now: the worker may still be busy with the failed job's clean-up
            future.set_exception(_after(self._failure))
            return future
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
            if self._failure is not None:
                future.set_exception(_after(self._failure))
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller through the future, never dropped
                self._failure = exc
                future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            else:
                future.set_result(result)


def _after(failure: BaseException) -> Exception:
    """The error for a job refused because an earlier one failed: same type where possible, same message."""
    message = (f"not run: an earlier collective on this topology failed and its process groups can no longer be "
               f"trusted; restart the job. The first failure was: {failure}")
    try:
        error = type(failure)(message)
    except Exception:  # an exception type with a different constructor
        error = None
    return error if isinstance(error, Exception) else RuntimeError(message)
