"""Whether a rank reached interpreter exit with process groups still alive (test scripts' probe).

Import it before ``multidc``: atexit runs handlers last-registered first, so this probe runs after the package's
handler that ends the process groups (``multidc.hierarchical._compat.destroy_process_groups_at_exit``), and records
what interpreter finalization would have met. Without that handler, gloo aborts a rank now and then at exit
(SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291).
"""

from __future__ import annotations

import atexit
import json
import os

import torch.distributed as dist

_PATH: list[str] = []


def report_to(path: str) -> None:
    """At exit, write ``{"groups_alive_at_exit": bool, "gloo_threads_at_exit": int}`` to ``path``."""
    _PATH[:] = [path]


def _gloo_threads() -> int:
    """Threads of gloo's transport and work loops still running in this process."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


@atexit.register
def _probe() -> None:
    if _PATH:
        with open(_PATH[0], "w") as f:
            json.dump({"groups_alive_at_exit": dist.is_available() and dist.is_initialized(),
                       "gloo_threads_at_exit": _gloo_threads()}, f)
