"""Sharded object-store checkpoints: striping, resharded resume parity, async, atomicity, integrity, retention.

Distributed cases run 2-4 gloo ranks against a real SeaweedFS S3 server (or file://) and compare with a
single-process reference run computed in the test process.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.planner import SavePlan

from multidc.hierarchical.tools.ranks import run_ranks
from multidc.plugins import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointSaveError,
    ModelState,
    ObjectStore,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreNotFoundError,
    RNGState,
    latest,
    list_checkpoints,
)
from multidc.plugins.checkpoint.format import CheckpointCorruptError as FormatError
from multidc.plugins.checkpoint.format import checkpoint_name, decode_commit, parse_step
from multidc.plugins.checkpoint.planner import stripe_plans
from multidc.plugins.checkpoint.segments import Segments
from tests._batched import run_cases
from tests._resources import require_module
from tests.conftest import AUTH_KEYS, READONLY_KEYS

pytestmark = pytest.mark.timeout(240)
BATCH = 16


# ----------------------------------------------------------------------------- model, data, reference
def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))


def _batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 32, generator=gen), torch.randn(BATCH, 4, generator=gen)


def _optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(model, opt, sched, steps, rank=0, world=1) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if world > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(float(loss.detach()))
    return losses


def _reference(total_steps: int):
    model = _model()
    opt, sched = _optim(model)
    return _train(model, opt, sched, range(total_steps)), {k: v.clone() for k, v in model.state_dict().items()}


def _state(model, opt, sched, step):
    return {"model": ModelState(model, opt), "sched": sched, "rng": RNGState(), "trainer": {"step": step}}


# ----------------------------------------------------------------------------- rank functions
def _ddp_train_then_save(rank, world, url, options, steps):
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    opt, sched = _optim(ddp)
    losses = _train(ddp, opt, sched, range(steps), rank, world)
    with Checkpointer(url, storage_options=options, stripe_min_mb=0) as ckpt:
        info = ckpt.save(_state(ddp, opt, sched, steps), step=steps).wait()
    return losses, torch.rand(3), info.step


def _ddp_resume_and_train(rank, world, url, options, total_steps):
    ddp = torch.nn.parallel.DistributedDataParallel(_model(seed=123))  # different init: the load must matter
    opt, sched = _optim(ddp)
    state = _state(ddp, opt, sched, 0)
    with Checkpointer(url, storage_options=options) as ckpt:
        info = ckpt.load(state)
    draws = torch.rand(3)
    start = state["trainer"]["step"]
    losses = _train(ddp, opt, sched, range(start, total_steps), rank, world)
    return info.world_size, start, draws, losses, {k: v.clone() for k, v in ddp.module.state_dict().items()}


def test_resume_on_another_world_size_matches_an_unbroken_run(s3_server, s3_bucket):
    """4-rank DDP saves striped to S3 after 3 steps; 2 ranks resume and finish: same losses and weights."""
    url, options = f"{s3_bucket}/run", s3_server.storage_options()
    ref_losses, ref_weights = _reference(6)
    saved = run_ranks(_ddp_train_then_save, 4, url, options, 3, timeout=180)
    assert [s[2] for s in saved] == [3] * 4
    for losses, _, _ in saved:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[:3]), rtol=1e-5, atol=1e-6)

    store = ObjectStore(url, storage_options=options)
    commit = decode_commit(store.get("step_0000000003/COMMIT.json"), "test")
    sizes = [commit.files[f"data/rank{r:05d}.distcp"] for r in range(4)]
    replicated = [loc for index, loc in commit.locations.items() if index.fqn.startswith("model.")
                  and not index.fqn.endswith(".step") and loc.dtype is not None]
    state_bytes = sum(3 * v.numel() * 4 for v in ref_weights.values())  # weights + 2 Adam moments
    assert sum(loc.length for loc in replicated) == state_bytes, "replicated state must be stored exactly once"
    assert {loc.file for loc in replicated} == set(commit.files), "every replica uploads a share"
    assert max(sizes) < 1.3 * min(sizes), f"striping should balance the replicas' shares: {sizes}"

    resumed = run_ranks(_ddp_resume_and_train, 2, url, options, 6, timeout=180)
    for rank, (saved_world, start, draws, losses, weights) in enumerate(resumed):
        assert (saved_world, start) == (4, 3)
        torch.testing.assert_close(draws, saved[rank][1])  # RNG streams continue where rank r left off
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-6)
        for name, value in ref_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


def _round_trip(rank, world, url):
    model = _model(seed=rank)  # ranks differ: per-rank values go through "rank<r>" keys
    values = {"w": model[0].weight.detach().clone(), "per_rank": {f"r{rank}": torch.arange(5) * rank},
              "meta": {"epoch": 7, "name": "abc", "floats": [0.5, 1.5]}, "scalar": torch.tensor(2.5)}
    with Checkpointer(url) as ckpt:
        ckpt.save(values, step=11)
        target = {"w": torch.zeros(256, 32), "per_rank": {f"r{rank}": torch.zeros(5, dtype=torch.int64)},
                  "meta": {"epoch": 0, "name": "", "floats": []}, "scalar": torch.tensor(0.0)}
        info = ckpt.load(target)
        latest_info = ckpt.latest()
    return values, target, info.step, latest_info.name


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, s3_server, s3_auth_server):
    """The 2-rank cases of this module that neither kill a rank nor need another's checkpoint, on one set of
    spawned ranks (starting ranks is the slow part); each in its own bucket or folder, named in ``two_ranks.where``.
    The case that replaces a module function on a rank comes last."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    options, auth = s3_server.storage_options(), s3_auth_server.storage_options()
    readonly = s3_auth_server.storage_options(key=READONLY_KEYS[0], secret=READONLY_KEYS[1])
    wrong = s3_auth_server.storage_options(key=AUTH_KEYS[0], secret="not-the-secret-77")
    one_wrong = s3_auth_server.storage_options(key=AUTH_KEYS[0], secret="not-the-secret-78")
    where = {"round trip": f"file://{tmp}/round-trip/ckpts",
             "async": s3_auth_server.make_bucket("asyncb") + "/run",
             "corrupt": s3_server.make_bucket(f"t-corrupt-{uuid.uuid4().hex[:8]}") + "/run",
             "wrong credentials": s3_auth_server.make_bucket("wrongcreds") + "/run",
             "one rank wrong": s3_auth_server.make_bucket("onewrong") + "/run",
             "cannot unpickle": str(tmp / "unpickle" / "ckpt"),
             "staging fails": s3_server.make_bucket(f"t-staging-{uuid.uuid4().hex[:8]}") + "/run"}
    Checkpointer(where["one rank wrong"], storage_options=auth).save({"x": torch.ones(3)}, step=1)
    cases = {"round trip": (_round_trip, (where["round trip"],)),
             "async": (_async_then_failing_async, (where["async"], auth, readonly)),
             "corrupt": (_save_model, (where["corrupt"], options, 1)),
             "wrong credentials": (_wrong_credentials, (where["wrong credentials"], wrong)),
             "one rank wrong": (_one_rank_with_wrong_credentials, (where["one rank wrong"], auth, one_wrong)),
             "cannot unpickle": (_one_rank_cannot_unpickle, (where["cannot unpickle"],)),
             "staging fails": (_staging_fails_on_rank_1, (where["staging fails"], options))}
    results = run_cases(cases, 2, timeout=400)
    results.where = where
    return results


