"""Secrets never leak: a real subprocess saves and loads checkpoints (plain and through Lightning) on an S3 server
with authentication, every logger at DEBUG; its stdout, stderr (logs, tracebacks), every object it stored (commit
records, shards, Lightning's hyper-parameters) and every local file it wrote are searched for the secret keys.
Wrong credentials give an error that names the endpoint and the bucket, not the secret."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import AUTH_KEYS

WRONG_SECRET = "mdc-wrong-secret-7c1e90ab"
ROOT = Path(__file__).resolve().parents[2]


def _run(server, bucket: str, outdir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"AWS_ACCESS_KEY_ID": AUTH_KEYS[0], "AWS_SECRET_ACCESS_KEY": AUTH_KEYS[1], "MDC_TEST_KEY": AUTH_KEYS[0],
            "MDC_TEST_SECRET": AUTH_KEYS[1], "MDC_TEST_WRONG_SECRET": WRONG_SECRET, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT), "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": server.endpoint}  # Lightning lists default_root_dir with its own fsspec calls
    return subprocess.run([sys.executable, "-m", "tests.plugins._credentials_job", server.endpoint, bucket,
                           str(outdir)], capture_output=True, text=True, env=env, cwd=outdir, timeout=240)


def _stored_objects(server, bucket: str) -> dict[str, bytes]:
    fs = server.filesystem()
    return {path: fs.cat_file(path) for path in fs.find(bucket)}


def test_secrets_appear_nowhere_and_wrong_credentials_name_endpoint_and_bucket(s3_auth_server, tmp_path):
    bucket = s3_auth_server.make_bucket("credentials").removeprefix("s3://")
    proc = _run(s3_auth_server, bucket, tmp_path)
    out, err = proc.stdout, proc.stderr
    # The run did what it should: both parts saved and loaded, DEBUG logging was on, the last part failed.
    assert "loaded CheckpointInfo(" in out and "lightning saved s3://" in out, out + err[-3000:]
    assert "DEBUG:botocore" in err and "DEBUG:s3fs" in err, err[-2000:]
    assert proc.returncode == 1
    objects = _stored_objects(s3_auth_server, bucket)
    assert any(p.endswith("COMMIT.json") for p in objects) and any("lightning" in p for p in objects), list(objects)
    local = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert any(p.endswith("hparams.yaml") for p in local), list(local)
    for secret in (AUTH_KEYS[1], WRONG_SECRET):
        assert secret not in out and secret not in err, "a secret reached stdout/stderr"
        for where, data in {**objects, **local}.items():
            assert secret.encode() not in data, f"a secret was stored in {where}"
    # Wrong credentials: the error a user sees names the endpoint and the bucket, and how to fix it.
    line = next(line for line in out.splitlines() if line.startswith("WRONG-CREDENTIALS"))
    assert "ObjectStoreAuthError" in line and s3_auth_server.endpoint in line and f"bucket {bucket}" in line, line
    assert "AWS_SECRET_ACCESS_KEY" in line  # says where credentials come from, not what they are
    assert "multidc.plugins.checkpoint.object_store.ObjectStoreAuthError" in err.splitlines()[-1]
    assert not any("/wrong/" in p for p in objects)  # nothing written with the refused credentials
