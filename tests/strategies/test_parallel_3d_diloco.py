"""DiLoCo under 3D parallelism (``cross_site="diloco"``) against tests/diloco_reference.py's single-process
computation: sites2 x dp_shard2, sites2 x tp2, sites2 x dp_replicate2 (also a self-sharded module, adopted) and
sites2 x pp2 on 4 gloo ranks through the framework-free layer (``parallelize`` / ``adopt_sharded`` +
``build_diloco``), and sites2 x tp2 through a Lightning ``Trainer`` with
``Parallel3DStrategy`` (tests/strategies/_parallel_3d_diloco_script.py), with a resume from a checkpoint saved
while a sync is in flight; in the same launches sites2 x dp_shard2 with the top-k codec (against the codec applied
by hand to each FSDP2 shard, residuals included), its resume, and resumes across codecs (none -> topk, topk ->
int8). No collective of an inner step spans sites; bad settings raise clear ValueErrors.

Tolerance: 1e-6 absolute on every parameter (SGD inner optimizer, float32; only reduction orders differ).
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

from multidc.hierarchical.tools.ranks import run_ranks
from tests import _launch
from tests._gpt_diloco import LR, full, model, rows
from tests._resources import require_module
from tests._tiny_models import loss_fn
from tests._topk_by_hand import TopKByHand
from tests.diloco_reference import run_reference

CASES = {
    "sites2xdp_shard2": dict(layout=dict(num_sites=2, dp_shard=2), config=dict(sync_every=4), meter=True),
    "sites2xtp2": dict(layout=dict(num_sites=2, dp_shard=1, tensor_parallel_size=2), tp="transformer",
                       config=dict(sync_every=4), meter=True),
    # the site's replicas averaged over their own group while fragments sync on the worker thread (overlap)
    "sites2xdp_replicate2": dict(layout=dict(num_sites=2, dp_replicate=2, dp_shard=1),
                                 config=dict(sync_every=4, fragments=2, overlap_steps=1)),
    # fragments by the block's index in the whole model: each stage syncs its part of fragment p at p's step
    "sites2xpp2": dict(layout=dict(num_sites=2, pipeline_parallel_size=2, dp_shard=1),
                       pipeline=dict(schedule="gpipe", microbatches=2), config=dict(sync_every=4, fragments=2),
                       meter=True),
    # a module that shards itself over "data_parallel" (ModelParallelStrategy style), adopted: adopt_sharded
    "self_sharded_sites2xdp_replicate2": dict(layout=dict(num_sites=2, dp_replicate=2, dp_shard=1),
                                              config=dict(sync_every=4), self_sharded=True, meter=True),
    # unequal sites: dp_shard 3 and 1 (uneven FSDP2 chunks), each site weighs its samples (3:1)
    "sites3+1": dict(layout=dict(site_sizes=(3, 1)), config=dict(sync_every=4), meter=True),
    # three sites, dp_shard 2, 1, 1, streaming with overlap (2:1:1)
    "sites2+1+1_streaming": dict(layout=dict(site_sizes=(2, 1, 1)),
                                 config=dict(sync_every=4, fragments=2, overlap_steps=1)),
}
# 6 ranks: sites of 4 + 2 ranks with tensor parallelism 2 (dp_shard 2 and 1): a column of ranks per tensor shard
# (pipeline stages make columns the same way; their syncs are those of equal sites, tested above)
SIX_RANK_CASES = {
    "sites4+2xtp2": dict(layout=dict(site_sizes=(4, 2), tensor_parallel_size=2), tp="transformer",
                         config=dict(sync_every=4), meter=True),
}
STEPS = 10  # syncs at 4 and 8 (fragments: 2, 4, 6, 8, 10); local and global differ at the end






def site_batch(replicas: int, site: int, step: int):
    """A site's whole batch: its ``replicas`` data-parallel replicas' rows together (equal rows, mean loss)."""
    parts = [rows(site, local, step) for local in range(replicas)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def reference(replicas: list[int], steps: int, config: dict) -> dict:
    """Site ``s`` trains ``replicas[s]`` replicas' rows a step and weighs as many samples (the default weighting)."""
    return run_reference(
        model(), sites=len(replicas), steps=steps, batch=lambda s, t: site_batch(replicas[s], s, t), loss_fn=loss_fn,
        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR), blocks=lambda m: m.blocks(),
        site_weights=[float(r) for r in replicas], **config,
    )