def test_round_trip_to_a_file_url_restores_tensors_and_plain_values(two_ranks):
    out = two_ranks["round trip"]
    folder = two_ranks.where["round trip"].removeprefix("file://")
    for saved, loaded, step, name in out:
        assert (step, name) == (11, "step_0000000011")
        torch.testing.assert_close(loaded["w"], out[0][0]["w"])  # same key on all ranks: rank 0's copy
        torch.testing.assert_close(loaded["per_rank"], saved["per_rank"])
        assert loaded["meta"] == {"epoch": 7, "name": "abc", "floats": [0.5, 1.5]}
        assert float(loaded["scalar"]) == 2.5
    assert sorted(os.listdir(os.path.join(folder, "step_0000000011"))) == ["COMMIT.json", "data"]


def _async_then_failing_async(rank, world, url, options, readonly_options):
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    opt, sched = _optim(ddp)
    _train(ddp, opt, sched, range(2), rank, world)
    expected = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    with Checkpointer(url, storage_options=options, async_save=True) as ckpt:
        handle = ckpt.save(_state(ddp, opt, sched, 2), step=2)
        _train(ddp, opt, sched, range(2, 4), rank, world)  # training (DDP all-reduces) while uploading
        with torch.no_grad():
            for p in ddp.parameters():
                p.add_(100.0)  # the snapshot must not see changes made after save() returned
        assert handle.wait().step == 2
        restored = _model(seed=9)
        ckpt.load({"model": ModelState(restored)}, allow_partial=True)
    failing = Checkpointer(url, storage_options=readonly_options, async_save=True)
    failing.save(_state(ddp, opt, sched, 4), step=4)  # passes the access check (the bucket is readable)
    _train(ddp, opt, sched, range(4, 5), rank, world)
    error = None
    try:
        failing.save(_state(ddp, opt, sched, 5), step=5)  # must raise the previous upload's error
    except CheckpointSaveError as exc:
        error = str(exc)
    finally:
        failing.comm.close()
    return expected, restored.state_dict(), error


