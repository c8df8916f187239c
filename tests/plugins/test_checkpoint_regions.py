"""Region-local checkpoints: one SeaweedFS S3 server per site (two on loopback), 2 sites x 2 gloo ranks.

Pure cases check the URL and ``replicas`` settings; in-process cases clean up after a regional commit; the
distributed cases save with 2 sites, load on 2 sites and on 1 site (2 ranks), lose a region's bucket (also after a
save with ``replicas=1`` of DiLoCo's per-site state), refuse one region's credentials, and kill a region's server
mid-save.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid

import pytest
import torch

from multidc.hierarchical.tools.seaweed import SeaweedS3
from multidc.plugins.checkpoint.object_store import ObjectStore, ObjectStoreError
from multidc.plugins.checkpoint.regions import Regions, path_key, replica_targets, site_urls, url_of
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


def test_a_mapping_as_text_with_a_file_name_joined_names_that_file_in_every_region():
    # ModelCheckpoint(dirpath={site: url}) joins its file names to the mapping's text, as to a directory
    text = f"{path_key({'us': 's3://b/x', 'eu': 's3://a/run/'})}/epoch=0-step=4.ckpt"
    assert url_of(text) == {"eu": "s3://a/run/epoch=0-step=4.ckpt", "us": "s3://b/x/epoch=0-step=4.ckpt"}
    assert url_of(path_key({"eu": "s3://a/run"})) == {"eu": "s3://a/run"}
    with pytest.raises(ValueError, match="starts like a mapping site -> URL but is not valid JSON"):
        url_of('{"eu": "s3://a/run"')


@pytest.mark.parametrize(("replicas", "regions", "expected"), [
    (0, ["a", "b"], {}),
    (None, ["a", "b"], {}),
    (1, ["a", "b"], {"a": ("b",), "b": ("a",)}),
    (1, ["a", "b", "c"], {"a": ("b",), "b": ("c",), "c": ("a",)}),
    (2, ["a", "b", "c"], {"a": ("b", "c"), "b": ("c", "a"), "c": ("a", "b")}),
])
def test_replicas_go_to_the_regions_after_each_site_in_site_order(replicas, regions, expected):
    assert replica_targets(replicas, regions) == expected


@pytest.mark.parametrize(("replicas", "regions", "message"), [
    (-1, ["a", "b"], r"replicas=-1 must be an int >= 0"),
    (True, ["a", "b"], r"replicas=True must be an int >= 0"),
    (2, ["a", "b"], r"replicas=2, but there are only 1 other region.*set it to at most 1"),
    (1, None, r"replicas=1 copies each site's own state to other regions, but the checkpoint URL names one store"),
])
def test_bad_replicas_are_refused_naming_the_setting_and_the_fix(replicas, regions, message):
    with pytest.raises(ValueError, match=message):
        replica_targets(replicas, regions)


def test_replicas_come_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("MULTIDC_CKPT_REPLICAS", "1")
    assert replica_targets(None, ["a", "b"]) == {"a": ("b",), "b": ("a",)}
    assert replica_targets(0, ["a", "b"]) == {}  # an argument wins
    assert replica_targets(None, None) == {}  # one store: the job's setting for its region-local checkpoints
    monkeypatch.setenv("MULTIDC_CKPT_REPLICAS", "3")
    with pytest.raises(ValueError, match=r"MULTIDC_CKPT_REPLICAS=3, but there are only 1 other region"):
        replica_targets(None, ["a", "b"])


# ----------------------------------------------------------------------------- in-process, two servers
@pytest.fixture
def two_regions(s3_server, s3_auth_server) -> Regions:
    """Two regions, each a fresh bucket on its own server (region '1' with credentials)."""
    tag = uuid.uuid4().hex[:10]
    urls = {"0": s3_server.make_bucket(f"c0-{tag}") + "/run", "1": s3_auth_server.make_bucket(f"c1-{tag}") + "/run"}
    options = {"0": s3_server.storage_options(), "1": s3_auth_server.storage_options()}
    return Regions(urls, options, local="0")


def _refusing(monkeypatch, store: ObjectStore, method: str, key: str) -> None:
    """``store.<method>(key)`` raises (the server refused); every other call goes through."""
    real = getattr(ObjectStore, method)

    def refuse(self, k, *args, **kwargs):
        if self is store and k == key:
            raise ObjectStoreError(f"injected: {method} {k} refused")
        return real(self, k, *args, **kwargs)

    monkeypatch.setattr(ObjectStore, method, refuse)


def test_clean_up_after_a_regional_commit_names_the_region_it_could_not_clean(two_regions, monkeypatch, caplog):
    for store in two_regions.stores.values():  # step 2 committed in both regions; a half-written step 1 in both
        store.put("step_0000000002/COMMIT.json", b"{}")
        store.put("step_0000000001/data/rank00000.distcp", b"half-written")
    _refusing(monkeypatch, two_regions.stores["1"], "delete_tree", "step_0000000001")
    with caplog.at_level(logging.WARNING, logger="multidc.plugins.checkpoint"):
        two_regions.clean("step_0000000002", {"0": set(), "1": set()}, keep_last_k=None, supersede=False)
    warnings = [r.getMessage() for r in caplog.records if "cleaning up after it failed" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("checkpoint region '1': ") and "left behind: half-written region '1': " in \
        warnings[0] and "injected: delete_tree step_0000000001 refused" in warnings[0], warnings[0]
    assert two_regions.stores["0"].list_files("step_0000000001") == []  # region 0 was cleaned
    assert two_regions.stores["1"].list_files("step_0000000001") == ["data/rank00000.distcp"]


def test_a_superseded_record_left_in_one_region_fails_the_clean_up_naming_that_region(two_regions, monkeypatch):
    for store in two_regions.stores.values():  # a rewound run saved step 1 over a committed step 3
        for name in ("step_0000000001", "step_0000000003"):
            store.put(f"{name}/COMMIT.json", b"{}")
    _refusing(monkeypatch, two_regions.stores["1"], "delete", "step_0000000003/COMMIT.json")
    with pytest.raises(RuntimeError, match=r"^region '1': .*step_0000000001 .*is committed, but checkpoints it was to "
                                           r"supersede .* still committed.*region '1': .*step_0000000003"):
        two_regions.clean("step_0000000001", {"0": set(), "1": set()}, keep_last_k=None, supersede=True)
    assert not two_regions.stores["0"].exists("step_0000000003/COMMIT.json")


@pytest.mark.parametrize("call", ["save", "load"])
@pytest.mark.parametrize("form", ["template", "mapping"])
def test_lightning_checkpoint_io_refuses_a_site_template_naming_the_strategies_and_checkpointer(call, form, tmp_path):
    pytest.importorskip("lightning")
    from multidc.plugins import ObjectStoreCheckpointIO

    io = ObjectStoreCheckpointIO()
    if form == "template":
        path = str(tmp_path / "region-{site}" / "epoch=0-step=1.ckpt")
    else:  # a ModelCheckpoint(dirpath=mapping)'s path: the mapping's text, the file name joined
        path = path_key({"0": str(tmp_path / "region-0"), "1": str(tmp_path / "region-1")}) + "/epoch=0-step=1.ckpt"
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
    import torch.distributed as dist

    ckpt, site = _checkpointer(rank, world, urls, options)
    state = {"w": _state(rank, site)["w"], "meta": {"step": 5}}
    ckpt.save(state, step=3)
    dist.barrier()
    if rank == 0:  # region 0's bucket is gone
        _drop_bucket(urls["0"], options["0"])
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
    import torch.distributed as dist

    from multidc.plugins import CheckpointRegionUnavailableError

    ckpt, site = _checkpointer(rank, world, urls, options)
    ckpt.save(_state(rank, site), step=4)
    dist.barrier()
    if rank == 0:
        _drop_bucket(urls["1"], options["1"])
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


def _drop_bucket(url: str, options: dict) -> None:
    """A region's store is lost: its bucket and everything in it."""
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    bucket = url.removeprefix("s3://").split("/")[0]
    fs.rm(bucket, recursive=True)
    if fs.exists(bucket):
        fs.rmdir(bucket)