class CrossSiteCalls:
    """Counts calls of ``torch.distributed`` collectives and point-to-point ops that reach a rank of another site
    (FSDP2, the pipeline, the replica average, clipping and DiLoCo go through these; tensor-parallel DTensor ops go
    through functional collectives on the ``tp`` group, which the layout keeps inside the site). ``isend`` /
    ``irecv`` stay as they are (``P2POp`` checks their identity); the pipeline sends through ``batch_isend_irecv``."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "reduce_scatter", "broadcast", "reduce", "all_to_all_single", "all_to_all",
             "gather", "scatter", "send", "recv", "batch_isend_irecv", "barrier",
             "all_gather_object", "broadcast_object_list")

    def __init__(self, site_of) -> None:
        self.site_of, self.calls, self._saved = site_of, 0, {}
        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original
            setattr(dist, name, self._counting(name, original))

    def _site(self, rank: int) -> int:
        return self.site_of(rank)

    def _crosses(self, name: str, bound: dict) -> bool:
        mine = self._site(dist.get_rank())
        if name == "batch_isend_irecv":
            return any(self._site(op.peer) != mine for op in bound["p2p_op_list"])
        if name in ("send", "recv"):
            peer = bound.get("dst", bound.get("src"))
            return peer is not None and self._site(peer) != mine
        ranks = dist.get_process_group_ranks(bound.get("group") or dist.group.WORLD)
        return len({self._site(r) for r in ranks}) > 1

    def _counting(self, name: str, original):
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            if self._crosses(name, signature.bind_partial(*args, **kwargs).arguments):
                self.calls += 1
            return original(*args, **kwargs)

        return counted

    def close(self) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _train_case(rank: int, world: int, case: dict) -> dict:
    from multidc.hierarchical import DiLoCoConfig, WanConfig
    from multidc.hierarchical.parallel import build_diloco, data_parallel_coordinate, parallelize
    from multidc.hierarchical.parallel.layout import ParallelLayout
    from multidc.hierarchical.parallel.parallelize import layout_of
    from multidc.hierarchical.parallel.pipeline import PipelineConfig

    mesh = ParallelLayout(**case["layout"]).build_mesh()
    layout = layout_of(mesh)  # the job's (on unequal sites, the mesh is this site's)
    net, wan = model(), WanConfig(chunk_mb=0.001, streams=2)
    pipeline = PipelineConfig(**case["pipeline"]) if "pipeline" in case else None
    unsharded_error = None
    if case.get("self_sharded"):
        pm, unsharded_error = _self_sharded(net, mesh, wan)
    else:
        pm = parallelize(net, mesh, blocks=net.blocks(), tensor_parallel=case.get("tp"), pipeline=pipeline, wan=wan,
                         cross_site="diloco")
    opt = torch.optim.SGD(list(pm.parameters()), lr=LR)
    diloco = build_diloco(pm, opt, DiLoCoConfig(**case["config"]))
    index, _ = data_parallel_coordinate(mesh)
    site, replicas = layout.site_of(rank), [layout.dp_replicate * d for d in layout.dp_shards]
    local_index = index - sum(replicas[:site])
    meter = CrossSiteCalls(layout.site_of) if case.get("meter") else None
    sent, crossing, norms = [], [], []
    for t in range(1, STEPS + 1):
        before = (pm.topology.wan_stats.snapshot()["bytes_sent"], meter.calls if meter else 0)
        pm.step(*rows(site, local_index, t), loss_fn)
        norms.append(pm.clip_grad_norm_(1e9).item())  # no change (coefficient 1): the site's own norm
        if t == STEPS and pm.pipeline is None:
            grads = full((n, p.grad) for n, p in net.named_parameters())
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item())
        opt.step()
        opt.zero_grad()
        sent.append(pm.topology.wan_stats.snapshot()["bytes_sent"] - before[0])
        crossing.append((meter.calls if meter else 0) - before[1])
    if meter:
        meter.close()
    with diloco.global_parameters():
        glob = full(net.named_parameters())
    local = full(net.named_parameters())
    diloco.close()
    return {"site": site, "replicas": replicas, "local": local, "global": glob, "sent": sent, "crossing": crossing,
            "norms": norms, "stats": vars(diloco.stats), "unsharded_error": unsharded_error}


def _self_sharded(net, mesh, wan):
    """``fully_shard`` over ``mesh["data_parallel"]`` as a ModelParallelStrategy ``configure_model`` writes it
    (kept inside each site by ``data_parallel_within_sites``), then ``adopt_sharded``, as Parallel3DStrategy does."""
    from torch.distributed.fsdp import fully_shard

    from multidc.hierarchical.parallel import adopt_sharded
    from multidc.hierarchical.parallel.data_parallel import data_parallel_within_sites
    from multidc.hierarchical.parallel.layout import submesh

    with data_parallel_within_sites(mesh):
        for block in net.blocks():
            fully_shard(block, mesh=submesh(mesh, "data_parallel"))
        fully_shard(net, mesh=submesh(mesh, "data_parallel"))
    pm = adopt_sharded(net, mesh, wan=wan, cross_site="diloco")
    try:  # an unsharded module: nothing would keep a site's replicas equal
        adopt_sharded(model(), mesh, wan=wan, cross_site="diloco")
    except ValueError as exc:
        return pm, str(exc)
    return pm, None


def _six_rank_cases(rank: int, world: int) -> dict:
    return {name: _train_case(rank, world, case) for name, case in SIX_RANK_CASES.items()}


def _all_cases(rank: int, world: int, names: list[str]) -> dict:
    results = {name: _train_case(rank, world, {**CASES, **SIX_RANK_CASES}[name]) for name in names}
    results["errors"] = _bad_settings(rank)
    results["unequal_errors"] = _unequal_refusals(rank)
    return results


def _unequal_refusals(rank: int) -> list[str]:
    """What unequal sites refuse, on every rank alike: each case's ValueError (or "")."""
    from multidc.hierarchical import DiLoCoConfig
    from multidc.hierarchical.parallel import build_diloco, parallelize
    from multidc.hierarchical.parallel.layout import ParallelLayout

    def attempt(env: dict, build) -> str:
        os.environ.update(env)
        try:
            build()
            return ""
        except ValueError as exc:
            return str(exc)
        finally:
            for name in env:
                del os.environ[name]

    site = {"MULTIDC_SITE": "aaab"[rank]}
    unequal = ParallelLayout(site_sizes=(3, 1)).build_mesh
    return [
        attempt({}, lambda: parallelize(model(), unequal(), cross_site="allreduce")),
        attempt({}, lambda: build_diloco(parallelize(net := model(), unequal(), cross_site="diloco"),
                                         torch.optim.SGD(net.parameters(), lr=LR),
                                         DiLoCoConfig(sync_every=4, compression="topk"))),
        attempt({**site, "MULTIDC_PP_SIZE": "2" if rank < 3 else "1"}, lambda: ParallelLayout().build_mesh()),
        attempt({**site, "MULTIDC_TP_SIZE": "1" if rank < 3 else "2"}, lambda: ParallelLayout().build_mesh()),
        attempt(site, lambda: ParallelLayout(tensor_parallel_size=2).build_mesh()),
        attempt(site, lambda: ParallelLayout(dp_shard=1).build_mesh()),
    ]


