"""Region-local checkpoints: one SeaweedFS S3 server per site (two on loopback), 2 sites x 2 gloo ranks.

Pure cases check the URL settings; the distributed cases save with 2 sites, load on 2 sites and on 1 site (2 ranks),
lose a region's bucket, refuse one region's credentials, and kill a region's server mid-save.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid

import pytest
import torch

from multidc.hierarchical.tools.seaweed import SeaweedS3
from multidc.plugins.checkpoint.regions import site_urls
from tests._batched import run_cases
from tests._resources import require_weed

pytestmark = pytest.mark.timeout(400)
ROWS = 64


# ----------------------------------------------------------------------------- pure
def test_a_template_gives_every_site_its_url_and_per_site_options_stay_per_site():
    urls, options = site_urls("s3://ckpt-{site}/run1", {"a": {"key": "A"}, 1: {"key": "B"}}, site_names=("a", "b"))
    assert urls == {"a": "s3://ckpt-a/run1", "b": "s3://ckpt-b/run1"}
    assert options == {"a": {"key": "A"}, "b": {"key": "B"}}
    _, shared = site_urls({0: "s3://x/r", 1: "s3://y/r"}, {"endpoint_url": "http://e", "client_kwargs": {}},
                          site_names=("0", "1"))
    assert shared["0"] == shared["1"] == {"endpoint_url": "http://e", "client_kwargs": {}}


def test_a_mapping_keyed_by_indices_as_text_names_the_sites_in_order():
    # a mapping {0: url, 1: url} travels between ranks as JSON, whose keys are text
    urls, _ = site_urls({"0": "s3://x/r", "1": "s3://y/r"}, None, site_names=("eu", "us"))
    assert urls == {"eu": "s3://x/r", "us": "s3://y/r"}


def test_a_mapping_without_a_site_raises_naming_the_site_and_the_setting():
    with pytest.raises(ValueError, match=r"url has no URL for site 'b'"):
        site_urls({"a": "s3://x/r"}, None, site_names=("a", "b"))


def test_the_url_comes_from_the_environment_when_none_is_given(monkeypatch):
    from multidc.plugins.checkpoint.regions import from_env

    monkeypatch.setenv("MULTIDC_CKPT_URL", '{"0": "s3://x/r", "1": "s3://y/r"}')
    monkeypatch.setenv("MULTIDC_CKPT_STORAGE_OPTIONS", '{"1": {"anon": true}}')
    assert from_env(None, None) == ({"0": "s3://x/r", "1": "s3://y/r"}, {"1": {"anon": True}})
    monkeypatch.setenv("MULTIDC_CKPT_URL", "s3://ckpt-{site}/r")
    assert from_env(None, None)[0] == "s3://ckpt-{site}/r"


@pytest.mark.parametrize("call", ["save", "load"])
def test_lightning_checkpoint_io_refuses_a_site_template_naming_the_strategies_and_checkpointer(call, tmp_path):
    pytest.importorskip("lightning")
    from multidc.plugins import ObjectStoreCheckpointIO

    io = ObjectStoreCheckpointIO()
    path = str(tmp_path / "region-{site}" / "epoch=0-step=1.ckpt")
    with pytest.raises(ValueError, match=r"one store per site.*Use a multidc strategy .*Checkpointer\(url, "
                                         r"topology=...\)"):
        io.save_checkpoint({"state_dict": {}}, path) if call == "save" else io.load_checkpoint(path)
    assert not list(tmp_path.iterdir())  # nothing written


# ----------------------------------------------------------------------------- distributed
def _state(rank: int, site: int) -> dict:
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(ROWS, 256, generator=gen),                      # replicated on every rank
            "local": torch.full((ROWS, 8), float(site + 1)),                  # per site, the same key
            f"rank_{rank}": torch.full((5,), float(rank)),                    # per rank
            "meta": {"step": 5}}


def _zeros(rank: int) -> dict:
    return {"w": torch.zeros(ROWS, 256), "local": torch.zeros(ROWS, 8), f"rank_{rank}": torch.zeros(5),
            "meta": {"step": 0}}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _capture() -> _Lines:
    handler = _Lines()
    logger = logging.getLogger("multidc.plugins.checkpoint")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _checkpointer(rank, world, urls, options, **kwargs):
    from multidc.hierarchical import Topology
    from multidc.plugins import Checkpointer, RetryPolicy

    topology = Topology.build(site=rank * 2 // world)
    retry = RetryPolicy(attempts=2, initial_backoff_s=0.05)
    return Checkpointer(urls, storage_options=options, stripe_min_mb=0, topology=topology, retry=retry,
                        **kwargs), topology.site


def _listing(urls, options) -> dict:
    import s3fs

    out = {}
    for site, url in urls.items():
        fs = s3fs.S3FileSystem(**options[site])
        root = url.removeprefix("s3://")
        out[site] = sorted(p[len(root) + 1:] for p in fs.find(root))
    return out


def _save_and_load(rank, world, urls, options):
    ckpt, site = _checkpointer(rank, world, urls, options)
    ckpt.save(_state(rank, site), step=1)
    lines = _capture()
    target = _zeros(rank)
    ckpt.load(target)
    ckpt.close()
    expected = _state(rank, site)
    same = {k: (torch.equal(target[k], v) if torch.is_tensor(v) else target[k] == v) for k, v in expected.items()}
    return same, [line for line in lines.lines if "other regions" in line], _listing(urls, options)


def _load_on_one_site(rank, world, urls, options):
    """2 ranks as one site (a one-site topology: every rank in the first site) load what 2 x 2 saved."""
    from multidc.hierarchical import Topology
    from multidc.plugins import Checkpointer

    lines = _capture()
    ckpt = Checkpointer(urls, storage_options=options, topology=Topology.build(num_sites=1))
    target = _zeros(rank)
    ckpt.load(target)
    ckpt.close()
    expected = _state(rank, 0)
    return ({k: bool(torch.equal(target[k], v)) for k, v in expected.items() if torch.is_tensor(v)},
            [line for line in lines.lines if "other regions" in line])


def _wrong_credentials(rank, world, urls, options, bad):
    from multidc.plugins import ObjectStoreAuthError

    ckpt, site = _checkpointer(rank, world, urls, {**options, "1": bad})
    try:
        ckpt.save(_state(rank, site), step=2)
    except ObjectStoreAuthError as exc:
        outcome = str(exc)
    else:
        outcome = None
    ckpt.close()
    ckpt, _ = _checkpointer(rank, world, urls, options)  # the credentials fixed: nothing was lost
    latest = ckpt.latest()
    ckpt.close()
    return outcome, latest.step if latest else None


def _lost_region(rank, world, urls, options):
    import s3fs
    import torch.distributed as dist

    ckpt, site = _checkpointer(rank, world, urls, options)
    state = {"w": _state(rank, site)["w"], "meta": {"step": 5}}
    ckpt.save(state, step=3)
    dist.barrier()
    if rank == 0:  # region 0's bucket is gone
        fs = s3fs.S3FileSystem(**options["0"])
        bucket = urls["0"].removeprefix("s3://").split("/")[0]
        fs.rm(bucket, recursive=True)
        if fs.exists(bucket):
            fs.rmdir(bucket)
    dist.barrier()
    lines = _capture()
    target = {"w": torch.zeros(ROWS, 256), "meta": {"step": 0}}
    info = ckpt.load(target)
    ckpt.close()
    return info.step, bool(torch.equal(target["w"], state["w"])), [line for line in lines.lines
                                                                    if "other regions" in line]


def _sharded_across_sites(rank, world, urls, options):
    """A DTensor sharded over every rank (as fsdp_across_sites shards): each region would hold only its half."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ckpt, _ = _checkpointer(rank, world, urls, options)
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(ROWS * 4.0).view(ROWS, 4), mesh, [Shard(0)])}
    try:
        ckpt.save(state, step=1)
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        return f"{type(exc).__name__}: {exc}", [info.step for info in ckpt.list()]
    finally:
        ckpt.close()
    return "saved", [info.step for info in ckpt.list()]


