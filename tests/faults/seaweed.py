"""Crash and restart a SeaweedFS server (``multidc.hierarchical.tools.seaweed.SeaweedS3``) on the same ports and
data, for outage tests."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from multidc.hierarchical.tools.seaweed import SeaweedS3


class Outage:
    """Kill ``server`` (SIGKILL: a crash, connections refused at once) and later restart it unchanged.

    The restart reuses the exact command line (same ports, same data directory) with a short raft election
    timeout, so the single master elects itself in about a second instead of ten.
    """

    def __init__(self, server: SeaweedS3) -> None:
        self.server = server
        with open(f"/proc/{server.process.pid}/cmdline", "rb") as f:
            self.argv = [arg.decode() for arg in f.read().split(b"\0") if arg]
        if not any(arg.startswith("-master.electionTimeout") for arg in self.argv):
            self.argv.append("-master.electionTimeout=1s")

    def kill(self) -> None:
        process = self.server.process
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def restart(self, timeout: float = 60.0) -> float:
        """Start the server again and wait until it serves a bucket round trip; returns the seconds it took."""
        started = time.monotonic()
        with open(self.server.log_path, "ab") as log:
            self.server.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                                   cwd=self.server.workdir, start_new_session=True)
        self.server._wait_ready(timeout)
        return time.monotonic() - started


def kill_when_parts_uploaded(server: SeaweedS3, outage: Outage, bucket: str, *, parts: int = 1,
                             timeout: float = 30.0) -> threading.Thread:
    """In a thread: as soon as a multipart upload in ``bucket`` has ``parts`` parts stored, kill the server.

    The thread's ``result`` attribute says how many parts were stored at the kill (0: it timed out, no kill).
    """
    def watch():
        fs = server.filesystem()
        deadline = time.monotonic() + timeout
        thread.result = 0
        while time.monotonic() < deadline:
            uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
            for upload in uploads:
                listed = fs.call_s3("list_parts", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                if len(listed.get("Parts", [])) >= parts:
                    outage.kill()
                    thread.result = len(listed["Parts"])
                    return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, name="kill-seaweed-mid-upload", daemon=True)
    thread.start()
    return thread