def _bad_settings(rank: int) -> list[str]:
    """What build_diloco raises, on every rank alike, for settings that cannot work."""
    from multidc.hierarchical import DiLoCoConfig
    from multidc.hierarchical.parallel import build_diloco, parallelize
    from multidc.hierarchical.parallel.layout import ParallelLayout
    from multidc.hierarchical.parallel.pipeline import PipelineConfig

    mesh = ParallelLayout(num_sites=2, pipeline_parallel_size=2, dp_shard=1).build_mesh()
    messages = []
    for cross_site, config in (("allreduce", dict(sync_every=4)),  # not placed for DiLoCo
                               ("diloco", dict(sync_every=4, fragments=3)),  # 2 blocks a stage, 3 fragments
                               ("diloco", dict(sync_every=4 + rank % 2))):  # ranks disagree
        net = model()
        pm = parallelize(net, mesh, blocks=net.blocks(), pipeline=PipelineConfig(schedule="gpipe"),
                         cross_site=cross_site)
        try:
            build_diloco(pm, torch.optim.SGD(list(pm.parameters()), lr=LR), DiLoCoConfig(**config))
            messages.append("")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


@pytest.fixture(scope="module")
def framework_free():
    """Every case in one spawn of 4 ranks (starting ranks is the slow part): {case: per-rank results}."""
    per_rank = run_ranks(_all_cases, 4, list(CASES), timeout=300)
    return {name: [r[name] for r in per_rank] for name in [*CASES, "errors", "unequal_errors"]}


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", list(CASES))
def test_3d_diloco_equals_the_single_process_reference(framework_free, name):
    results = framework_free[name]
    ref = reference(results[0]["replicas"], STEPS, CASES[name]["config"])
    merged_local: dict = {site: {} for site in range(len(results[0]["replicas"]))}
    for r in results:  # under pipeline parallelism each rank holds its stage's parameters
        for key, value in r["global"].items():
            torch.testing.assert_close(value, ref["global"][key], rtol=0, atol=1e-6, msg=key)
        merged_local[r["site"]].update(r["local"])
        for key, value in r["local"].items():
            torch.testing.assert_close(value, ref["local"][r["site"]][key], rtol=0, atol=1e-6, msg=key)
        assert r["stats"]["inner_steps"] == STEPS
    for site, names in merged_local.items():
        assert set(names) == set(ref["local"][site])
    if CASES[name]["layout"].get("site_sizes"):  # each rank took its shard of one average: all equal, bitwise
        for r in results[1:]:
            assert all(torch.equal(r["global"][k], v) for k, v in results[0]["global"].items())


