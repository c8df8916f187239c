"""Checkpoint collectives wait for unresponsive peers only up to ``timeout_s``, never for slow but healthy work.

Ranks exchange a heartbeat while uploading, downloading and committing (``Comm.alive``), so a checkpoint group can
use the WAN timeout: an upload slower than the timeout still commits, while a peer that stops answering mid-upload
fails every rank within the timeout plus one beat, with an error naming the sites.
"""

from __future__ import annotations

import uuid

import pytest

from multidc.hierarchical.tools.ranks import run_ranks
from tests._batched import run_cases

TIMEOUT_S = 2.0
SLOW_S = 3 * TIMEOUT_S  # longer than the timeout: without heartbeats the waiting rank would time out


def _slow_on(rank_to_slow: int, rank: int, monkeypatch_target, name: str, match: str) -> None:
    """Make ``monkeypatch_target.name`` sleep SLOW_S on ``rank_to_slow`` when its key contains ``match``."""
    import time

    original = getattr(monkeypatch_target, name)

    def slow(self, key, *args, **kwargs):
        keys = key if isinstance(key, str) else " ".join(str(k) for k in key)
        if rank == rank_to_slow and match in keys:
            time.sleep(SLOW_S)
        return original(self, key, *args, **kwargs)

    setattr(monkeypatch_target, name, slow)


def _slow_upload_commit_and_download(rank, world, url):
    import time

    import torch

    from multidc.plugins import Checkpointer, ObjectStore

    _slow_on(1, rank, ObjectStore, "put", ".distcp")  # rank 1's shard upload
    _slow_on(0, rank, ObjectStore, "put", "COMMIT.json")  # the commit, which every other rank waits for
    _slow_on(1, rank, ObjectStore, "read_into", ".distcp")  # rank 1's download during load
    weights = torch.arange(4096, dtype=torch.float32) + rank * 0  # replicated: striped across both ranks
    ckpt = Checkpointer(url, timeout_s=TIMEOUT_S, stripe_min_mb=0)
    started = time.monotonic()
    ckpt.save({"w": weights, "loop": {"step": 7}}, step=7)
    saved_s = time.monotonic() - started
    target = {"w": torch.zeros_like(weights), "loop": {"step": 0}}
    ckpt.load(target)
    ckpt.close()
    return saved_s, torch.equal(target["w"], weights), target["loop"]["step"]


def test_uploads_commits_and_downloads_slower_than_the_timeout_still_succeed(tmp_path):
    results = run_ranks(_slow_upload_commit_and_download, 2, str(tmp_path / "ckpt"), timeout=120)
    for saved_s, equal, step in results:
        assert saved_s >= 2 * SLOW_S - 1, saved_s  # both slow parts really happened inside the save
        assert equal and step == 7


def _peer_stops_mid_transfer(rank, world, url, phase, sites):
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist

    from multidc.hierarchical import Topology, WanConfig, WanError
    from multidc.plugins import Checkpointer, ObjectStore

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if sites == 2:  # site 0: rank 0; site 1: the others
        topology = Topology.build(site=min(rank, 1), wan=WanConfig(timeout_s=TIMEOUT_S))
        ckpt = Checkpointer(url, topology=topology, stripe_min_mb=0)  # timeout: the topology's WanConfig.timeout_s
    else:
        ckpt = Checkpointer(url, timeout_s=TIMEOUT_S, stripe_min_mb=0)
    if phase == "download":
        ckpt.save({"w": torch.ones(4096)}, step=1)
    name = "put" if phase == "upload" else "read_into"
    original = getattr(ObjectStore, name)

    stopped_once = []

    def stop_here(self, *args, **kwargs):
        if rank == 1 and not stopped_once:  # once: loads GET pieces from several threads
            stopped_once.append(True)
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, heartbeat included: a cut link / hung host
        return original(self, *args, **kwargs)

    setattr(ObjectStore, name, stop_here)
    started = time.monotonic()
    try:
        if phase == "upload":
            ckpt.save({"w": torch.ones(4096)}, step=2)
        else:
            ckpt.load({"w": torch.zeros(4096)})
        outcome = "no error"
    except (WanError if sites == 2 else RuntimeError) as exc:  # noqa: B030 - the expected class depends on the case
        outcome = str(exc)
    finally:
        if rank == 0:
            os.kill(pids[1], signal.SIGCONT)  # rank 1 resumes, finds the others gone and fails too
    seconds = time.monotonic() - started
    try:  # the group is broken: a retry must fail at once, not hang or race the abandoned worker
        ckpt.save({"w": torch.ones(4096)}, step=3)
        again = "no error"
    except RuntimeError as exc:
        again = str(exc)
    latest = ckpt.latest()
    return outcome, seconds, ckpt.timeout_s, again, latest.step if latest else None


