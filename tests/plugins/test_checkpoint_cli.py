"""``multidc ckpt ls|verify|rm`` (and ``python -m multidc.plugins.checkpoint``): against a SeaweedFS server with S3
authentication, credentials from the standard AWS environment variables only.

One run is a real ``python -m`` subprocess (the module entry point, credentials read by a fresh interpreter); the
others call the same ``cli.main`` in this process with the same environment variables and argv, and capture its
stdout, stderr and exit status (an argparse refusal's ``SystemExit`` included). s3fs caches one filesystem per set
of constructor arguments, credentials read from the environment at creation: the cache is cleared before each call,
so each call reads the credentials of its own environment, as a new process would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multidc.plugins import Checkpointer, ObjectStore
from multidc.plugins.checkpoint import cli
from multidc.plugins.checkpoint.verify import verify
from tests._cli import run_cli
from tests.conftest import AUTH_KEYS

ROOT = Path(__file__).resolve().parents[2]
WRONG_SECRET = "mdc-cli-wrong-secret-3b9d"


def _aws_env(server, secret: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": AUTH_KEYS[0], "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": server.endpoint}


def _cli_subprocess(server, *args: str, secret: str = AUTH_KEYS[1],
                    command: tuple[str, ...] = ("multidc", "ckpt")) -> subprocess.CompletedProcess:
    """The installed ``multidc ckpt`` console script (default; ``command`` may name ``python -m ...``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTHONPATH"))} | _aws_env(server, secret)
    if command[0] == "multidc":  # as installed: the package's metadata declares `ckpt`
        argv = [str(Path(sys.executable).with_name("multidc")), *command[1:]]
    else:
        argv, env["PYTHONPATH"] = [sys.executable, *command], str(ROOT)
    return subprocess.run([*argv, *args], capture_output=True, text=True, env=env, timeout=120)


def _main(args: tuple[str, ...]) -> subprocess.CompletedProcess:
    return run_cli(cli.main, args, prog="multidc.plugins.checkpoint")


def _clear_s3fs_cache() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def _cli(server, *args: str, secret: str = AUTH_KEYS[1]) -> subprocess.CompletedProcess:
    """The CLI with only the AWS environment variables for credentials and endpoint (none of this process's)."""
    with pytest.MonkeyPatch.context() as env:
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            env.delenv(name)
        for name, value in _aws_env(server, secret).items():
            env.setenv(name, value)
        _clear_s3fs_cache()
        try:
            return _main(args)
        finally:
            _clear_s3fs_cache()  # no filesystem holding these credentials outlives the call


def _state(step: int) -> dict:
    return {"w": torch.arange(300_000, dtype=torch.float32) + step, "b": torch.ones(7), "loop": {"step": step}}


def test_ls_verify_and_rm_report_and_exit_as_documented(s3_auth_server):
    url = s3_auth_server.make_bucket("cli") + "/run"
    options = s3_auth_server.storage_options()
    with Checkpointer(url, storage_options=options) as ckpt:
        for step in (10, 20):
            ckpt.save(_state(step), step=step)

    listed = _cli_subprocess(s3_auth_server, "ls", url, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["step"] for r in rows] == [10, 20] and all(r["world_size"] == 1 and r["bytes"] > 1_200_000 for r in rows)
    table = _cli(s3_auth_server, "ls", url)
    assert table.returncode == 0 and "1 ranks, 1 shards" in table.stdout and "        20" in table.stdout
    module = _cli_subprocess(s3_auth_server, "ls", url, command=("-m", "multidc.plugins.checkpoint"))
    assert module.returncode == 0 and module.stdout == table.stdout, module.stderr  # the module form, the same

    checked = _cli(s3_auth_server, "verify", url, "--all", "--slice-mb", "0.1")  # items span many slices
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("OK") == 2

    store = ObjectStore(url, storage_options=options)
    key = "step_0000000020/data/rank00000.distcp"
    data = bytearray(store.get(key))
    data[500_000] ^= 0x01  # inside "w"
    store.put(key, bytes(data))
    corrupt = _cli(s3_auth_server, "verify", url)  # latest: step 20
    assert corrupt.returncode == 1, corrupt.stdout + corrupt.stderr
    assert "CORRUPT" in corrupt.stdout and "rank00000.distcp" in corrupt.stdout and "holding w" in corrupt.stdout
    assert "bytes [0, 1200000)" in corrupt.stdout
    assert _cli(s3_auth_server, "verify", url, "--step", "10").returncode == 0

    missing = _cli(s3_auth_server, "verify", url, "--step", "99")
    assert missing.returncode == 2 and "step_0000000099" in missing.stderr

    refused = _cli(s3_auth_server, "ls", url, secret=WRONG_SECRET)
    assert refused.returncode == 3
    assert s3_auth_server.endpoint in refused.stderr and "cli" in refused.stderr
    assert WRONG_SECRET not in refused.stderr + refused.stdout and AUTH_KEYS[1] not in refused.stderr

    assert _cli(s3_auth_server, "rm", url, "--step", "20").returncode == 0
    assert [json.loads(line)["step"] for line in _cli(s3_auth_server, "ls", url, "--json").stdout.splitlines()] == [10]
    assert _cli(s3_auth_server, "rm", url, "--step", "20").returncode == 2
    assert _cli(s3_auth_server, "rm", url, "--all").returncode == 0
    assert "no committed checkpoint" in _cli(s3_auth_server, "ls", url).stdout
    assert _cli(s3_auth_server, "rm", url).returncode == 2  # neither --step nor --all: refused


def test_verify_reads_bounded_slices_and_combines_their_crcs(tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    Checkpointer(url).save(_state(1), step=1)
    store = ObjectStore(url)
    reads = []
    original = ObjectStore.read_into

    def recording(self, key, start, out, **kwargs):
        reads.append(len(out))
        return original(self, key, start, out, **kwargs)

    monkeypatch.setattr(ObjectStore, "read_into", recording)
    verdict = verify(store, "step_0000000001", slice_bytes=4096, concurrency=4)
    assert verdict.problems == [] and max(reads) <= 4096 and sum(reads) == verdict.bytes_read > 1_200_000
    path = tmp_path / "run" / "step_0000000001" / "data" / "rank00000.distcp"
    data = bytearray(path.read_bytes())
    data[700_000] ^= 0x80
    path.write_bytes(bytes(data))
    problems = verify(store, "step_0000000001", slice_bytes=4096).problems
    assert len(problems) == 1 and "holding w" in problems[0]


@pytest.mark.parametrize("args", [["ls"], ["verify", "--all"]])
def test_an_empty_or_missing_root_is_a_clear_message(tmp_path, args):
    proc = _run_cli(args[0], str(tmp_path / "none"), *args[1:])
    assert proc.returncode == (0 if args == ["ls"] else 2), proc.stderr
    assert "no committed checkpoint" in proc.stdout + proc.stderr


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return _main(args)


def _with_save_in_flight(tmp_path) -> tuple[str, Path]:
    """A committed checkpoint of step 1 and a folder of step 2 without commit record (a save still uploading)."""
    url = str(tmp_path / "run")
    Checkpointer(url).save(_state(1), step=1)
    in_flight = tmp_path / "run" / "step_0000000002" / "data"
    in_flight.mkdir(parents=True)
    (in_flight / "rank00000.distcp").write_bytes(b"shard being uploaded")
    return url, in_flight


def test_rm_all_deletes_committed_checkpoints_only_unless_told_to_include_uncommitted(tmp_path):
    url, in_flight = _with_save_in_flight(tmp_path)
    removed = _run_cli("rm", url, "--all")
    assert removed.returncode == 0, removed.stderr
    assert not (tmp_path / "run" / "step_0000000001").exists() and in_flight.exists()
    assert _run_cli("rm", url, "--all", "--include-uncommitted").returncode == 0
    assert not in_flight.exists()


def test_rm_step_refuses_an_uncommitted_folder_with_the_flag_to_use(tmp_path):
    url, in_flight = _with_save_in_flight(tmp_path)
    refused = _run_cli("rm", url, "--step", "2")
    assert refused.returncode == 2 and "not committed" in refused.stderr
    assert "--include-uncommitted" in refused.stderr and in_flight.exists()
    assert _run_cli("rm", url, "--step", "2", "--include-uncommitted").returncode == 0
    assert not in_flight.exists()


@pytest.mark.parametrize("args", [["ls"], ["verify", "--all"]])
def test_ls_and_verify_never_create_a_mistyped_local_root(tmp_path, args):
    root = tmp_path / "mistyped"
    proc = _run_cli(args[0], str(root), *args[1:])
    assert proc.returncode in (0, 2), proc.stderr
    assert not root.exists()


def test_an_unexpected_error_exits_4_with_one_line_not_1_which_means_corrupt(tmp_path, monkeypatch, capsys):
    from multidc.plugins.checkpoint import cli, retention

    Checkpointer(str(tmp_path / "run")).save(_state(1), step=1)

    def broken(store):
        raise TypeError("injected bug")

    monkeypatch.setattr(retention, "committed", broken)
    assert cli.main(["ls", str(tmp_path / "run")]) == 4
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "unexpected TypeError: injected bug" in err


def test_the_multidc_command_runs_ckpt_as_its_own_subcommand(tmp_path, capsys):
    from multidc.hierarchical.tools import cli as multidc_cli

    with pytest.raises(SystemExit) as listed:
        multidc_cli.main(["--help"])
    assert listed.value.code == 0 and "ckpt" in capsys.readouterr().out  # declared by the plugins, listed
    assert multidc_cli.main(["ckpt", "ls", str(tmp_path / "none")]) == 0
    assert "no committed checkpoint under" in capsys.readouterr().out
    with Checkpointer(str(tmp_path / "run")) as ckpt:
        ckpt.save(_state(3), step=3)
    assert multidc_cli.main(["ckpt", "verify", str(tmp_path / "run")]) == 0
    assert multidc_cli.main(["ckpt", "rm", str(tmp_path / "run"), "--step", "3"]) == 0
    assert multidc_cli.main(["ckpt", "verify", str(tmp_path / "run")]) == 2  # nothing left: the documented 2
