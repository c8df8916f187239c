"""Run a command for as long as the process that started it lives: ``python -m ... _owned <command...>``.

The invariant it protects: a server started for a test session (SeaweedFS) never outlives that session, also when the
session's process is killed with SIGKILL and runs no clean-up. The server sits in its own session (so a signal to the
test's process group does not reach it); this guard, its parent in that session, polls once a second whether its own
parent (the process that started it) is still there, and when it is not, terminates the command (SIGKILL after 2 s)
and exits. A signal to the guard's process group stops both, as before. Exits with the command's status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    owner = os.getppid()
    process = subprocess.Popen(argv)
    while process.poll() is None:
        if os.getppid() != owner:  # reparented: the owner is gone (robust against its pid being reused)
            process.terminate()
            try:
                process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                process.kill()
            break
        time.sleep(1.0)
    return process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