@pytest.mark.parametrize(("phase", "sites", "world"), [("upload", 2, 2), ("download", 2, 2), ("download", 2, 3),
                                                    ("upload", 1, 2)])
def test_a_peer_that_stops_answering_mid_transfer_fails_the_others_within_the_timeout(tmp_path, phase, sites, world):
    results = run_ranks(_peer_stops_mid_transfer, world, str(tmp_path / "ckpt"), phase, sites, timeout=120)
    message, seconds, timeout_s, again, latest = results[0]
    assert timeout_s == TIMEOUT_S
    assert again.startswith("this Checkpointer cannot be used again: an earlier checkpoint collective failed"), again
    assert latest == (None if phase == "upload" else 1)  # the abandoned save committed nothing
    # download: the heartbeat inside the read fails; the load's error check after it must not wait a second time
    head = f"checkpoint heartbeat ({phase})"
    for other, other_seconds, *_ in results[2:]:  # a third rank, healthy like rank 0
        assert other.startswith(head) and other_seconds < TIMEOUT_S + 1 + 3, (other, other_seconds)
    if sites == 2:
        assert message.startswith(f"{head} between site '0' and site '1' timed out after {TIMEOUT_S:g} s"), message
    else:
        assert message.startswith(f"{head} timed out after {TIMEOUT_S:g} s: rank 0 got no answer from the other "
                                  "ranks of the checkpoint group"), message
        assert "resumes from the last committed checkpoint" in message
    assert seconds < TIMEOUT_S + 1 + 3, seconds  # timeout + one beat + start-up margin
    assert results[1][0] != "no error"


class _FailsOnRank1:
    """A Stateful whose ``hook`` (``state_dict`` or ``load_state_dict``) fails on rank 1 only (a user's bug, on one
    rank)."""

    def __init__(self, rank: int, hook: str | None = None) -> None:
        self.failing = hook if rank == 1 else None

    def state_dict(self):
        if self.failing == "state_dict":
            raise ValueError("state_dict failed on purpose")
        return {"x": 1}

    def load_state_dict(self, state) -> None:
        if self.failing == "load_state_dict":
            raise ValueError("load_state_dict failed on purpose")


def _load_failing_on_rank_1(rank, world, url, hook):
    import time

    import torch

    from multidc.plugins import Checkpointer

    ckpt = Checkpointer(url)  # the default timeout (30 min): a rank left waiting would hang the test
    ckpt.save({"w": torch.ones(8), "thing": _FailsOnRank1(rank)}, step=1)
    started = time.monotonic()
    try:
        ckpt.load({"w": torch.zeros(8), "thing": _FailsOnRank1(rank, hook)})
        outcome = "no error"
    except ValueError as exc:
        outcome = str(exc)
    seconds = time.monotonic() - started
    ckpt.save({"w": torch.ones(8)}, step=2)  # the group still works: the failure was gathered, not left hanging
    ckpt.close()
    return outcome, seconds


HOOKS = ["state_dict", "load_state_dict"]
UPLOADS = {"parts-in-turn": (1, 0.5), "parts-in-flight": (8, 4.0)}  # (concurrency, part_s)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, s3_server):
    """The 2-rank cases below whose Checkpointer stays usable after the failure they inject (each saves again
    afterwards), on one set of spawned ranks (starting ranks is the slow part); each in its own folder or bucket,
    named in ``two_ranks.where``."""
    tmp = tmp_path_factory.mktemp("liveness")
    options = s3_server.storage_options()
    where = {hook: str(tmp / hook / "ckpt") for hook in HOOKS}
    where |= {name: s3_server.make_bucket(f"t-upload-{uuid.uuid4().hex[:12]}") + "/run" for name in UPLOADS}
    cases = {hook: (_load_failing_on_rank_1, (where[hook], hook)) for hook in HOOKS}
    cases |= {name: (_upload_fails_on_rank_1, (where[name], options, *UPLOADS[name])) for name in UPLOADS}
    results = run_cases(cases, 2, timeout=280)
    results.where = where
    return results


