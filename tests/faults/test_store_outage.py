"""Object-store outage during a checkpoint upload, against a dedicated SeaweedFS server that the tests crash
(SIGKILL) once a multipart upload has parts stored. Restarted within the retry budget, the save retries with
growing backoff and commits the right bytes; left down, it fails after the budget with an error naming the
endpoint and the bucket. A partial checkpoint is never committed: ``latest`` stays the previous one."""

from __future__ import annotations

import logging
import re
import time
import uuid

import pytest
import torch

from multidc.hierarchical.tools.seaweed import SeaweedS3
from multidc.plugins import Checkpointer, CheckpointSaveError, RetryPolicy
from tests._resources import require_weed
from tests.faults.seaweed import Outage, kill_when_parts_uploaded

STATE_MB = 40  # 8 parts of 5 MiB sent one at a time: the crash lands between parts
LOGGER = "multidc.plugins.object_store"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A SeaweedFS server of this module's own: the tests kill and restart it."""
    require_weed()
    server = SeaweedS3.start(tmp_path_factory.mktemp("seaweed-outage"))
    yield server
    server.stop()


@pytest.fixture
def bucket(server) -> str:
    return server.make_bucket(f"outage-{uuid.uuid4().hex[:8]}").removeprefix("s3://")


def _checkpointer(server: SeaweedS3, bucket: str, retry: RetryPolicy) -> Checkpointer:
    # botocore's own retries off: the budget under test is the RetryPolicy's alone.
    options = server.storage_options() | {"config_kwargs": {"retries": {"max_attempts": 1}}}
    return Checkpointer(f"s3://{bucket}/run", storage_options=options, retry=retry, part_size_mb=5,
                        max_concurrency=1)


def _state(step: int) -> dict:
    values = torch.randn(STATE_MB << 18, generator=torch.Generator().manual_seed(step))
    return {"w": values, "trainer": {"step": step}}


def _loaded(ckpt: Checkpointer) -> dict:
    state = {"w": torch.zeros(STATE_MB << 18), "trainer": {"step": -1}}
    ckpt.load(state)
    return state


def _retry_delays(caplog) -> list[float]:
    return [float(m.group(1)) for r in caplog.records if r.name == LOGGER
            for m in [re.search(r"retrying in ([\d.]+) s", r.getMessage())] if m]


def test_store_crash_mid_upload_is_retried_with_backoff_and_the_save_commits(server, bucket, caplog):
    outage = Outage(server)
    ckpt = _checkpointer(server, bucket, RetryPolicy(attempts=12, initial_backoff_s=0.5, max_backoff_s=4))
    ckpt.save(_state(1), step=1)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    watcher = kill_when_parts_uploaded(server, outage, bucket)
    handle = ckpt.save(_state(2), step=2, async_save=True)
    watcher.join(60)
    assert watcher.result >= 1, "the server was not killed in the middle of the upload"
    time.sleep(1.0)
    outage.restart()
    assert handle.wait(120).step == 2
    delays = _retry_delays(caplog)
    assert delays, "no retry was logged"
    assert all(b > a for a, b in zip(delays[:3], delays[1:3])), delays  # backoff grows (jitter +-25% < 2x)
    assert "Could not connect" in caplog.text and f"bucket {bucket}" in caplog.text
    assert ckpt.latest().step == 2
    state = _loaded(ckpt)
    assert state["trainer"]["step"] == 2 and torch.equal(state["w"], _state(2)["w"])
    ckpt.close()


def test_store_that_stays_down_fails_after_the_retry_budget_and_commits_nothing(server, bucket, caplog):
    outage = Outage(server)
    retry = RetryPolicy(attempts=4, initial_backoff_s=0.2, max_backoff_s=1)  # sleeps 0.2 + 0.4 + 0.8 (+-25%)
    ckpt = _checkpointer(server, bucket, retry)
    ckpt.save(_state(1), step=1)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    watcher = kill_when_parts_uploaded(server, outage, bucket)
    handle = ckpt.save(_state(2), step=2, async_save=True)
    watcher.join(60)
    assert watcher.result >= 1, "the server was not killed in the middle of the upload"
    started = time.monotonic()
    with pytest.raises(CheckpointSaveError) as info:
        handle.wait(60)
    assert time.monotonic() - started < 1.75 * 1.25 + 10  # the budget plus slack for a loaded machine
    message = str(info.value)
    assert "giving up on s3://" in message and "after 4 attempts" in message, message
    assert f"endpoint {server.endpoint}" in message and f"bucket {bucket}" in message, message
    assert len(_retry_delays(caplog)) >= 3
    outage.restart()
    assert [c.step for c in ckpt.list()] == [1]  # step 2 never became visible as committed
    assert not server.filesystem().exists(f"{bucket}/run/step_0000000002/COMMIT.json")
    assert _loaded(ckpt)["trainer"]["step"] == 1
    ckpt.save(_state(3), step=3)  # the next save works and leaves no half-written folder behind
    assert [c.step for c in ckpt.list()] == [1, 3]
    assert not server.filesystem().exists(f"{bucket}/run/step_0000000002")
    ckpt.close()