def test_async_save_snapshots_then_uploads_and_surfaces_upload_errors(s3_auth_server, two_ranks):
    url = two_ranks.where["async"]
    out = two_ranks["async"]
    for expected, restored, error in out:
        for name, value in expected.items():
            torch.testing.assert_close(restored[name], value)
        assert error is not None and "access denied" in error and s3_auth_server.endpoint in error
        assert READONLY_KEYS[1] not in error
    assert [c.step for c in list_checkpoints(url, storage_options=s3_auth_server.storage_options())] == [2]


def test_async_saves_reuse_one_snapshot_buffer_and_each_checkpoint_keeps_its_values(tmp_path):
    n = 1 << 18
    state = {"w": torch.zeros(n), "meta": {"n": 0}}
    with Checkpointer(str(tmp_path), async_save=True) as ckpt:
        ckpt.save(state, step=1).wait()
        first = ckpt._snapshot.tensor
        state["w"].add_(1.0)
        ckpt.save(state, step=2)  # into the same buffer: the first upload is done
        state["w"].add_(1.0)  # after the snapshot, while uploading: not in step 2
        ckpt.wait()
        assert ckpt._snapshot.tensor is first
        ckpt.save(state, step=3, async_save=False)  # from the tensors: the buffer stays as it is
        assert ckpt._snapshot.tensor is first
        state["more"] = torch.full((n,), 7.0)  # twice the state: a new buffer, not one that cannot hold it
        ckpt.save(state, step=4).wait()
        assert ckpt._snapshot.tensor is not first and ckpt._snapshot.tensor.numel() >= 8 * n
        for step, value in ((1, 0.0), (2, 1.0), (3, 2.0), (4, 2.0)):
            target = {"w": torch.full((n,), -1.0), "meta": {"n": None}}
            ckpt.load(target, step, allow_partial=True)
            assert torch.equal(target["w"], torch.full((n,), value)) and target["meta"] == {"n": 0}, step
    assert ckpt._snapshot.tensor is None  # released by close()


def test_a_sync_save_copies_what_it_cannot_upload_in_place_as_an_async_save_does(tmp_path):
    # a sync save uploads plain CPU tensors straight from their memory; a wrapper subclass has none of its own (its
    # data_ptr is 0: viewing it would read address 0), a transposed view's memory is not its stored order
    from torch.testing._internal.two_tensor import TwoTensor

    base = torch.arange(24.0)
    state = {"wrapped": TwoTensor(base, 2 * base), "transposed": base.view(4, 6).t(), "plain": base + 1}
    restored = []
    for async_save in (False, True):
        with Checkpointer(str(tmp_path / str(async_save)), async_save=async_save) as ckpt:
            ckpt.save(state, step=1).wait()
            target = {"wrapped": torch.zeros(24), "transposed": torch.zeros(6, 4), "plain": torch.zeros(24)}
            ckpt.load(target)
            restored.append(target)
    for name in state:
        assert torch.equal(restored[0][name], restored[1][name]), name
    assert torch.equal(restored[0]["transposed"], base.view(4, 6).t()) and torch.equal(restored[0]["plain"], base + 1)