def _only_in_a_lost_region(rank, world, urls, options):
    """Region 1's bucket goes after the save: ranks 2 and 3 want their own keys, which only region 1 held."""
    import s3fs
    import torch.distributed as dist

    from multidc.plugins import CheckpointRegionUnavailableError

    ckpt, site = _checkpointer(rank, world, urls, options)
    ckpt.save(_state(rank, site), step=4)
    dist.barrier()
    if rank == 0:
        fs = s3fs.S3FileSystem(**options["1"])
        bucket = urls["1"].removeprefix("s3://").split("/")[0]
        fs.rm(bucket, recursive=True)
        if fs.exists(bucket):
            fs.rmdir(bucket)
    dist.barrier()
    try:
        ckpt.load(_zeros(rank))
    except CheckpointRegionUnavailableError as exc:
        outcome = str(exc)
    else:
        outcome = None
    ckpt.close()
    return outcome


def _killed_mid_save(rank, world, urls, options, victim_group):
    import multidc.plugins.checkpoint.checkpointer as checkpointer
    from multidc.plugins import CheckpointSaveError

    ckpt, site = _checkpointer(rank, world, urls, options, timeout_s=60)
    ckpt.save(_state(rank, site), step=1)
    upload = checkpointer.upload

    def killing_upload(*args, **kwargs):  # region 1's server dies once the save has started uploading
        if rank == 2:
            os.killpg(victim_group, signal.SIGKILL)
        return upload(*args, **kwargs)

    checkpointer.upload = killing_upload
    try:
        ckpt.save(_state(rank, site), step=2)
    except CheckpointSaveError as exc:
        outcome = type(exc).__name__
    else:
        outcome = None
    finally:
        checkpointer.upload = upload
    steps = [info.step for info in ckpt.list()]
    ckpt.close()
    return outcome, steps


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    """A third server, killed by the mid-save case (the session's two stay up for other modules)."""
    require_weed()
    server = SeaweedS3.start(tmp_path_factory.mktemp("seaweed-victim"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def regions_job(s3_server, s3_auth_server, victim):
    """Every 2 x 2 case on one set of spawned ranks; each case in its own pair of buckets (site 0: the anonymous
    server, site 1: the one with credentials; the last case's site 1 is ``victim``)."""
    options = {"0": s3_server.storage_options(), "1": s3_auth_server.storage_options()}

    def pair(second=s3_auth_server):
        tag = uuid.uuid4().hex[:10]
        return {"0": s3_server.make_bucket(f"r0-{tag}") + "/run", "1": second.make_bucket(f"r1-{tag}") + "/run"}

    main, lost, only, killed, sharded = pair(), pair(), pair(), pair(victim), pair()
    bad = s3_auth_server.storage_options(key="MDCTESTACCESSKEY", secret="wrong-secret")
    cases = {
        "save and load": (_save_and_load, (main, options)),
        "wrong credentials": (_wrong_credentials, (main, options, bad)),
        "lost region": (_lost_region, (lost, options)),
        "only in a lost region": (_only_in_a_lost_region, (only, options)),
        "sharded across sites": (_sharded_across_sites, (sharded, options)),
        "killed": (_killed_mid_save, (killed, {**options, "1": victim.storage_options()}, victim.process.pid)),
    }
    return run_cases(cases, 4, timeout=360), main


def test_each_site_gets_back_its_own_state_and_every_region_holds_the_replicated_state_once(regions_job):
    results, _ = regions_job
    for rank, (same, crossed, _listing) in enumerate(results["save and load"]):
        assert all(same.values()), (rank, same)
        assert crossed == ([f"site '{rank // 2}': this load reads 0 bytes from other regions"] if rank in (0, 2)
                           else []), crossed  # one line, on the lowest rank of each site
    listing = results["save and load"][0][2]
    for site, ranks in (("0", (0, 1)), ("1", (2, 3))):  # each region: its own ranks' shards and the record
        assert listing[site] == sorted(["step_0000000001/COMMIT.json",
                                        *(f"step_0000000001/data/rank{r:05d}.distcp" for r in ranks)])


@pytest.fixture(scope="module")
def one_site_job(regions_job, s3_server, s3_auth_server):
    _, main = regions_job
    options = {"0": s3_server.storage_options(), "1": s3_auth_server.storage_options()}
    return run_cases({"load": (_load_on_one_site, (main, options))}, 2, timeout=120)


def test_a_one_site_job_loads_a_two_site_checkpoint_from_its_own_region_only(one_site_job):
    for rank, value in enumerate(one_site_job["load"]):
        same, crossed = value
        assert all(same.values()), (rank, same)
        assert crossed == (["site '0': this load reads 0 bytes from other regions"] if rank == 0 else []), crossed


def test_wrong_credentials_for_one_region_fail_every_rank_with_the_same_error_naming_it(regions_job):
    results, _ = regions_job
    outcomes = results["wrong credentials"]
    for message, latest in outcomes:
        assert message is not None and "region '1'" in message and "storage_options['1']" in message, message
        assert "wrong-secret" not in message
        assert latest == 1  # nothing lost: the previous checkpoint is still the latest
    core = {message.split(": ", 1)[-1] if message.startswith("rank ") else message for message, _ in outcomes}
    assert len(core) == 1


def test_a_lost_region_is_read_from_the_other_one_and_the_crossing_bytes_are_logged(regions_job):
    results, _ = regions_job
    for rank, (step, equal, crossed) in enumerate(results["lost region"]):
        assert step == 3 and equal, rank
        if rank == 0:
            assert len(crossed) == 1 and "from other regions (1: " in crossed[0], crossed  # one line, site 0's
        if rank == 2:
            assert crossed == ["site '1': this load reads 0 bytes from other regions"], crossed


def test_keys_held_only_by_an_unavailable_region_fail_every_rank_naming_the_region_and_the_fix(regions_job):
    results, _ = regions_job
    outcomes = results["only in a lost region"]
    for rank, message in enumerate(outcomes):
        assert message is not None, rank  # ranks 0 and 1 want nothing of region 1's, and fail with the others
        key = "rank_3" if rank == 3 else "rank_2"  # the failing rank its own error, the others the lowest's
        assert f"1 key(s) of checkpoint step_0000000004 ('{key}') are stored only in region(s) '1'" in message, message
        assert "unavailable (" in message and "storage_options['1']" in message and "MULTIDC_CKPT_URL" in message
    assert [m.startswith("rank 2: ") for m in outcomes] == [True, True, False, False]


def test_a_region_killed_mid_save_commits_nothing_and_the_previous_checkpoint_stays_latest(regions_job):
    results, _ = regions_job
    for outcome, steps in results["killed"]:
        assert outcome == "CheckpointSaveError"
        assert steps == [1]


def test_state_sharded_across_sites_is_refused_on_every_rank_naming_the_key(regions_job):
    results, _ = regions_job
    for error, steps in results["sharded across sites"]:
        assert "region-local checkpoint" in error and "'w'" in error and "fsdp_across_sites" in error, error
        assert steps == []  # nothing committed
