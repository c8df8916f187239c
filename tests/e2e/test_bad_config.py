"""Bad configuration, table-driven: wrong layouts, environment values, URLs and arguments each raise a specific
error whose message says what is wrong. The cases that involve ranks run on 4 real gloo ranks and check that every
rank raises, quickly (before any collective that could hang). Plus hypothesis properties of site resolution
(chunk planning and ParallelLayout arithmetic have theirs in hierarchical/test_layout.py and
hierarchical/test_parallel_layout.py)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multidc.hierarchical import WanConfig, all_reduce, plan_chunks, resolve_sites
from multidc.hierarchical.parallel.layout import ParallelLayout
from multidc.hierarchical.parallel.pipeline import PipelineConfig
from multidc.hierarchical.tools import cli
from multidc.hierarchical.tools.lab import Lab, parse_rate
from multidc.hierarchical.tools.launch import SiteJob
from multidc.hierarchical.tools.ranks import run_ranks
from multidc.hierarchical.topology import _Claim
from multidc.plugins import (
    Checkpointer,
    ModelState,
    MultiDCPlugin,
    ObjectStore,
    ObjectStoreNotFoundError,
    RetryPolicy,
)
from multidc.strategies import HierarchicalDDPStrategy, Parallel3DStrategy
from tests._batched import run_cases


def _saved(tmp, state) -> Checkpointer:
    ckpt = Checkpointer(str(tmp / "ckpt"))
    ckpt.save(state, step=1)
    return ckpt


def _other_model(tmp):
    _saved(tmp, {"model": ModelState(torch.nn.Linear(4, 3))}).load({"model": ModelState(torch.nn.Linear(5, 3))})


def _missing_key(tmp):
    _saved(tmp, {"w": torch.ones(3)}).load({"w": torch.ones(3), "optimizer_step": torch.zeros(1)})


def _same_step_twice(tmp):
    _saved(tmp, {"w": torch.ones(3)}).save({"w": torch.ones(3)}, step=1)


def _ckpt(tmp, **kwargs) -> Checkpointer:
    return Checkpointer(str(tmp / "ckpt"), **kwargs)


# (id, environment, call(tmp), error type, message fragment)
CASES = [
    ("wan-unknown-compression", {}, lambda t: WanConfig(compression="zstd"), ValueError, "'zstd' (also settable"),
    ("wan-negative-chunk", {}, lambda t: WanConfig(chunk_mb=-1), ValueError, "chunk_mb=-1"),
    ("wan-zero-streams", {}, lambda t: WanConfig(streams=0), ValueError, "streams=0"),
    ("env-unknown-compression", {"MULTIDC_WAN_COMPRESSION": "gzip"}, lambda t: WanConfig(), ValueError,
     "MULTIDC_WAN_COMPRESSION='gzip'"),
    ("env-chunk-with-unit", {"MULTIDC_WAN_CHUNK_MB": "4MB"}, lambda t: WanConfig(), ValueError,
     "MULTIDC_WAN_CHUNK_MB='4MB' is not a number"),
    ("env-negative-timeout", {"MULTIDC_WAN_TIMEOUT_S": "-5"}, lambda t: WanConfig(), ValueError,
     "MULTIDC_WAN_TIMEOUT_S=-5.0 (WanConfig.timeout_s) must be a positive"),
    ("env-fractional-streams", {"MULTIDC_WAN_STREAMS": "1.5"}, lambda t: WanConfig(), ValueError,
     "MULTIDC_WAN_STREAMS='1.5' is not an integer"),
    ("negative-chunk-plan", {}, lambda t: plan_chunks(10, 4, -1.0, 2), ValueError, "chunk_mb=-1.0"),
    ("all-reduce-int-tensor", {}, lambda t: all_reduce(torch.ones(3, dtype=torch.int32), None), ValueError,
     "not torch.int32"),
    ("all-reduce-unknown-op", {}, lambda t: all_reduce(torch.ones(3), None, op="max"), ValueError, "op='max'"),
    ("tp-across-sites", {}, lambda t: ParallelLayout(num_sites=2, tensor_parallel_size=4, world_size=4),
     ValueError, "tensor_parallel_size in [1, 2]"),
    ("pp-does-not-divide-world", {}, lambda t: ParallelLayout(pipeline_parallel_size=3, world_size=8), ValueError,
     "multiply to 3, which does not divide 8"),
    ("two-inferred-sizes", {}, lambda t: ParallelLayout(dp_shard=-1, tensor_parallel_size="auto"), ValueError,
     "only one size can be inferred"),
    ("env-tp-not-a-number", {"MULTIDC_TP_SIZE": "two"}, lambda t: ParallelLayout(), ValueError,
     "tensor_parallel_size='two' (from MULTIDC_TP_SIZE)"),
    ("unknown-pipeline-schedule", {}, lambda t: PipelineConfig(schedule="zigzag"), ValueError, "'zigzag'"),
    ("env-zero-microbatches", {"MULTIDC_PP_MICROBATCHES": "0"}, lambda t: PipelineConfig(), ValueError,
     "microbatches=0"),
    ("strategy-wan-as-string", {}, lambda t: HierarchicalDDPStrategy(wan="bf16"), ValueError,
     "wan must be a multidc.hierarchical.WanConfig"),
    ("strategy-zero-sites", {}, lambda t: HierarchicalDDPStrategy(num_sites=0), ValueError, "num_sites=0"),
    ("strategy-env-sites-word", {"MULTIDC_NUM_SITES": "zero"}, lambda t: HierarchicalDDPStrategy(), ValueError,
     "MULTIDC_NUM_SITES='zero' is not an integer"),
    ("parallel-3d-zero-tp", {}, lambda t: Parallel3DStrategy(tensor_parallel_size=0), ValueError,
     "tensor_parallel_size=0"),
    ("accelerate-plugin-negative-sites", {"MULTIDC_NUM_SITES": "-2"}, lambda t: MultiDCPlugin(), ValueError,
     "MULTIDC_NUM_SITES=-2 must be a positive"),
    ("url-empty", {}, lambda t: ObjectStore(""), ValueError, "URL is empty"),
    ("url-no-bucket", {}, lambda t: ObjectStore("s3://"), ValueError, "names no bucket"),
    ("url-one-slash", {}, lambda t: ObjectStore("s3:/bucket/run"), ValueError,
     "is malformed: write s3://bucket/prefix"),
    ("url-no-slashes", {}, lambda t: Checkpointer("s3:bucket/run"), ValueError, "is malformed"),
    ("url-bucket-with-space", {}, lambda t: ObjectStore("s3://my bucket/run"), ValueError,
     "'my bucket' is not a valid S3 bucket name"),
    ("url-unknown-protocol", {}, lambda t: ObjectStore("s4://bucket/run"), ValueError, "Protocol not known: s4"),
    ("s3-part-below-minimum", {}, lambda t: ObjectStore(str(t), part_size_mb=1), ValueError, "S3 minimum"),
    ("retry-zero-attempts", {}, lambda t: RetryPolicy(attempts=0), ValueError, "attempts=0"),
    ("keep-zero-checkpoints", {}, lambda t: _ckpt(t, keep_last_k=0), ValueError, "keep_last_k=0"),
    ("checkpoint-zero-timeout", {}, lambda t: _ckpt(t, timeout_s=0), ValueError, "timeout_s=0"),
    ("save-negative-step", {}, lambda t: _ckpt(t).save({"w": torch.ones(2)}, step=-1), ValueError, "step=-1"),
    ("save-bool-step", {}, lambda t: _ckpt(t).save({"w": torch.ones(2)}, step=True), ValueError, "step=True"),
    ("save-list-state", {}, lambda t: _ckpt(t).save([torch.ones(2)], step=1), ValueError,
     "state must be a dict"),
    ("save-committed-step-again", {}, _same_step_twice, ValueError, "is already committed"),
    ("load-unknown-which", {}, lambda t: _ckpt(t).load({"w": torch.ones(2)}, "newest"), ValueError,
     "which='newest' is not 'latest'"),
    ("load-from-empty-root", {}, lambda t: _ckpt(t).load({"w": torch.ones(2)}), FileNotFoundError,
     "no committed checkpoint under"),
    ("checkpoint-from-another-model", {}, _other_model, ValueError,
     "Size mismatch between saved torch.Size([3, 4]) and current: torch.Size([3, 5])"),
    ("checkpoint-missing-key", {}, _missing_key, RuntimeError, "Missing key in checkpoint state_dict"),
    ("wan-rate-in-bytes", {}, lambda t: parse_rate("10 MB/s"), ValueError, "'400mbit'"),
    ("lab-one-site", {}, lambda t: Lab(1), ValueError, "num_sites=1"),
    ("lab-site-without-ranks", {}, lambda t: SiteJob(["true"], sites=2, ranks_per_site=0), ValueError,
     "ranks_per_site=0"),
]


@pytest.mark.parametrize("env,call,error,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_a_specific_error_saying_what_is_wrong(monkeypatch, tmp_path, env, call, error, fragment):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(error) as info:
        call(tmp_path)
    assert fragment in str(info.value)


@pytest.mark.parametrize("argv,fragment", [
    (["lab", "run", "--sites", "2"], "give the command to run after --"),
    (["bench", "allreduce", "--sites", "1", "--ranks-per-site", "1"], "needs at least 2 ranks"),
    (["bench", "allreduce", "--compression", "none,zstd"], "zstd"),
], ids=["lab-run-without-command", "bench-one-rank", "bench-unknown-compression"])
def test_bad_command_line_exits_2_with_the_reason(capsys, argv, fragment):
    assert cli.main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_missing_bucket_names_bucket_and_endpoint(s3_server):
    bucket = f"missing-{uuid.uuid4().hex[:8]}"
    ckpt = Checkpointer(f"s3://{bucket}/run", storage_options=s3_server.storage_options())
    with pytest.raises(ObjectStoreNotFoundError) as info:
        ckpt.save({"w": torch.ones(2)}, step=1)
    assert f"bucket {bucket!r} does not exist at endpoint {s3_server.endpoint}" in str(info.value)


# ------------------------------------------------------------------------------------------ on 4 gloo ranks
def _topology(sites=None, num_sites=None, **kwargs):
    """Per-rank site (list indexed by rank) and num_sites (int or list), through the environment."""
    def build(rank):
        import os

        from multidc.hierarchical import Topology

        for name, values in (("MULTIDC_SITE", sites), ("MULTIDC_NUM_SITES", num_sites)):
            value = values[rank] if isinstance(values, list) else values
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, str(value))
        return Topology.build(**kwargs)
    return build


def _layout_with_sites(sites, **layout):
    def build(rank):
        import os

        os.environ["MULTIDC_SITE"] = str(sites[rank])
        try:
            return ParallelLayout(**layout).build_mesh()
        finally:
            del os.environ["MULTIDC_SITE"]
    return build


def _layout_disagreeing(rank):
    return ParallelLayout(tensor_parallel_size=2 if rank < 2 else 1).build_mesh()


def _streams_above_topology(rank):
    from multidc.hierarchical import Topology

    topology = Topology.build(num_sites=2, wan=WanConfig(streams=2))
    all_reduce(torch.ones(8), topology, wan=WanConfig(streams=4))


def _save_different_steps(tmp):
    return lambda rank: Checkpointer(f"{tmp}/steps", timeout_s=30).save({"w": torch.ones(8)}, step=10 + rank)


def _load_other_model(tmp):
    def run(rank):
        ckpt = Checkpointer(f"{tmp}/model", timeout_s=30)
        ckpt.save({"model": ModelState(torch.nn.Linear(4, 3))}, step=1)
        ckpt.load({"model": ModelState(torch.nn.Linear(5, 3))})
    return run


def _load_missing_step(tmp):
    return lambda rank: Checkpointer(f"{tmp}/empty", timeout_s=30).load({"w": torch.ones(2)}, 7)


def _missing_bucket(endpoint):
    options = {"endpoint_url": endpoint, "anon": True, "skip_instance_cache": True,
               "client_kwargs": {"region_name": "us-east-1"}}
    return lambda rank: Checkpointer("s3://no-such-bucket-mdc/run", storage_options=options,
                                     timeout_s=30).save({"w": torch.ones(2)}, step=1)


def _mp_cases(tmp, endpoint):
    """(id, per-rank call, error type name, fragment every rank's message must hold)."""
    return [
        ("sites-do-not-divide-world", _topology(num_sites=3), "ValueError", "cannot be split into num_sites=3"),
        ("site-given-on-some-ranks", _topology(sites=[0, 0, None, None]), "ValueError",
         "have no site while others do"),
        ("site-with-zero-ranks", _topology(sites=[0, 0, 2, 2], num_sites=3), "ValueError",
         "site(s) ['1'] have no ranks"),
        ("ranks-disagree-on-num-sites", _topology(num_sites=[2, 2, 4, 4]), "ValueError",
         "ranks disagree on num_sites"),
        ("one-rank-env-not-a-number", _topology(num_sites=[2, "two", 2, 2]), "ValueError",
         "rank 1: MULTIDC_NUM_SITES='two' is not an integer"),
        ("sites-mix-names-and-indices", _topology(sites=[0, 0, "east", "east"]), "ValueError",
         "mix indices and names"),
        ("layout-sites-interleaved", _layout_with_sites([0, 1, 0, 1], num_sites=2), "ValueError",
         "needs each site to be a contiguous block of 2 ranks"),
        ("layout-sizes-disagree", _layout_disagreeing, "ValueError", "ranks disagree on the parallel layout"),
        ("more-wan-streams-than-built", _streams_above_topology, "ValueError",
         "wan.streams=4 but the topology prepared 2"),
        ("save-different-steps", _save_different_steps(tmp), "ValueError",
         "ranks passed different steps to save ({0: 10, 1: 11, 2: 12, 3: 13})"),
        ("checkpoint-from-another-model", _load_other_model(tmp), "ValueError", "Size mismatch"),
        ("load-missing-step", _load_missing_step(tmp), "FileNotFoundError", "step_0000000007"),
        ("missing-bucket", _missing_bucket(endpoint), "ObjectStoreNotFoundError",
         "bucket 'no-such-bucket-mdc' does not exist at endpoint"),
    ]


def _run_cases(rank, world, tmp, endpoint):
    """Every case on this rank, in order; between cases the ranks meet through the store (not a collective), so a
    rank stuck in a collective makes the others report it instead of hanging too."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    outcomes = {}
    for case_id, call, _, _ in _mp_cases(tmp, endpoint):
        started = time.monotonic()
        try:
            call(rank)
            outcome = ("no error", "")
        except Exception as exc:
            outcome = (type(exc).__name__, str(exc))
        outcomes[case_id] = (*outcome, time.monotonic() - started)
        store.set(f"{case_id}/{rank}", "done")
        store.wait([f"{case_id}/{r}" for r in range(world)], __import__("datetime").timedelta(seconds=30))
    return outcomes


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, s3_server):
    """The 4-rank runs of this module on one set of spawned ranks (starting ranks is the slow part): the bad
    layouts and arguments, the differing WAN settings, then the rank that rejects its input (last: it leaves a
    WAN group broken). ``four_ranks.tmp``: the folder of the checkpoint cases."""
    tmp = str(tmp_path_factory.mktemp("bad-config"))
    results = run_cases({"bad layouts and arguments": (_run_cases, (tmp, s3_server.endpoint)),
                         "differing wan settings": (_differing_wan_settings, ()),
                         "mismatched all_reduce": (_mismatched_all_reduce, ())}, 4, timeout=360)
    results.tmp = tmp
    return results


@pytest.mark.timeout(420)  # the first to run sets up four_ranks
def test_bad_layouts_and_arguments_raise_on_every_rank_before_any_collective(four_ranks, s3_server):
    results = four_ranks["bad layouts and arguments"]
    for case_id, _, error, fragment in _mp_cases(four_ranks.tmp, s3_server.endpoint):
        for rank, outcomes in enumerate(results):
            name, message, seconds = outcomes[case_id]
            assert (name, fragment in message) == (error, True), (case_id, rank, name, message)
            assert seconds < 20, (case_id, rank, seconds)  # raised, not timed out in a collective


def _mismatched_all_reduce(rank, world):
    from multidc.hierarchical import Topology, WanError

    wan = WanConfig(timeout_s=3)
    topology = Topology.build(num_sites=2, wan=wan)
    started = time.monotonic()
    try:
        all_reduce(torch.ones(64, dtype=torch.int64 if rank == 0 else torch.float32), topology, wan=wan)
    except (ValueError, WanError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    return "no error", "", time.monotonic() - started


@pytest.mark.timeout(420)  # the first to run sets up four_ranks
def test_rank_that_rejects_its_input_makes_the_others_fail_within_the_wan_timeout_not_hang(four_ranks):
    results = four_ranks["mismatched all_reduce"]
    assert results[0][0] == "ValueError" and "not torch.int64" in results[0][1]
    for name, message, seconds in results[1:]:
        assert name == "WanError" and "WAN collective between site '0' and site '1'" in message, message
        assert seconds < 3 + 2 + 5, seconds  # timeout_s + the grace inside a site + slack


def _bad_wan_env_on_one_site(rank, world):
    from multidc.hierarchical import Topology

    try:
        Topology.build(num_sites=2)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def test_bad_wan_env_on_one_site_raises_on_every_rank():
    results = run_ranks(_bad_wan_env_on_one_site, 2, env={1: {"MULTIDC_WAN_COMPRESSION": "zstd"}}, timeout=60)
    assert all(name == "ValueError" and "rank 1: MULTIDC_WAN_COMPRESSION='zstd'" in msg for name, msg in results), \
        results


_DIFFERING_WAN = [("MULTIDC_WAN_STREAMS", "3"), ("MULTIDC_WAN_COMPRESSION", "int8"), ("MULTIDC_WAN_CHUNK_MB", "8")]


def _differing_wan_settings(rank, world):
    import os

    results = []
    for variable, value in _DIFFERING_WAN:  # a failed build creates no group, so the next one starts clean
        if rank >= 2:
            os.environ[variable] = value
        results.append(_bad_wan_env_on_one_site(rank, world))
        os.environ.pop(variable, None)
    return results


@pytest.mark.timeout(420)  # the first to run sets up four_ranks
def test_wan_settings_that_differ_between_sites_raise_on_every_rank_before_any_group(four_ranks):
    # Valid on each site, but different: the collectives would not match (streams: different group counts).
    per_rank = four_ranks["differing wan settings"]
    for case, (variable, _value) in enumerate(_DIFFERING_WAN):
        results = [rank_results[case] for rank_results in per_rank]
        for name, message in results:
            assert name == "ValueError" and "ranks disagree on the WAN settings" in message, (variable, message)
            assert "ranks [0, 1]:" in message and "ranks [2, 3]:" in message, message
        assert len({message for _, message in results}) == 1


# ------------------------------------------------------------------------------------------ properties
@settings(max_examples=200, deadline=None)
@given(sites=st.lists(st.sampled_from(["a", "b", "c", "d"]) | st.integers(0, 3), min_size=1, max_size=12))
def test_resolve_sites_partitions_the_ranks_or_raises(sites):
    claims = [_Claim(site=s, num_sites=None) for s in sites]
    kinds = {type(s) for s in sites}
    if len(kinds) > 1:
        with pytest.raises(ValueError, match="mix indices and names"):
            resolve_sites(claims)
        return
    if kinds == {int} and set(range(max(sites) + 1)) - set(sites):
        with pytest.raises(ValueError, match="have no ranks"):
            resolve_sites(claims)
        return
    layout = resolve_sites(claims)
    assert sorted(r for ranks in layout.site_ranks for r in ranks) == list(range(len(sites)))
    for site, ranks in enumerate(layout.site_ranks):
        assert ranks == tuple(sorted(ranks)) and len({sites[r] for r in ranks}) == 1
        assert all(layout.site_of(r) == site for r in ranks)
    firsts = [ranks[0] for ranks in layout.site_ranks]
    if kinds == {str}:  # named sites are ordered by their lowest rank
        assert firsts == sorted(firsts)
    assert layout.num_rails == min(len(r) for r in layout.site_ranks)
    for rail in range(layout.num_rails):  # a rail holds exactly one rank of every site
        assert [layout.site_of(r) for r in layout.rail_ranks(rail)] == list(range(layout.num_sites))


@settings(max_examples=200, deadline=None)
@given(world=st.integers(1, 64), num_sites=st.integers(1, 70))
def test_contiguous_sites_resolve_exactly_when_num_sites_divides_the_world(world, num_sites):
    claims = [_Claim(site=None, num_sites=num_sites)] * world
    if world % num_sites:
        with pytest.raises(ValueError, match=f"cannot be split into num_sites={num_sites}"):
            resolve_sites(claims)
        return
    layout = resolve_sites(claims)
    assert layout.equal_sites and layout.num_sites == num_sites and layout.num_rails == world // num_sites
    assert all(layout.site_of(r) == r // (world // num_sites) for r in range(world))
