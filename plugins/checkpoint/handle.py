"""What a checkpoint save ends with (``SaveHandle``, ``CheckpointInfo``, ``CheckpointSaveError``), and the async
saves nobody has waited for yet."""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass

from multidc.hierarchical._compat import before_process_groups_end

_log = logging.getLogger("multidc.plugins.checkpoint")  # where users look for checkpoint messages


class CheckpointSaveError(RuntimeError):
    """A save did not commit; the message says which ranks failed and why. The previous checkpoint is intact."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint. ``world_size`` / ``created_unix`` are ``None`` when only listed, not read."""

    url: str
    name: str
    step: int
    world_size: int | None = None
    created_unix: float | None = None


class SaveHandle:
    """The outcome of one ``save``: finished already (sync) or still uploading (async)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._raised = False  # the error reached the caller through ``wait``: the Checkpointer won't raise it again

    def _finish(self, info: CheckpointInfo | None, error: BaseException | None) -> None:
        self._info, self._error = info, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until committed; return its info, or raise the save's error (every rank raises)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint upload still running after {timeout}s")
        if self._error is not None:
            self._raised = True
            UNWAITED.pop(self, None)
            raise self._error
        return self._info


# Async saves nobody has waited for yet (a successful one leaves at once): handle -> where it writes.
UNWAITED: dict[SaveHandle, str] = {}


@atexit.register
def _wait_at_exit() -> None:
    """An interpreter exiting with an upload in flight finishes it; a failed async save whose error nobody
    received (no ``wait``, ``close`` or later ``save``) is logged as an error on ``multidc.plugins.checkpoint``."""
    for handle, where in list(UNWAITED.items()):
        handle._done.wait()
        if handle._error is not None and not handle._raised:
            _log.error("async checkpoint save to %s failed, and the interpreter exited before anything waited for "
                       "it (call Checkpointer.wait() or close() to have it raised): %s: %s", where,
                       type(handle._error).__name__, handle._error)
    UNWAITED.clear()


# An upload in flight at exit still needs its process groups: the handler that ends them finishes uploads first.
before_process_groups_end(_wait_at_exit)