@pytest.mark.timeout(360)
def test_unequal_sites_with_tensor_parallelism_equal_the_reference():
    """Sites of 4 + 2 ranks under tp2 (FSDP2 over TP: strided shards): each tensor shard syncs over its own column
    of ranks, nothing crosses sites on inner steps, and every rank equals the reference weighted 2:1."""
    per_rank = run_ranks(_six_rank_cases, 6, timeout=300)
    for name, case in SIX_RANK_CASES.items():
        results = [r[name] for r in per_rank]
        ref = reference(results[0]["replicas"], STEPS, case["config"])
        assert results[0]["replicas"] == [2, 1]
        for r in results:
            for kind, expected in (("global", ref["global"]), ("local", ref["local"][r["site"]])):
                for key, value in r[kind].items():
                    torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6, msg=f"{name} {kind} {key}")
            if case.get("meter"):
                assert [t for t, c in enumerate(r["crossing"], start=1) if c] == [4, 8], (name, r["crossing"])


@pytest.mark.timeout(360)
def test_unequal_sites_send_the_wan_bytes_of_equal_sites(framework_free):
    """Sites of 3 + 1 ranks send, per site, what sites of 2 + 2 send (the same model and syncs): each site the
    fragment once, however many ranks it has."""
    def per_site(results):
        sent = {}
        for r in results:
            sent[r["site"]] = sent.get(r["site"], 0) + sum(r["sent"])
        return sent

    equal, unequal = per_site(framework_free["sites2xdp_shard2"]), per_site(framework_free["sites3+1"])
    assert equal[0] > 0 and unequal == equal, (unequal, equal)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.get("meter")])
def test_nothing_crosses_sites_on_inner_steps(framework_free, name):
    """No torch.distributed call of an inner step (forward, backward, FSDP, pipeline, clipping, optimizer) reaches
    another site; the sync steps do, and only they send WAN bytes."""
    config = CASES[name]["config"]
    every = config["sync_every"] // config.get("fragments", 1)
    syncs = [t for t in range(1, STEPS + 1) if t % every == 0]
    sending: dict = {}  # per site: the steps some rank sent WAN bytes (on unequal sites only the rails send)
    for r in framework_free[name]:
        assert [t for t, c in enumerate(r["crossing"], start=1) if c] == syncs, r["crossing"]
        sending.setdefault(r["site"], set()).update(t for t, b in enumerate(r["sent"], start=1) if b)
    assert all(sorted(steps) == syncs for steps in sending.values()), sending


