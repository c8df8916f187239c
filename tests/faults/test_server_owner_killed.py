"""A SeaweedFS server started for a test session ends with ``stop()`` and with the process that started it, also when
that process is killed with SIGKILL (an xdist worker killed by a timeout runs no clean-up): nothing of it is left
running."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests._resources import require_weed

pytestmark = pytest.mark.timeout(120)

_OWNER = """
import os, subprocess, sys, time
from multidc.hierarchical.tools.seaweed import SeaweedS3
stopped = SeaweedS3.start(os.path.join(sys.argv[1], "stopped"))
stopped.stop()  # returns once nothing of the server is left
left = subprocess.run(["pgrep", "-s", str(stopped.process.pid)], capture_output=True, text=True).stdout.split()
server = SeaweedS3.start(os.path.join(sys.argv[1], "killed"))
print(server.process.pid, " ".join(left) or "-", flush=True)
time.sleep(300)
"""


def _session(leader: int) -> list[int]:
    found = subprocess.run(["pgrep", "-s", str(leader)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def test_a_server_ends_when_stopped_and_when_the_process_that_started_it_is_killed(tmp_path):
    require_weed()
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    leader = None
    try:
        line = owner.stdout.readline().split()
        leader = int(line[0])
        assert line[1] == "-", f"left running after stop(): {line[1]}"
        assert len(_session(leader)) >= 2, "the guard and the weed server"
        owner.kill()  # SIGKILL: no clean-up runs in the owner
        owner.wait()
        deadline = time.monotonic() + 15.0
        while _session(leader) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _session(leader), f"left running after its owner was killed: {_session(leader)}"
    finally:
        owner.kill()
        if leader is not None:
            subprocess.run(["pkill", "-KILL", "-s", str(leader)], check=False)
