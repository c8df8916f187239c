"""ParallelLayout: size arithmetic and errors (no process group), and the DeviceMesh it builds (gloo ranks)."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from multidc.hierarchical.parallel.layout import ALIASES, MESH_AXES, ParallelLayout
from multidc.hierarchical.tools.ranks import run_ranks

SIZE_FIELDS = ("num_sites", "dp_replicate", "dp_shard", "pipeline_parallel_size", "tensor_parallel_size")

INVALID = [
    # (kwargs, words the message must contain)
    (dict(num_sites=3, world_size=8), ["dp_shard cannot be inferred", "num_sites in [1, 2, 4, 8]"]),
    (dict(num_sites=2, dp_shard=3, tensor_parallel_size=2, world_size=8), ["= 12 ranks", "has 8", "dp_shard=2"]),
    (
        dict(dp_shard=2, pipeline_parallel_size=2, tensor_parallel_size=4, world_size=8),
        ["= 16 ranks", "tensor_parallel_size=2"],
    ),
    (dict(dp_shard=-1, tensor_parallel_size="auto"), ["only one size can be inferred", "tensor_parallel_size"]),
    (dict(num_sites=-1, pipeline_parallel_size=-1), ["only one size can be inferred"]),
    (dict(tensor_parallel_size=0), ["tensor_parallel_size=0", "positive int"]),
    (dict(pipeline_parallel_size=-2), ["pipeline_parallel_size=-2"]),
    (dict(dp_replicate=True), ["dp_replicate=True"]),
    (dict(num_sites=1.5), ["num_sites=1.5"]),
    (dict(dp_shard="half"), ["dp_shard='half'"]),
    (dict(world_size=0), ["world_size=0"]),
    (dict(num_sites=5, dp_shard=1, world_size=4), ["= 5 ranks", "has 4", "num_sites=4"]),
    (dict(num_sites=2, dp_shard=1, world_size=3), ["= 2 ranks", "num_sites=3"]),
]


@pytest.mark.parametrize("kwargs,words", INVALID, ids=[str(k) for k, _ in INVALID])
def test_invalid_layout_raises_value_error_naming_sizes_and_fix(kwargs, words):
    with pytest.raises(ValueError) as info:
        ParallelLayout(**kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


AUTO_SIZES = [
    # (kwargs, env, mesh shape (site, pp, dp_replicate, dp_shard, tp)): the size asked to be inferred is inferred;
    # an unset dp_shard is the inferred one only when no other size is -1/"auto", else 1
    (dict(num_sites=2, pipeline_parallel_size=2, tensor_parallel_size="auto"), {}, (2, 2, 1, 1, 2)),
    (dict(num_sites="auto", tensor_parallel_size=2), {}, (4, 1, 1, 1, 2)),
    (dict(pipeline_parallel_size=-1), {}, (1, 8, 1, 1, 1)),
    (dict(num_sites=2, dp_replicate="auto"), {}, (2, 1, 4, 1, 1)),
    (dict(num_sites=2, pipeline_parallel_size=2), {}, (2, 2, 1, 2, 1)),
    (dict(dp_shard=2, tensor_parallel_size="auto"), {}, (1, 1, 1, 2, 4)),
    (dict(num_sites=2), {"MULTIDC_TP_SIZE": "auto"}, (2, 1, 1, 1, 4)),
    (dict(tensor_parallel_size=2), {"MULTIDC_PP_SIZE": "-1"}, (1, 4, 1, 1, 2)),
    (dict(tensor_parallel_size=2), {"MULTIDC_DP_SHARD": "2", "MULTIDC_NUM_SITES": "auto"}, (2, 1, 1, 2, 2)),
]


@pytest.mark.parametrize("kwargs,env,shape", AUTO_SIZES, ids=[f"{k}{e}" for k, e, _ in AUTO_SIZES])
def test_any_one_size_can_be_auto_and_dp_shard_then_defaults_to_one(monkeypatch, kwargs, env, shape):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ParallelLayout(**kwargs, world_size=8).shape == shape
    assert ParallelLayout(**kwargs).resolve(8).shape == shape


def test_dp_shard_given_as_auto_still_conflicts_with_another_auto_size(monkeypatch):
    monkeypatch.setenv("MULTIDC_DP_SHARD", "auto")
    with pytest.raises(ValueError, match=r"only one size can be inferred, but \['dp_shard', 'tensor_parallel_size'\]"):
        ParallelLayout(tensor_parallel_size="auto")


def test_env_fills_sizes_left_unset_and_names_the_variable_on_bad_values(monkeypatch):
    monkeypatch.setenv("MULTIDC_NUM_SITES", "2")
    monkeypatch.setenv("MULTIDC_PP_SIZE", "2")
    monkeypatch.setenv("MULTIDC_TP_SIZE", "2")
    layout = ParallelLayout(world_size=16)
    assert layout.shape == (2, 2, 1, 2, 2)
    assert ParallelLayout(tensor_parallel_size=1, world_size=8).shape == (2, 2, 1, 2, 1)  # argument beats env
    monkeypatch.setenv("MULTIDC_DP_SHARD", "x")
    with pytest.raises(ValueError, match="MULTIDC_DP_SHARD"):
        ParallelLayout()


def test_resolve_infers_the_auto_size_and_refuses_another_world():
    layout = ParallelLayout(num_sites=2, pipeline_parallel_size=2)
    assert not layout.resolved
    with pytest.raises(ValueError, match="not resolved"):
        _ = layout.shape
    resolved = layout.resolve(16)
    assert resolved.dp_shard == 4 and resolved.dp_size == 8 and resolved.site_size == 8
    with pytest.raises(ValueError, match="resolved for world_size=16"):
        resolved.resolve(8)


_size = st.sampled_from([1, 2, 3, 4])


@settings(max_examples=150, deadline=None)
@given(sizes=st.tuples(_size, _size, _size, _size, _size), auto=st.integers(-1, 4))
def test_layout_arithmetic_properties(sizes, auto):
    """Product = world; groups partition the ranks; tp/pp/dp_shard groups stay inside one site."""
    world = math.prod(sizes)
    kwargs = dict(zip(SIZE_FIELDS, sizes))
    if auto >= 0:
        kwargs[SIZE_FIELDS[auto]] = -1
    layout = ParallelLayout(**kwargs, world_size=world)
    assert layout.shape == (sizes[0], sizes[3], sizes[1], sizes[2], sizes[4])
    assert math.prod(layout.shape) == world
    assert layout.dp_size == sizes[0] * sizes[1] * sizes[2]
    for axis in MESH_AXES + tuple(ALIASES):
        groups = layout.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert {len(g) for g in groups} == {layout.sizes[axis]}
        if axis not in ("site", "data_parallel", "replicate"):
            assert all(len({layout.site_of(r) for r in g}) == 1 for g in groups), axis
    for group in layout.groups("site"):  # a site group has exactly one rank per site
        assert sorted(layout.site_of(r) for r in group) == list(range(layout.num_sites))


@settings(max_examples=100, deadline=None)
@given(sizes=st.tuples(_size, _size, _size, _size, _size), world=st.integers(1, 40))
def test_mismatched_world_always_raises_and_suggestions_fit(sizes, world):
    kwargs = dict(zip(SIZE_FIELDS, sizes))
    if math.prod(sizes) == world:
        assert ParallelLayout(**kwargs, world_size=world).world_size == world
        return
    with pytest.raises(ValueError) as info:
        ParallelLayout(**kwargs, world_size=world)
    message = str(info.value)
    assert "Would fit: " in message or "No single change fits" in message
    if "Would fit: " not in message:
        return
    for part in message.split("Would fit: ")[-1].split(".")[0].split(", or "):
        if "=" in part:  # every suggested single change really fits
            name, value = part.split("=")
            assert ParallelLayout(**{**kwargs, name: int(value)}, world_size=world).world_size == world


def test_unequal_sites_differ_in_dp_shard_only_and_resolve_without_a_process_group():
    layout = ParallelLayout(site_sizes=(4, 2), tensor_parallel_size=2)
    assert layout.unequal_sites and (layout.num_sites, layout.world_size) == (2, 6)
    assert layout.dp_shards == (2, 1) and layout.dp_size == 3
    assert [layout.site_of(r) for r in range(6)] == [0, 0, 0, 0, 1, 1]
    axes = dict.fromkeys(MESH_AXES, 0)
    assert layout.coordinates(2) == {**axes, "dp_shard": 1}
    assert layout.coordinates(5) == {**axes, "site": 1, "tp": 1}
    assert layout.site_layout(0).shape == (1, 1, 1, 2, 2) and layout.site_layout(1).shape == (1, 1, 1, 1, 2)
    assert layout.describe() == "6 ranks = sites of [4, 2] x pp 1 x dp_replicate 1 x dp_shard [2, 1] x tp 2"
    with pytest.raises(ValueError, match="has no single mesh; each site has its own"):
        layout.shape  # noqa: B018
    equal = ParallelLayout(site_sizes=(2, 2))  # equal sizes: the usual layout
    assert not equal.unequal_sites and equal.shape == (2, 1, 1, 2, 1)


UNEQUAL_INVALID = [
    (dict(site_sizes=(3, 1), dp_shard=1), "leave dp_shard and MULTIDC_DP_SHARD unset"),
    (dict(site_sizes=(3, 1), tensor_parallel_size=2), "site 0 has 3 ranks, not a multiple of"),
    (dict(site_sizes=(4, 2), pipeline_parallel_size="auto"), "['pipeline_parallel_size'] cannot be inferred"),
    (dict(site_sizes=(3, 1), num_sites=3), "num_sites=3 but site_sizes=[3, 1] has 2 sites"),
    (dict(site_sizes=(3, 1), world_size=5), "add up to 4 ranks, but world_size=5"),
    (dict(site_sizes=(3, 0)), "a positive int per site"),
    (dict(site_sizes=(3, 1), data_parallel_size=2), "data_parallel_size=2, but sites of [3, 1] ranks hold 4"),
]


@pytest.mark.parametrize("kwargs,words", UNEQUAL_INVALID, ids=[str(k) for k, _ in UNEQUAL_INVALID])
def test_unequal_sites_refuse_sizes_other_than_dp_shard_naming_the_fix(kwargs, words):
    with pytest.raises(ValueError) as info:
        ParallelLayout(**kwargs)
    assert words in str(info.value)


def _mesh_groups_and_errors(rank, world, kwargs):
    """One spawn, four checks (spawning ranks is the slow part): groups, sites counted from MULTIDC_SITE, bad
    sites, disagreeing sizes."""
    import os

    layout = ParallelLayout(**kwargs)
    mesh = layout.build_mesh()
    resolved = layout.resolve(world)
    mine = {}
    for axis in MESH_AXES + tuple(ALIASES):
        ranks = dist.get_process_group_ranks(mesh[axis].get_group()) if mesh[axis].size() > 1 else [rank]
        expected = next(g for g in resolved.groups(axis) if rank in g)
        mine[axis] = (sorted(ranks), expected)
    coordinate = dict(zip(MESH_AXES, mesh.get_coordinate()))
    os.environ["MULTIDC_SITE"] = "east" if rank < world // 2 else "west"  # one name per node, no site count
    try:
        counted = ParallelLayout(pipeline_parallel_size=2)
        named = (counted.resolve_job().shape, tuple(counted.build_mesh().shape))
    finally:
        del os.environ["MULTIDC_SITE"]
    errors = []
    for env, sizes in (({"MULTIDC_SITE": "ab"[rank % 2]}, {"num_sites": 2}),
                       ({"MULTIDC_PP_SIZE": "2" if rank else "1"}, {"num_sites": 2}),
                       ({"MULTIDC_SITE": "abcc"[rank]}, {"pipeline_parallel_size": 2})):  # 3 sites for 4 ranks
        os.environ.update(env)
        try:
            ParallelLayout(**sizes).build_mesh()  # reads the environment: built after it is set
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
        for name in env:
            del os.environ[name]
    return mine, coordinate, resolved.coordinates(rank), named, errors


def test_mesh_groups_match_layout_arithmetic_and_bad_layouts_raise_on_every_rank():
    kwargs = dict(num_sites=2, pipeline_parallel_size=2, tensor_parallel_size=1)
    for mine, coordinate, expected, named, errors in run_ranks(_mesh_groups_and_errors, 4, kwargs, timeout=180):
        assert coordinate == expected
        for axis, (got, want) in mine.items():
            assert got == want, axis
        assert named == ((2, 2, 1, 1, 1), (2, 2, 1, 1, 1)), "2 MULTIDC_SITE names, no num_sites: 2 sites"
        interleaved_sites, disagreeing_sizes, counted_sites = errors
        assert interleaved_sites is not None and "contiguous block of 2 ranks" in interleaved_sites
        assert disagreeing_sizes is not None and "disagree" in disagreeing_sizes
        assert counted_sites is not None and counted_sites.startswith(
            "num_sites=3 was counted from the MULTIDC_SITE names of the ranks (['a', 'b', 'c'])"), counted_sites