@pytest.mark.timeout(360)
def test_clipping_takes_each_sites_own_norm(framework_free):
    for name in ("sites2xdp_shard2", "sites2xtp2"):
        results = framework_free[name]
        for r in results:
            assert abs(r["norms"][-2] - r["norms"][-1]) <= 1e-5 * r["norms"][-1], (name, r["norms"][-2:])
        by_site = {r["site"]: r["norms"][-1] for r in results}
        assert abs(by_site[0] - by_site[1]) > 1e-3, by_site  # the sites' data differ: so do their norms


@pytest.mark.timeout(360)
def test_bad_settings_raise_the_same_clear_error_on_every_rank(framework_free):
    per_rank = framework_free["errors"]
    assert all(messages == per_rank[0] for messages in per_rank), per_rank
    not_diloco, too_many, disagree = per_rank[0]
    for r in framework_free["self_sharded_sites2xdp_replicate2"]:
        assert "no FSDP unit of TinyGPT is sharded over the data-parallel mesh" in r["unsharded_error"]
    assert "cross_site='diloco'" in not_diloco
    assert "fragments=3" in too_many and "fewest blocks a stage holds" in too_many
    assert "disagree on the DiLoCo settings" in disagree


@pytest.mark.timeout(360)
def test_unequal_sites_refuse_what_cannot_work_with_the_same_clear_error_on_every_rank(framework_free):
    per_rank = framework_free["unequal_errors"]
    assert all(messages == per_rank[0] for messages in per_rank), per_rank
    allreduce, topk, pp, tp, not_multiple, dp_shard = per_rank[0]
    assert "sites differ in size" in allreduce and "cross_site='diloco'" in allreduce, allreduce
    assert "compression='topk'" in topk and "unequal sites" in topk, topk
    assert "pipeline_parallel_size: 2 on ranks [0, 1, 2] (site 'a'), 1 on ranks [3] (site 'b')" in pp, pp
    assert "tensor_parallel_size: 1 on ranks [0, 1, 2] (site 'a'), 2 on ranks [3] (site 'b')" in tp, tp
    assert "blocks of [3, 1] ranks" in not_multiple and "not a multiple of" in not_multiple, not_multiple
    assert "leave dp_shard and MULTIDC_DP_SHARD unset" in dp_shard, dp_shard


def test_parallelize_takes_allreduce_or_diloco_only():
    from multidc.hierarchical.parallel.diloco import check_cross_site

    assert [check_cross_site(v) for v in ("allreduce", "diloco")] == ["allreduce", "diloco"]
    for bad in ("DiLoCo", None, "ring"):
        with pytest.raises(ValueError, match=f"cross_site={bad!r}: choose 'allreduce'"):
            check_cross_site(bad)


# ------------------------------------------------------------------------------------------------ Lightning

