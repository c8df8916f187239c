"""ObjectStore against a real S3 server (SeaweedFS) and the local filesystem: uploads, errors, credentials."""

from __future__ import annotations

import os
import random

import pytest

from multidc.hierarchical.tools.launch import free_port
from multidc.plugins import ObjectStore, ObjectStoreAuthError, ObjectStoreError, ObjectStoreNotFoundError, RetryPolicy
from multidc.plugins.checkpoint.segments import Segments
from tests.conftest import AUTH_KEYS, READONLY_KEYS

pytestmark = pytest.mark.timeout(120)


def test_large_object_goes_up_as_multipart_and_reads_back_byte_exact(s3_server, s3_bucket):
    store = ObjectStore(f"{s3_bucket}/run", storage_options=s3_server.storage_options(), part_size_mb=5)
    data = os.urandom(17 * 2**20 + 123)  # 3 parts of 5 MiB + a short tail folded into the last part
    store.put("a/big.bin", data)
    assert store.size("a/big.bin") == len(data)
    assert store.get("a/big.bin") == data
    ranges = [("a/big.bin", 0, 10), ("a/big.bin", 5 * 2**20 - 3, 5 * 2**20 + 3), ("a/big.bin", 7, 7)]
    assert store.get_ranges(ranges) == [data[:10], data[5 * 2**20 - 3:5 * 2**20 + 3], b""]
    # no multipart upload may be left behind
    uploads = s3_server.filesystem().call_s3("list_multipart_uploads", Bucket=s3_bucket[5:])
    assert not uploads.get("Uploads")


def test_buffers_go_up_as_one_object_without_being_joined(s3_server, s3_bucket, tmp_path):
    # a sync save uploads a shard straight from its tensors: part bounds fall inside buffers and across them
    rng = random.Random(0)
    buffers = [rng.randbytes(n) for n in (3 * 2**20 + 5, 1, 0, 9 * 2**20 + 7, 64, 4 * 2**20)]
    data = b"".join(buffers)
    for url, options in ((f"{s3_bucket}/run", s3_server.storage_options()), (str(tmp_path), None)):
        store = ObjectStore(url, storage_options=options, part_size_mb=5)
        store.put("a/shard", Segments(buffers))
        store.put("a/small", Segments(buffers[1:3]), atomic=True)
        assert store.get("a/shard") == data and store.get("a/small") == b"".join(buffers[1:3]), url


def test_listing_and_deleting_a_tree(s3_server, s3_bucket):
    store = ObjectStore(f"{s3_bucket}/run", storage_options=s3_server.storage_options())
    assert store.list_dirs() == []
    store.put("step_1/data/x", b"1")
    store.put("step_2/COMMIT.json", b"{}", atomic=True)
    assert sorted(store.list_dirs()) == ["step_1", "step_2"]
    store.delete_tree("step_1")
    assert not store.exists("step_1/data/x")
    assert store.exists("step_2/COMMIT.json")


def test_missing_bucket_names_bucket_and_endpoint(s3_server):
    store = ObjectStore("s3://no-such-bucket-x1/run", storage_options=s3_server.storage_options())
    with pytest.raises(ObjectStoreNotFoundError, match="bucket 'no-such-bucket-x1' does not exist") as info:
        store.check_access()
    assert s3_server.endpoint in str(info.value)
    with pytest.raises(ObjectStoreNotFoundError, match="no-such-bucket-x1"):
        store.put("k", b"1")


def test_right_credentials_work_on_an_authenticated_server(s3_auth_server):
    url = s3_auth_server.make_bucket("authok") + "/run"
    store = ObjectStore(url, storage_options=s3_auth_server.storage_options())
    store.check_access()
    store.put("x", b"hello")
    assert store.get("x") == b"hello"


def test_wrong_secret_is_an_auth_error_naming_endpoint_and_bucket_but_not_the_secret(s3_auth_server):
    s3_auth_server.make_bucket("authwrong")
    secret = "this-is-the-wrong-secret-1234"
    options = s3_auth_server.storage_options(key=AUTH_KEYS[0], secret=secret)
    store = ObjectStore("s3://authwrong/run", storage_options=options)
    for operation in (store.check_access, lambda: store.put("x", b"1"), lambda: store.get("x")):
        with pytest.raises(ObjectStoreAuthError) as info:
            operation()
        message = str(info.value)
        assert s3_auth_server.endpoint in message and "authwrong" in message
        assert secret not in message and AUTH_KEYS[1] not in message and secret not in repr(store)
        assert info.value.__cause__ is None  # the botocore error (with request details) is not chained
    assert isinstance(info.value, PermissionError)
    assert s3_auth_server.filesystem().ls("authwrong") == []  # nothing was written


def test_read_only_credentials_cannot_write(s3_auth_server):
    s3_auth_server.make_bucket("authro")
    options = s3_auth_server.storage_options(key=READONLY_KEYS[0], secret=READONLY_KEYS[1])
    store = ObjectStore("s3://authro/run", storage_options=options)
    store.check_access()  # reading the bucket is allowed
    with pytest.raises(ObjectStoreAuthError, match="access denied"):
        store.put("x", b"1")


def test_unreachable_endpoint_is_retried_then_reported_with_the_attempt_count():
    port = free_port()  # nothing listens there
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "anon": True, "skip_instance_cache": True,
               "config_kwargs": {"retries": {"max_attempts": 1}}}
    store = ObjectStore("s3://bucket/run", storage_options=options,
                        retry=RetryPolicy(attempts=3, initial_backoff_s=0.01))
    with pytest.raises(ObjectStoreError, match=r"after 3 attempts") as info:
        store.put("k", b"1")
    assert f"127.0.0.1:{port}" in str(info.value)


def test_local_atomic_put_leaves_no_temporary_file(tmp_path):
    store = ObjectStore(str(tmp_path / "root"))
    store.check_access()
    store.put("c/COMMIT.json", b"{}", atomic=True)
    assert os.listdir(tmp_path / "root" / "c") == ["COMMIT.json"]
    assert ObjectStore(f"file://{tmp_path}/root").get("c/COMMIT.json") == b"{}"


@pytest.mark.parametrize("url, kwargs, match", [
    ("", {}, "URL is empty"),
    ("s3://", {}, "names no bucket"),
    ("/tmp/x", {"part_size_mb": 1}, "below the S3 minimum"),
    ("/tmp/x", {"max_concurrency": 0}, "max_concurrency"),
])
def test_bad_store_arguments_are_value_errors(url, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ObjectStore(url, **kwargs)


def test_bad_retry_policy_is_a_value_error():
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