@pytest.mark.timeout(420)  # the first to run sets up two_ranks
@pytest.mark.parametrize("hook", HOOKS)
def test_a_state_dict_or_restore_failing_on_one_rank_during_load_raises_on_every_rank(two_ranks, hook):
    results = two_ranks[hook]
    assert results[1][0] == f"{hook} failed on purpose"
    assert results[0][0] == f"rank 1: {hook} failed on purpose"
    assert all(seconds < 20 for _, seconds in results)


def test_checkpointer_takes_its_timeout_from_the_topology_unless_given(tmp_path):
    from multidc.plugins import Checkpointer

    class _Topology:  # what the Checkpointer reads of a Topology
        num_sites = 1
        wan = type("Wan", (), {"timeout_s": 42.0})()

    assert Checkpointer(str(tmp_path), topology=_Topology()).timeout_s == 42.0
    assert Checkpointer(str(tmp_path), topology=_Topology(), timeout_s=5).timeout_s == 5.0
    assert Checkpointer(str(tmp_path)).timeout_s == 1800.0
    with pytest.raises(ValueError, match="timeout_s=0 must be a positive number"):
        Checkpointer(str(tmp_path), timeout_s=0)


PARTS = 8  # parts of rank 0's shard


def _upload_fails_on_rank_1(rank, world, url, options, concurrency, part_s):
    import asyncio
    import time

    import s3fs
    import torch

    from multidc.plugins import Checkpointer, CheckpointSaveError

    sent = []
    original = s3fs.S3FileSystem._call_s3

    async def upload_part(self, method, *args, **kwargs):
        if method == "upload_part":
            if rank == 1:
                raise ValueError("injected: the store rejected this part")
            await asyncio.sleep(part_s)
            sent.append(kwargs["PartNumber"])
        return await original(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = upload_part
    weights = torch.ones(world * PARTS * (5 << 20) // 4)  # replicated, so striped: PARTS parts of 5 MiB per rank
    ckpt = Checkpointer(url, storage_options=options, part_size_mb=5, max_concurrency=concurrency, stripe_min_mb=0,
                        timeout_s=5)
    started = time.monotonic()
    try:
        ckpt.save({"w": weights}, step=1)
        message = None
    except CheckpointSaveError as exc:
        message = str(exc)
    failed_s = time.monotonic() - started
    s3fs.S3FileSystem._call_s3 = original
    ckpt.save({"w": weights}, step=2)  # the Checkpointer stays usable: only the save failed, not its group
    ckpt.close()
    return message, failed_s, len(sent)


@pytest.mark.timeout(420)  # the first to run sets up two_ranks
@pytest.mark.parametrize("case", list(UPLOADS))
def test_an_upload_failing_on_one_rank_stops_the_others_uploads(s3_server, two_ranks, case):
    """Rank 1's first part is rejected; rank 0, whose upload alone would take at least 4 s (8 parts one at a time,
    or all 8 in flight at once), learns it from the next heartbeat (0.5 s) and cancels its parts, waiting or in
    flight; the save fails on both ranks with rank 1's error only, commits nothing and leaves no multipart upload
    behind; the next save succeeds."""
    from multidc.plugins import list_checkpoints

    url, options = two_ranks.where[case], s3_server.storage_options()
    results = two_ranks[case]
    for message, failed_s, _ in results:
        assert message and "rank 1: ObjectStoreError" in message and "injected" in message, message
        assert "rank 0" not in message, message  # rank 0 stopped because of rank 1: not a second failure
        assert failed_s < 2.5, failed_s
    assert results[0][2] <= PARTS // 2, results[0][2]  # without the stop, all PARTS were sent
    assert [c.step for c in list_checkpoints(url, storage_options=options)] == [2]
    uploads = s3_server.filesystem().call_s3("list_multipart_uploads", Bucket=url[5:].split("/", 1)[0])
    assert not uploads.get("Uploads"), uploads