TRAINER_CONFIG = {"sync_every": 4, "fragments": 2, "overlap_steps": 1}
TRAINER_STEPS, PER_EPOCH = 11, 6  # a sync starts at step 6 and merges at 7: in flight at the save
# on sites2 x dp_shard2 (tp 1): each rank its own shard; alpha 0, as top-k with overlap requires
TOPK_CONFIG = {**TRAINER_CONFIG, "compression": "topk", "alpha": 0.0}
UNEQUAL = "aaab"  # MULTIDC_SITE per rank: sites of 3 + 1 ranks, dp_shard 3 and 1
_LAUNCH = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def _trainer_run(out_dir, root, *extra: str, fits: tuple = ()) -> dict:
    script = os.path.join(os.path.dirname(__file__), "_parallel_3d_diloco_script.py")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTIDC_") and k not in _LAUNCH}
    argv = [sys.executable, script, "--config", json.dumps(TRAINER_CONFIG), "--max-steps", str(TRAINER_STEPS),
            "--steps-per-epoch", str(PER_EPOCH), "--root", str(root), "--out", str(out_dir),
            "--fits", json.dumps(fits), *extra]
    code, log = _launch.run_script(argv, {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, 300)
    assert code == 0, log[-6000:]
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]
    weights = [torch.load(out_dir / f"weights_rank{r}.pt") for r in range(4)]
    with open(out_dir / "log" / "version_0" / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    more = {fit["name"]: [torch.load(out_dir / f"{fit['name']}_rank{r}.pt") for r in range(4)] for fit in fits}
    return {"ranks": ranks, "weights": weights, "metrics": metrics, "fits": more, "log": log}


def _fit(name: str, config: dict, tp: int, root, ckpt_path=None, sites: str = "") -> dict:
    return {"name": name, "config": config, "tp": tp, "root": str(root), "ckpt_path": ckpt_path and str(ckpt_path),
            "sites": sites}


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Two launches of 4 ranks: the sites2 x tp2 run, then (same processes) sites2 x dp_shard2 with top-k; the
    resumed ones from their step-6 checkpoints, then the cross-codec resumes (none -> topk on tp2's checkpoint,
    topk -> int8 on dp_shard2's)."""
    require_module("lightning", "lightning")
    tmp = tmp_path_factory.mktemp("p3d_diloco")
    step = f"ckpts/epoch=0-step={PER_EPOCH}.ckpt"
    unbroken = _trainer_run(tmp / "unbroken", tmp / "root", fits=(_fit("topk", TOPK_CONFIG, 1, tmp / "topk"),
                                                                  _fit("unequal", TRAINER_CONFIG, 1, tmp / "unequal",
                                                                       sites=UNEQUAL)))
    resumed = _trainer_run(tmp / "resumed", tmp / "root2", "--ckpt-path", str(tmp / "root" / step), "--validate",
                           fits=(_fit("topk", TOPK_CONFIG, 1, tmp / "topk2", tmp / "topk" / step),
                                 _fit("none_to_topk", TOPK_CONFIG, 2, tmp / "cross1", tmp / "root" / step),
                                 _fit("topk_to_int8", {**TRAINER_CONFIG, "compression": "int8"}, 1, tmp / "cross2",
                                      tmp / "topk" / step),
                                 _fit("unequal", TRAINER_CONFIG, 1, tmp / "unequal2", tmp / "unequal" / step,
                                      sites=UNEQUAL)))
    return unbroken, resumed


@pytest.mark.timeout(700)
def test_trainer_sites2_tp2_equals_the_reference_and_logs_wan_metrics(trainer_runs):
    unbroken, _ = trainer_runs
    ref = run_reference(
        model(), sites=2, steps=TRAINER_STEPS, loss_fn=loss_fn, blocks=lambda m: m.blocks(),
        batch=lambda s, t: rows(s, 0, (t - 1) % PER_EPOCH + 1),  # one data-parallel replica a site (tp 2)
        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR), **TRAINER_CONFIG,
    )
    for rank, weights in zip(unbroken["ranks"], unbroken["weights"]):
        assert rank["global_step"] == TRAINER_STEPS and rank["stats"]["inner_steps"] == TRAINER_STEPS
        for kind, expected in (("local", ref["local"][rank["site"]]), ("global", ref["global"])):
            assert set(weights[kind]) == set(expected)
            for name, value in weights[kind].items():
                torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=f"{kind} {name}")
    rows_logged = [r for r in unbroken["metrics"] if r.get("wan/outer_syncs")]
    assert len(rows_logged) == TRAINER_STEPS
    merged = [int(r["step"]) for r in rows_logged if float(r["wan/outer_syncs"]) > 0]
    sent = [int(r["step"]) for r in rows_logged if float(r["wan/bytes_sent"]) > 0]
    assert len(merged) == 5 and sent == merged  # syncs start at 2, 4, 6, 8, 10 and merge one step later


