"""Run a command for as long as a given process lives: ``python -m ..._owned <owner pid> <command...>``.

The invariant it protects: a server started for a test session (SeaweedFS) never outlives that session, also when the
session's process is killed with SIGKILL and runs no clean-up. The server sits in its own session (so a signal to the
test's process group does not reach it); this guard, its parent in that session, checks once a second whether the
owner (the pid it was given: the process that started it, so an owner already gone when the guard starts counts) is
still its parent, and when it is not, stops the command and exits. SIGTERM or SIGINT to the guard stops the command
too, and the guard exits only once the command has: a caller that waits for the guard waits for the server. Stopping
is SIGTERM, then SIGKILL after 2 s. Exits with the command's status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv: list[str]) -> int:
    owner, command = int(argv[0]), argv[1:]
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    process = subprocess.Popen(command)
    while process.poll() is None:
        if stopping or os.getppid() != owner:  # asked to stop, or reparented: the owner is gone
            _stop(process)
            break
        time.sleep(0.2 if stopping else 1.0)
    return process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