def _save_and_kill(rank, world, url, options):
    model = _model()
    with Checkpointer(url, storage_options=options, stripe_min_mb=0, timeout_s=30) as ckpt:
        ckpt.save({"model": ModelState(model)}, step=1)
        if rank == 1:
            real_put = ObjectStore.put

            def put_then_die(self, key, data, **kwargs):
                data = data if isinstance(data, Segments) else Segments([data])
                real_put(self, key, data.slice(0, len(data) // 2), **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)  # dies mid-save, after a partial shard reached storage

            ObjectStore.put = put_then_die
        ckpt.save({"model": ModelState(model)}, step=2)


def _save_model(rank, world, url, options, step):
    with Checkpointer(url, storage_options=options) as ckpt:
        ckpt.save({"model": ModelState(_model())}, step=step)


def test_rank_killed_mid_save_leaves_previous_checkpoint_latest(s3_server, s3_bucket):
    url, options = f"{s3_bucket}/run", s3_server.storage_options()
    with pytest.raises(AssertionError, match="rank 0 failed"):
        run_ranks(_save_and_kill, 2, url, options, timeout=90)
    assert latest(url, storage_options=options).step == 1
    store = ObjectStore(url, storage_options=options)
    assert store.exists("step_0000000002/data/rank00001.distcp")  # half-written, ignored
    assert not store.exists("step_0000000002/COMMIT.json")
    restored = _model(seed=5)
    Checkpointer(url, storage_options=options).load({"model": ModelState(restored)})
    torch.testing.assert_close(restored.state_dict(), _model().state_dict())
    run_ranks(_save_model, 2, url, options, 3, timeout=90)  # the next commit cleans the half-written one
    assert [c.step for c in list_checkpoints(url, storage_options=options)] == [1, 3]
    assert _folders_with_objects(store) == {"step_0000000001", "step_0000000003"}


def _folders_with_objects(store: ObjectStore) -> set[str]:
    """Checkpoint folders that still hold objects (S3 servers may list emptied folders for a while)."""
    store.fs.invalidate_cache()
    return {path[len(store.root) + 1:].split("/", 1)[0] for path in store.fs.find(store.root)}


def test_corrupted_shard_is_detected_and_named(s3_server, two_ranks):
    url, options = two_ranks.where["corrupt"], s3_server.storage_options()
    assert len(two_ranks["corrupt"]) == 2  # saved by 2 ranks
    store = ObjectStore(url, storage_options=options)
    key = "step_0000000001/data/rank00001.distcp"
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01
    store.put(key, bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"corrupt shard data/rank00001\.distcp") as info:
        Checkpointer(url, storage_options=options).load({"model": ModelState(_model(seed=3))})
    assert "model." in str(info.value) and "crc32" in str(info.value)


def test_keep_last_k_keeps_only_the_newest_committed_and_cleans_half_written(s3_server, s3_bucket):
    url, options = f"{s3_bucket}/run", s3_server.storage_options()
    store = ObjectStore(url, storage_options=options)
    store.put("step_0000000000/data/rank00000.distcp", b"half-written by a crashed job")
    ckpt = Checkpointer(url, storage_options=options, keep_last_k=2)
    assert ckpt.latest() is None  # uncommitted folders are never listed
    for step in (1, 2, 3, 4):
        ckpt.save({"x": torch.full((4,), float(step))}, step=step)
    assert [c.step for c in ckpt.list()] == [3, 4]
    assert _folders_with_objects(store) == {"step_0000000003", "step_0000000004"}
    target = {"x": torch.zeros(4)}
    assert ckpt.load(target, 3).step == 3 and float(target["x"][0]) == 3.0
    with pytest.raises(ValueError, match="already committed"):
        ckpt.save({"x": torch.zeros(4)}, step=4)
    with pytest.raises(FileNotFoundError, match="step_0000000001"):
        ckpt.load(target, 1)


def _wrong_credentials(rank, world, url, options):
    try:
        Checkpointer(url, storage_options=options).save({"x": torch.ones(3)}, step=1)
    except ObjectStoreAuthError as exc:
        return str(exc)
    return None


def test_wrong_credentials_fail_on_every_rank_before_anything_is_written(s3_auth_server, two_ranks):
    url = two_ranks.where["wrong credentials"]
    messages = two_ranks["wrong credentials"]
    for message in messages:
        assert message and "access denied" in message and "wrongcreds" in message
        assert s3_auth_server.endpoint in message and "not-the-secret-77" not in message
    assert s3_auth_server.filesystem().ls("wrongcreds") == []
    right = Checkpointer(url, storage_options=s3_auth_server.storage_options())
    right.save({"x": torch.ones(3)}, step=1)
    target = {"x": torch.zeros(3)}
    right.load(target)
    assert torch.equal(target["x"], torch.ones(3))


def _one_rank_with_wrong_credentials(rank, world, url, options, wrong):
    outcomes = []
    for step, operation in ((2, "save"), (None, "load")):
        ckpt = Checkpointer(url, storage_options=wrong if rank == 1 else options)
        try:
            if operation == "save":
                ckpt.save({"x": torch.full((3,), 2.0)}, step=step)
            else:
                ckpt.load({"x": torch.zeros(3)})
            outcomes.append(None)
        except ObjectStoreAuthError as exc:
            outcomes.append(str(exc))
        finally:
            ckpt.close()
    return outcomes


def test_credentials_refused_on_one_rank_fail_every_rank_naming_it_before_a_save_or_load(s3_auth_server, two_ranks):
    # the access check runs with rank 0's preparation (save) or commit read (load) in one round; the others learn
    # of rank 1's failure from that round's heartbeat and gather its error. ``two_ranks`` saved step 1 first.
    url, options = two_ranks.where["one rank wrong"], s3_auth_server.storage_options()
    out = two_ranks["one rank wrong"]
    for rank, messages in enumerate(out):
        for message in messages:
            assert message and "access denied" in message and "not-the-secret-78" not in message, (rank, message)
            assert rank == 1 or message.startswith("rank 1: "), message
    assert [c.step for c in list_checkpoints(url, storage_options=options)] == [1]


def _staging_fails_on_rank_1(rank, world, url, options):
    import multidc.plugins.checkpoint.checkpointer as checkpoint_module

    outcomes, real_stage = [], checkpoint_module.stage
    try:
        with Checkpointer(url, storage_options=options) as ckpt:
            ckpt.save({"x": torch.ones(3)}, step=1)
            if rank == 1:
                def failing_stage(*args, **kwargs):
                    raise MemoryError("injected: no host memory for the snapshot")

                checkpoint_module.stage = failing_stage
            for async_save in (False, True):
                try:
                    ckpt.save({"x": torch.full((3,), 2.0)}, step=2, async_save=async_save).wait()
                    outcomes.append(None)
                except CheckpointSaveError as exc:
                    outcomes.append(str(exc))
    finally:
        checkpoint_module.stage = real_stage
    return outcomes


def test_a_snapshot_failing_on_one_rank_fails_the_save_on_every_rank_and_commits_nothing(s3_server, two_ranks):
    url, options = two_ranks.where["staging fails"], s3_server.storage_options()
    for messages in two_ranks["staging fails"]:
        for message in messages:  # sync and async
            assert message and "rank 1: MemoryError: injected" in message, message
    assert [c.step for c in list_checkpoints(url, storage_options=options)] == [1]


def test_missing_bucket_and_missing_checkpoint_are_clear_errors(s3_server, s3_bucket):
    with pytest.raises(ObjectStoreNotFoundError, match="bucket 'absent-bucket-q' does not exist"):
        Checkpointer("s3://absent-bucket-q/run", storage_options=s3_server.storage_options()).save(
            {"x": torch.ones(1)}, step=0)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        Checkpointer(f"{s3_bucket}/empty", storage_options=s3_server.storage_options()).load({"x": torch.ones(1)})


class _Opaque:
    def __init__(self, value):
        self.value = value


class _Recorder:
    """A Stateful that records whether its state was restored."""

    def __init__(self) -> None:
        self.restored = False

    def state_dict(self) -> dict:
        return {"w": torch.ones(2)}

    def load_state_dict(self, state: dict) -> None:
        self.restored = True


def _one_rank_cannot_unpickle(rank, world, url):
    from multidc.plugins.checkpoint.comm import THIS_PROCESS

    with Checkpointer(url, process_group=THIS_PROCESS) as alone:  # a value only rank 1 reads, which it refuses
        alone.save({"rec": {"w": torch.ones(2)}, "v0": 1, "v1": _Opaque(3)}, step=1) if rank == 0 else None
    dist.barrier()
    recorder = _Recorder()
    state = {"rec": recorder, **({"v0": None} if rank == 0 else {"v1": None})}
    with Checkpointer(url) as ckpt:
        try:
            ckpt.load(state)
            error = None
        except Exception as exc:  # noqa: BLE001  (compared across ranks below)
            error = f"{type(exc).__name__}: {exc}"
    return error, recorder.restored


def test_a_value_one_rank_cannot_unpickle_fails_the_load_everywhere_and_no_rank_restores(two_ranks):
    # the read succeeds on rank 0, but rank 1 refuses its value (weights_only) after the read's own gather: rank 0
    # must not call load_state_dict (it may be collective, and the job's ranks would differ), and both must raise
    out = two_ranks["cannot unpickle"]
    for rank, (error, restored) in enumerate(out):
        assert error is not None and ("weights_only" in error or "Unsupported global" in error), (rank, error)
        assert rank == 1 or "rank 1: " in error, error
        assert not restored, f"rank {rank} restored its state from a failed load"


def test_loading_refuses_arbitrary_pickled_objects_unless_trusted(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save({"obj": _Opaque(3), "t": torch.ones(2)}, step=0)
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        ckpt.load({"obj": None, "t": torch.zeros(2)})
    target = {"obj": None, "t": torch.zeros(2)}
    ckpt.load(target, trusted=True)
    assert target["obj"].value == 3


def test_loading_into_a_different_model_fails_clearly(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save({"model": ModelState(_model())}, step=0)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(Exception, match="Missing key|weight"):
        ckpt.load({"model": ModelState(other)})


def _diloco_entry(**residuals) -> dict:
    """A DiLoCo state's shape (``DiLoCo.state_dict``): global parameters, and per global rank its residuals."""
    entry = {"global": {"fragment_0": torch.ones(6)}}
    if residuals:
        entry["residual"] = {rank: {"fragment_0": r} for rank, r in residuals.items()}
    return {"diloco": {"pp0of1_dp_shard0of1_tp0of1": entry}, "site_0": {"w": torch.ones(3)}}


def test_residuals_a_checkpoint_lacks_restart_at_zero_and_every_other_key_stays_strict(tmp_path, caplog):
    """int8 -> topk (no residual saved), another world size (this rank's residual saved in another size), and
    topk -> int8 (residuals saved, none wanted) all load; a missing key that is not a residual still fails."""
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(_diloco_entry(), step=0)
    ckpt.save(_diloco_entry(rank_0=torch.full((8,), 2.0), rank_1=torch.full((8,), 3.0)), step=1)
    for step, wanted in ((0, torch.full((8,), 5.0)), (1, torch.full((4,), 5.0))):
        target = _diloco_entry(rank_0=wanted)
        with caplog.at_level(logging.WARNING, logger="multidc.plugins.checkpoint"):
            ckpt.load(target, step)
        entry = target["diloco"]["pp0of1_dp_shard0of1_tp0of1"]
        assert entry["residual"]["rank_0"] == {}, step  # DiLoCo.load_state_dict reads "not saved": zero
        assert torch.equal(wanted, torch.full(wanted.shape, 5.0))  # the live buffer is not read into
        assert "1 DiLoCo error-feedback residual(s) are not in this checkpoint" in caplog.text
        caplog.clear()
    target = _diloco_entry(rank_1=torch.zeros(8))  # the same size: loaded
    ckpt.load(target, 1)
    assert torch.equal(target["diloco"]["pp0of1_dp_shard0of1_tp0of1"]["residual"]["rank_1"]["fragment_0"],
                       torch.full((8,), 3.0))
    target = _diloco_entry()  # topk -> int8: the saved residuals are not wanted
    ckpt.load(target, 1)
    assert torch.equal(target["diloco"]["pp0of1_dp_shard0of1_tp0of1"]["global"]["fragment_0"], torch.ones(6))
    for missing in ({"fragment_1": torch.zeros(2)}, {"rank_0": torch.zeros(8)}):  # not a residual: strict
        target = _diloco_entry()
        target["diloco"]["pp0of1_dp_shard0of1_tp0of1"]["global"].update(missing)
        with pytest.raises(RuntimeError, match="Missing key"):
            ckpt.load(target, 0)
    assert not caplog.text


# ----------------------------------------------------------------------------- pure logic
def test_stripe_plans_split_replicated_tensors_evenly_and_store_one_copy():
    state = {"big": torch.zeros(1000, 64), "small": torch.zeros(3), "odd": torch.zeros(3, 50), "n": 5}
    plans = [create_default_local_save_plan(state, rank == 0) for rank in range(4)]
    striped = stripe_plans(plans, stripe_min_bytes=64)
    per_rank = [sum(i.tensor_storage_size() or 0 for i in plan.items) for plan in striped]
    assert max(per_rank) - min(per_rank) <= 4 * 64 * 4  # within a few rows of each other
    rows = sorted((i.tensor_data.chunk.offsets[0], i.tensor_data.chunk.sizes[0])
                  for plan in striped for i in plan.items if i.index.fqn == "big")
    assert rows[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(rows, rows[1:]))
    assert rows[-1][0] + rows[-1][1] == 1000 and len(rows) == 4
    odd = [i for plan in striped for i in plan.items if i.index.fqn == "odd"]
    assert sorted(i.tensor_data.chunk.sizes[0] for i in odd) == [1, 1, 1]  # 3 rows: 3 of the 4 replicas
    for fqn in ("small", "n"):
        assert sum(i.index.fqn == fqn for plan in striped for i in plan.items) == 1


def test_stripe_plans_leave_unreplicated_items_with_their_owner():
    plans = [SavePlan(create_default_local_save_plan({f"own{r}": torch.zeros(100, 10)}, r == 0).items)
             for r in range(3)]
    striped = stripe_plans(plans, stripe_min_bytes=0)
    assert [[i.index.fqn for i in p.items] for p in striped] == [["own0"], ["own1"], ["own2"]]


@pytest.mark.parametrize("record", [
    b"not json", b'{"format": "other/1"}',
    b'{"format": "multidc-checkpoint/1", "step": 1, "world_size": 1, "created_unix": 0, "files": {}, '
    b'"planner_data": {}, "entries": {"x": {"kind": "bytes", "at": ["../../etc/passwd", 0, 1, 0, null, null]}}}',
    b'{"format": "multidc-checkpoint/1", "step": 1, "world_size": 1, "created_unix": 0, "files": {}, '
    b'"planner_data": {}, "entries": {"x": {"kind": "tensor", "dtype": "Tensor", "size": [1], '
    b'"requires_grad": false, "chunks": []}}}',
])
def test_bad_commit_records_are_rejected(record):
    with pytest.raises(FormatError, match="commit record where is invalid"):
        decode_commit(record, "where")


def test_checkpoint_names_sort_by_step_and_parse_back():
    steps = [10**10 + 3, 0, 10, 7, 9]
    names = [checkpoint_name(s) for s in steps]
    assert [parse_step(n) for n in sorted(names)] == sorted(steps)
    assert parse_step("step_12") is None and parse_step("last.ckpt") is None


# ----------------------------------------------------------------------------- Lightning CheckpointIO
def _lightning_run(root, max_steps, io_plugin, ckpt_path=None, save_every=None):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch(0)), batch_size=4)  # 4 steps/epoch
    callbacks = []
    if save_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=f"{root}/ckpts", filename="m-{step}",
                                                      every_n_train_steps=save_every, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, plugins=[io_plugin],
                         callbacks=callbacks, enable_checkpointing=bool(save_every), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    module = Module()
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return module.net.state_dict(), trainer.global_step


def test_lightning_checkpoint_io_saves_to_s3_and_resumes_to_the_same_weights(s3_auth_server, monkeypatch,
                                                                               tmp_path):
    require_module("lightning", "lightning")
    from multidc.plugins import ObjectStoreCheckpointIO

    # credentials and endpoint from the standard AWS variables: Lightning's own fsspec calls see them too
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_auth_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", AUTH_KEYS[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AUTH_KEYS[1])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    root = s3_auth_server.make_bucket("lightning") + "/run"
    unbroken, _ = _lightning_run(str(tmp_path), 6, ObjectStoreCheckpointIO())
    _lightning_run(root, 4, ObjectStoreCheckpointIO(async_save=True), save_every=4)
    path = f"{root}/ckpts/m-step=4.ckpt"
    assert ObjectStore(path).exists("COMMIT.json")
    resumed, step = _lightning_run(root, 6, ObjectStoreCheckpointIO(), ckpt_path=path)
    assert step == 6
    for name, value in unbroken.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6)
    ObjectStoreCheckpointIO().remove_checkpoint(path)
    assert not ObjectStore(f"{root}/ckpts").exists("m-step=4.ckpt/COMMIT.json")


# ----------------------------------------------------------------------------- step order, replacing, cleanup
def _upload_part_then_fail(staged, store, name, stop=None):
    """Stands in for ``upload``: part of the shard reaches storage, then the upload fails."""
    store.put(f"{name}/{staged.file}", b"partial shard")
    raise OSError("injected upload failure")


def _stored(ckpt: Checkpointer, which="latest") -> float:
    target = {"x": torch.zeros(4)}
    ckpt.load(target, which)
    return float(target["x"][0])


def test_keep_last_1_refuses_an_older_step_instead_of_deleting_it_after_commit(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last_k=1)
    ckpt.save({"x": torch.full((4,), 200.0)}, step=200)
    with pytest.raises(ValueError, match="step 110 is not after the newest committed checkpoint .*step_0000000200"):
        ckpt.save({"x": torch.full((4,), 110.0)}, step=110)
    assert [c.step for c in ckpt.list()] == [200] and not (tmp_path / "step_0000000110").exists()
    ckpt.save({"x": torch.full((4,), 110.0)}, step=110, replace=True)  # a run rewound on purpose
    assert [c.step for c in ckpt.list()] == [110] and _stored(ckpt) == 110.0
    ckpt.save({"x": torch.full((4,), 120.0)}, step=120)
    assert [c.step for c in ckpt.list()] == [120]


@pytest.mark.parametrize("where", ["file", "s3"])
def test_replacing_a_committed_step_keeps_it_loadable_until_the_new_one_commits(tmp_path, monkeypatch, request,
                                                                                 where):
    import multidc.plugins.checkpoint.checkpointer as checkpoint_module

    if where == "s3":
        server = request.getfixturevalue("s3_server")
        url, options = f"{request.getfixturevalue('s3_bucket')}/run", server.storage_options()
    else:
        url, options = str(tmp_path), None
    ckpt = Checkpointer(url, storage_options=options)
    ckpt.save({"x": torch.full((4,), 1.0)}, step=5)
    real_upload = checkpoint_module.upload
    monkeypatch.setattr(checkpoint_module, "upload", _upload_part_then_fail)
    with pytest.raises(CheckpointSaveError, match="injected upload failure"):
        ckpt.save({"x": torch.full((4,), 2.0)}, step=5, replace=True)
    assert _stored(ckpt, 5) == 1.0  # the commit record and the shards it references are untouched
    monkeypatch.setattr(checkpoint_module, "upload", real_upload)
    ckpt.save({"x": torch.full((4,), 3.0)}, step=5, replace=True)
    assert _stored(ckpt, 5) == 3.0
    files = sorted(ckpt.store.list_files())
    assert len(files) == 2 and files[0] == "step_0000000005/COMMIT.json", files  # old and partial shards gone
    assert files[1].startswith("step_0000000005/data/rank00000-"), files


def test_a_rewound_save_that_cannot_uncommit_the_newer_checkpoint_raises(tmp_path, monkeypatch):
    from multidc.plugins import ObjectStore

    ckpt = Checkpointer(str(tmp_path))
    ckpt.save({"x": torch.full((4,), 1.0)}, step=20)
    real_delete = ObjectStore.delete

    def refuse_step_20(self, key):
        if key == "step_0000000020/COMMIT.json":
            raise PermissionError("injected: delete refused")
        return real_delete(self, key)

    monkeypatch.setattr(ObjectStore, "delete", refuse_step_20)
    # a warning here would let `latest` (step 20, the abandoned run) be resumed without anyone noticing
    with pytest.raises(CheckpointSaveError, match=r"still committed, so `latest` resolves to them.*step_0000000020"):
        ckpt.save({"x": torch.full((4,), 2.0)}, step=11, replace=True)
    assert ckpt.latest().step == 20
    monkeypatch.setattr(ObjectStore, "delete", real_delete)
    assert [c.step for c in ckpt.list()] == [11, 20]  # step 11 committed; step 20 left for the user to delete


def test_cleanup_failing_after_the_commit_is_logged_not_reported_as_a_failed_save(tmp_path, monkeypatch, caplog):
    ckpt = Checkpointer(tmp_path, keep_last_k=1)
    ckpt.save({"x": torch.full((4,), 1.0)}, step=1)
    real_delete = ObjectStore.delete

    def refuse_step_1(self, key):
        if key.startswith("step_0000000001"):
            raise ObjectStoreError(f"injected: deleting {key} refused")
        real_delete(self, key)

    monkeypatch.setattr(ObjectStore, "delete", refuse_step_1)
    with caplog.at_level(logging.WARNING, logger="multidc.plugins.checkpoint"):
        info = ckpt.save({"x": torch.full((4,), 2.0)}, step=2).wait()
    assert info.step == 2 and ckpt.latest().step == 2 and _stored(ckpt) == 2.0
    warning = caplog.text
    assert "step_0000000002 is committed, but cleaning up after it failed" in warning
    assert "left behind" in warning and "step_0000000001" in warning and "deleting step_0000000001" in warning


def _python(script: str, *args: str) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                          cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_save_and_load_work_without_numpy(tmp_path, monkeypatch):
    """NumPy is in no extra multidc declares: nothing on the save / load path may call ``Tensor.numpy``."""
    def unavailable(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")  # what torch raises when NumPy is not installed

    monkeypatch.setattr(torch.Tensor, "numpy", unavailable)
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.arange(6.0), "meta": {"epoch": 3}, "empty": torch.zeros(0)}, step=1)
    target = {"w": torch.zeros(6), "meta": {"epoch": 0}, "empty": torch.ones(0)}
    ckpt.load(target)
    assert torch.equal(target["w"], torch.arange(6.0)) and target["meta"] == {"epoch": 3}


_EXIT_WITH_FAILED_ASYNC_SAVE = """
import sys
import torch
import multidc.plugins.checkpoint.checkpointer as checkpoint_module
from multidc.plugins import Checkpointer

def fail(staged, store, name, stop=None):
    raise OSError("injected upload failure 7f3a")

checkpoint_module.upload = fail
Checkpointer(sys.argv[1]).save({"w": torch.ones(4)}, step=3, async_save=True)  # nobody waits for it
"""


def test_an_async_save_error_nobody_waited_for_is_logged_at_exit(tmp_path):
    run = _python(_EXIT_WITH_FAILED_ASYNC_SAVE, str(tmp_path))
    assert "injected upload failure 7f3a" in run.stderr, run.stderr[-3000:]
    assert "async checkpoint save to" in run.stderr and "step_0000000003" in run.stderr