@pytest.mark.timeout(700)
def test_trainer_resume_with_a_sync_in_flight_ends_like_the_unbroken_run(trainer_runs):
    unbroken, resumed = trainer_runs
    for a, b, ra, rb in zip(unbroken["weights"], resumed["weights"], unbroken["ranks"], resumed["ranks"]):
        assert ra["site"] == rb["site"] and rb["global_step"] == TRAINER_STEPS
        assert (ra["batches_run"], rb["batches_run"]) == (TRAINER_STEPS, TRAINER_STEPS - PER_EPOCH)  # resumed
        for kind in ("local", "global"):
            for name in a[kind]:
                assert torch.equal(a[kind][name], b[kind][name]), (kind, name)
        # a fresh Trainer's validate(ckpt_path=) loads each site's own model, as the resumed fit did
        assert set(b["validated"]) == set(b["start"])
        for name, value in b["start"].items():
            assert torch.equal(b["validated"][name], value), name


@pytest.mark.timeout(700)
def test_trainer_sites2_dp_shard2_with_topk_equals_the_codec_applied_by_hand_per_shard(trainer_runs):
    """Each FSDP2 rank syncs its own shard's pieces, top-k with its own residual (error feedback): the residuals
    are compared too, so a run without error feedback could not pass."""
    unbroken, _ = trainer_runs
    by_hand = TopKByHand(TOPK_CONFIG["compression"], site_size=1, shards=2)
    ref = run_reference(
        model(), sites=2, steps=TRAINER_STEPS, loss_fn=loss_fn, blocks=lambda m: m.blocks(), compress=by_hand,
        keep_in_flight=True, batch=lambda s, t: site_batch(2, s, (t - 1) % PER_EPOCH + 1),
        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        **{k: v for k, v in TOPK_CONFIG.items() if k != "compression"},
    )
    for rank, run in enumerate(unbroken["fits"]["topk"]):
        site, shard = divmod(rank, 2)  # the mesh [site, pp, dp_replicate, dp_shard, tp] = [2, 1, 1, 2, 1]
        assert run["info"]["site"] == site and run["info"]["stats"]["outer_syncs"] == 5
        for kind, expected in (("local", ref["local"][site]), ("global", ref["global"])):
            for name, value in run[kind].items():
                torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=f"{kind} {name}")
        assert sorted(run["residual"]) == ["fragment_0", "fragment_1"]
        for fragment, residual in run["residual"].items():
            expected = by_hand.residual(int(fragment.removeprefix("fragment_")), site, 0, shard=shard)
            torch.testing.assert_close(residual, expected, rtol=0, atol=1e-6, msg=fragment)
            assert residual.abs().sum() > 0


@pytest.mark.timeout(700)
def test_trainer_topk_resume_restores_every_ranks_residual_and_ends_like_the_unbroken_run(trainer_runs):
    unbroken, resumed = trainer_runs
    starts = []
    for a, b in zip(unbroken["fits"]["topk"], resumed["fits"]["topk"]):
        assert (b["info"]["global_step"], b["info"]["batches_run"]) == (TRAINER_STEPS, TRAINER_STEPS - PER_EPOCH)
        for kind in ("local", "global", "residual"):
            for name in a[kind]:
                assert torch.equal(a[kind][name], b[kind][name]), (kind, name)
        assert all(r.abs().sum() > 0 for r in b["start_residual"].values())  # saved mid-run: not zero
        starts.append(b["start_residual"]["fragment_0"].sum().item())
    assert len(set(starts)) == 4, "each rank resumes its own residual"


@pytest.mark.timeout(700)
def test_trainer_resumes_across_codecs_residuals_restart_at_zero(trainer_runs):
    """A checkpoint saved without top-k resumes with it (the residuals start at zero, logged); one saved with top-k
    resumes with int8 (its residuals are not read). The weights are the checkpoint's either way."""
    unbroken, resumed = trainer_runs
    for cross, same in (("none_to_topk", resumed["weights"]), ("topk_to_int8", resumed["fits"]["topk"])):
        for run, reference_start in zip(resumed["fits"][cross], same):
            assert run["info"]["global_step"] == TRAINER_STEPS, cross
            for name, value in run["start"].items():
                assert torch.equal(value, reference_start["start"][name]), (cross, name)
    for run in resumed["fits"]["none_to_topk"]:
        assert sorted(run["start_residual"]) == ["fragment_0", "fragment_1"]
        assert all(not r.any() for r in run["start_residual"].values())
        assert all(r.any() for r in run["residual"].values())  # and top-k ran on
    assert all(run["residual"] == {} for run in resumed["fits"]["topk_to_int8"])
    assert resumed["log"].count("DiLoCo error-feedback residual(s) are not in this checkpoint") == 4  # a rank each


