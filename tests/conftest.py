"""Session-wide fixtures: real SeaweedFS S3 servers (one anonymous, one with S3 authentication)."""

from __future__ import annotations

import uuid

import pytest

from multidc.hierarchical.tools.seaweed import SeaweedS3
from tests._resources import require_weed

AUTH_KEYS = ("MDCTESTACCESSKEY", "mdc-test-secret-9f2c41d7")
READONLY_KEYS = ("MDCREADONLYKEY", "mdc-readonly-secret-51b0e2aa")


def _start(tmp_path_factory, name: str, **kwargs) -> SeaweedS3:
    require_weed()
    return SeaweedS3.start(tmp_path_factory.mktemp(name), **kwargs)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 gateway on loopback that accepts anonymous requests."""
    server = _start(tmp_path_factory, "seaweed")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_auth_server(tmp_path_factory):
    """A SeaweedFS S3 gateway on loopback that only accepts ``AUTH_KEYS`` (and ``READONLY_KEYS``: no writes)."""
    server = _start(tmp_path_factory, "seaweed-auth", auth=AUTH_KEYS, readonly=READONLY_KEYS)
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on ``s3_server``; returns ``s3://<name>``."""
    return s3_server.make_bucket(f"t-{uuid.uuid4().hex[:12]}")
