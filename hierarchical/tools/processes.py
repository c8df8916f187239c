"""Launch a process tree (a launcher and every rank it starts) and kill all of it, wherever its ranks went.

``torchrun`` (and ``accelerate launch``, which runs it) may put ranks in sessions and process groups of their own,
so killing the launcher's process group misses them, and a rank whose launcher died is re-parented to init.
Every process of a tree therefore carries one environment variable, ``MULTIDC_PROCESS_TREE=<token>``, which
children inherit; ``ProcessTree.kill`` finds them by it in ``/proc`` and kills them until none is left.

Used by the tests that start launchers::

    with ProcessTree([accelerate, "launch", script], env=env) as tree:
        code, output = tree.wait(timeout=300)   # on timeout: every process of the tree killed, then TimeoutError
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

TOKEN_VAR = "MULTIDC_PROCESS_TREE"


class ProcessTree:
    """``argv`` started in a new session with ``env`` (default: this process's) plus a tree token.

    Args:
        argv: the command.
        env: its whole environment (the token is added).
        **popen: more ``subprocess.Popen`` arguments; by default stdout and stderr are captured together as text.
    """

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None, **popen) -> None:
        self.token = uuid.uuid4().hex
        env = {**(os.environ if env is None else env), TOKEN_VAR: self.token}
        popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
        self.process = subprocess.Popen(argv, env=env, start_new_session=True, **popen)
        self.survivors: list[int] = []
        """Pids of the tree still alive when ``wait`` saw the launcher end (before it killed them)."""

    def wait(self, timeout: float) -> tuple[int, str]:
        """Wait up to ``timeout`` seconds for the launcher; then kill whatever of the tree is left (a rank that
        outlived its launcher included). Returns ``(exit code, output)``.

        Raises:
            TimeoutError: the launcher ran past ``timeout``; the message ends with its last output.
        """
        try:
            output, _ = self.process.communicate(timeout=timeout)
            self.survivors = self.members()  # ranks still running after their launcher ended
        except subprocess.TimeoutExpired:
            self.kill()
            output, _ = self.process.communicate()
            raise TimeoutError(f"{self.process.args[:3]}... ran past {timeout:g} s; killed. Its output ends:\n"
                               f"{(output or '')[-4000:]}") from None
        finally:
            self.kill()
        return self.process.returncode, output or ""

    def members(self) -> list[int]:
        """Pids of the live processes carrying this tree's token (the launcher included while it runs)."""
        return find_tree(self.token)

    def kill(self, deadline_s: float = 10.0) -> None:
        """SIGKILL the launcher's process group and every process of the tree, until none is left.

        Raises:
            RuntimeError: processes of the tree still alive after ``deadline_s`` (unkillable: stuck in the kernel).
        """
        if self.process.returncode is None:  # once reaped, its pid (and group id) may belong to someone else
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + deadline_s
        while pids := self.members():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} of tree {self.token} survive SIGKILL for {deadline_s:g} s.")
            time.sleep(0.05)
        if self.process.poll() is None:
            self.process.wait()

    def __enter__(self) -> ProcessTree:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def find_tree(token: str) -> list[int]:
    """Pids of live processes (zombies excluded) whose environment has ``MULTIDC_PROCESS_TREE=token``."""
    marker = f"{TOKEN_VAR}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":  # exited, waiting for its parent to reap it
                    continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(int(name))
    return found