def test_strategy_settings_that_cannot_work_fail_at_construction(monkeypatch):
    require_module("lightning", "lightning")
    from multidc.hierarchical import DiLoCoConfig
    from multidc.strategies import Parallel3DStrategy

    for name in [n for n in os.environ if n.startswith("MULTIDC_")]:
        monkeypatch.delenv(name)
    config = DiLoCoConfig(sync_every=4)
    with pytest.raises(ValueError, match="MULTIDC_DILOCO_SYNC_EVERY"):
        Parallel3DStrategy(cross_site="diloco")
    with pytest.raises(ValueError, match="Parallel3DStrategy.cross_site='mesh': choose 'allreduce'"):
        Parallel3DStrategy(cross_site="mesh")
    with pytest.raises(ValueError, match="Parallel3DStrategy.diloco is set but cross_site is 'allreduce'"):
        Parallel3DStrategy(diloco=config)
    with pytest.raises(ValueError, match="fsdp_across_sites=True"):
        Parallel3DStrategy(cross_site="diloco", diloco=config, fsdp_across_sites=True)
    with pytest.raises(ValueError, match="save_distributed_checkpoint=True"):
        Parallel3DStrategy(cross_site="diloco", diloco=config, save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="must be a multidc.hierarchical.DiLoCoConfig"):
        Parallel3DStrategy(cross_site="diloco", diloco={"sync_every": 4})
    monkeypatch.setenv("MULTIDC_CROSS_SITE", "diloco")
    monkeypatch.setenv("MULTIDC_DILOCO_SYNC_EVERY", "8")
    strategy = Parallel3DStrategy()
    assert strategy.cross_site == "diloco" and strategy.diloco_config == DiLoCoConfig(sync_every=8)
    assert Parallel3DStrategy(cross_site="allreduce").diloco_config is None
    monkeypatch.setenv("MULTIDC_CROSS_SITE", "gossip")
    with pytest.raises(ValueError, match="MULTIDC_CROSS_SITE='gossip': choose 'allreduce'"):
        Parallel3DStrategy()


@pytest.mark.timeout(700)
def test_trainer_unequal_sites_equal_the_reference_weighted_by_samples(trainer_runs):
    """Sites of 3 + 1 ranks (MULTIDC_SITE names; dp_shard 3 and 1 inferred), streaming with overlap: every rank
    equals the one-process reference whose sites weigh their samples 3:1, and holds the same global values."""
    unbroken, _ = trainer_runs
    ref = run_reference(
        model(), sites=2, steps=TRAINER_STEPS, loss_fn=loss_fn, blocks=lambda m: m.blocks(), site_weights=[3.0, 1.0],
        batch=lambda s, t: site_batch((3, 1)[s], s, (t - 1) % PER_EPOCH + 1),
        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR), **TRAINER_CONFIG,
    )
    runs = unbroken["fits"]["unequal"]
    for rank, run in enumerate(runs):
        site = 0 if rank < 3 else 1
        assert run["info"]["site"] == site and run["info"]["stats"]["outer_syncs"] == 5
        for kind, expected in (("local", ref["local"][site]), ("global", ref["global"])):
            assert set(run[kind]) == set(expected)
            for name, value in run[kind].items():
                torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=f"{kind} {name}")
        assert all(torch.equal(value, runs[0]["global"][name]) for name, value in run["global"].items())


@pytest.mark.timeout(700)
def test_trainer_unequal_sites_resume_with_a_sync_in_flight_ends_like_the_unbroken_run(trainer_runs):
    unbroken, resumed = trainer_runs
    for a, b in zip(unbroken["fits"]["unequal"], resumed["fits"]["unequal"]):
        assert (b["info"]["global_step"], b["info"]["batches_run"]) == (TRAINER_STEPS, TRAINER_STEPS - PER_EPOCH)
        for kind in ("local", "global"):
            for name in a[kind]:
                assert torch.equal(a[kind][name], b[kind][name]), (kind, name)