def _diloco_job(topology, seed: int):
    """A site-DDP model under DiLoCo with the top-k codec (per-site models, per-rank residuals); ``seed`` its init."""
    from torch.nn.parallel import DistributedDataParallel

    from multidc.hierarchical import DiLoCo, DiLoCoConfig, register_site_ddp_hook

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(model)
    register_site_ddp_hook(ddp, topology)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    return model, ddp, optimizer, DiLoCo(ddp, optimizer, topology, DiLoCoConfig(sync_every=2, compression="topk"))


def _diloco_snapshot(model, diloco) -> dict:
    state = diloco.state_dict()
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "global": {k: v.clone() for k, v in state["global"].items()},
            "residuals": [fragment.residual.clone() for fragment in diloco._fragments]}


def _replicated_site_state(rank, world, urls, options):
    """DiLoCo with per-site models saved with ``replicas=1``; region 1's store is lost; a fresh job loads."""
    import torch.distributed as dist

    from multidc.hierarchical import Topology
    from multidc.plugins import Checkpointer, ModelState, RetryPolicy

    topology = Topology.build(site=rank * 2 // world)
    model, ddp, optimizer, diloco = _diloco_job(topology, seed=0)
    for t in range(3):  # a sync after step 2, then one more step: the site models differ, residuals are set
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + t))
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
    retry = RetryPolicy(attempts=2, initial_backoff_s=0.05)
    ckpt = Checkpointer(urls, storage_options=options, stripe_min_mb=0, topology=topology, retry=retry, replicas=1)
    site_key = f"site_{topology.site}"
    ckpt.save({"diloco": diloco, site_key: ModelState(ddp, optimizer)}, step=1)
    saved = _diloco_snapshot(model, diloco)
    listing = _listing(urls, options) if rank == 0 else None
    diloco.close()
    dist.barrier()
    if rank == 0:
        _drop_bucket(urls["1"], options["1"])
    dist.barrier()
    lines = _capture()
    model, ddp, optimizer, diloco = _diloco_job(topology, seed=1)  # other weights until the load
    ckpt.load({"diloco": diloco, site_key: ModelState(ddp, optimizer)})
    ckpt.close()
    loaded = _diloco_snapshot(model, diloco)
    diloco.close()
    same = {"model": all(torch.equal(loaded["model"][k], v) for k, v in saved["model"].items()),
            "global": all(torch.equal(loaded["global"][k], v) for k, v in saved["global"].items()),
            "residuals": all(torch.equal(a, b) for a, b in zip(loaded["residuals"], saved["residuals"], strict=True)),
            "residuals set": any(bool(r.abs().sum()) for r in saved["residuals"])}
    return same, [line for line in lines.lines if "other regions" in line], listing


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

    main, lost, only, killed, sharded, replicated = pair(), pair(), pair(), pair(victim), pair(), pair()
    bad = s3_auth_server.storage_options(key="MDCTESTACCESSKEY", secret="wrong-secret")
    cases = {
        "save and load": (_save_and_load, (main, options)),
        "wrong credentials": (_wrong_credentials, (main, options, bad)),
        "replicas": (_replicated_site_state, (replicated, options)),
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


def test_a_sites_own_diloco_state_saved_with_replicas_loads_from_another_region_when_its_own_is_lost(regions_job):
    results, _ = regions_job
    outcomes = results["replicas"]
    for rank, (same, crossed, _) in enumerate(outcomes):
        assert all(same.values()), (rank, same)  # site model, DiLoCo's global copy, this rank's top-k residuals
        if rank == 0:
            assert crossed == ["site '0': this load reads 0 bytes from other regions"], crossed
        if rank == 2:  # site 1 read everything from region 0: the copies of its own state, and the rest
            assert len(crossed) == 1 and "site '1': this load reads" in crossed[0] and "(0: " in crossed[0], crossed
    listing = outcomes[0][2]
    # each region: its own ranks' shards, the other site's ranks' copies of their site's own state, the record
    for site, own, copies in (("0", (0, 1), (2, 3)), ("1", (2, 3), (0, 1))):
        assert listing[site] == sorted(["step_0000000001/COMMIT.json",
                                        *(f"step_0000000001/data/rank{r:05d}.distcp" for r in own),
                                        *(f"step_0000000001/data/copy-rank{r:05d}.distcp" for r in copies)]), site
