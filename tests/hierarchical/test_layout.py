"""Site layout resolution, ``SiteLayout`` arithmetic and chunk planning. Pure: no process group."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multidc.hierarchical import SiteLayout, plan_chunks, resolve_sites
from multidc.hierarchical.chunking import MIB
from multidc.hierarchical.topology import _Claim, _local_claim


def _claims(sites=None, num_sites=None, world=None):
    """One claim per rank: ``sites`` a list (one per rank) or None; ``num_sites`` an int, a list or None."""
    world = world if world is not None else len(sites)
    sites = sites if sites is not None else [None] * world
    counts = num_sites if isinstance(num_sites, list) else [num_sites] * world
    return [_Claim(site=s, num_sites=n) for s, n in zip(sites, counts)]


# ---------------------------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "claims,site_ranks,site_names",
    [
        pytest.param(_claims(world=4), ((0, 1, 2, 3),), ("0",), id="nothing-set-one-site"),
        pytest.param(_claims(world=1), ((0,),), ("0",), id="single-rank"),
        pytest.param(_claims(world=4, num_sites=2), ((0, 1), (2, 3)), ("0", "1"), id="contiguous-2x2"),
        pytest.param(_claims(world=6, num_sites=3), ((0, 1), (2, 3), (4, 5)), ("0", "1", "2"), id="contiguous-3x2"),
        pytest.param(_claims(world=4, num_sites=4), ((0,), (1,), (2,), (3,)), ("0", "1", "2", "3"), id="4x1"),
        pytest.param(_claims(world=4, num_sites=1), ((0, 1, 2, 3),), ("0",), id="1x4"),
        pytest.param(_claims([0, 0, 1, 1]), ((0, 1), (2, 3)), ("0", "1"), id="explicit-ints"),
        pytest.param(_claims([1, 1, 0, 0]), ((2, 3), (0, 1)), ("0", "1"), id="explicit-ints-reversed"),
        pytest.param(_claims([0, 1, 0, 1]), ((0, 2), (1, 3)), ("0", "1"), id="interleaved"),
        pytest.param(_claims([0, 0, 0, 1]), ((0, 1, 2), (3,)), ("0", "1"), id="unequal-3+1"),
        pytest.param(_claims([0, 0, 1, 1], num_sites=2), ((0, 1), (2, 3)), ("0", "1"), id="ints-with-num-sites"),
        pytest.param(
            _claims(["us", "us", "eu", "eu"]), ((0, 1), (2, 3)), ("us", "eu"), id="names-ordered-by-lowest-rank"
        ),
        pytest.param(_claims(["eu", "us", "eu", "us"]), ((0, 2), (1, 3)), ("eu", "us"), id="names-interleaved"),
        pytest.param(_claims(["a", "b", "b", "b"], num_sites=2), ((0,), (1, 2, 3)), ("a", "b"), id="names-1+3"),
        pytest.param(
            _claims([0, 0, 1, 1], num_sites=[2, None, None, 2]), ((0, 1), (2, 3)), ("0", "1"), id="partial-count"
        ),
    ],
)
def test_resolve_sites_builds_expected_layout(claims, site_ranks, site_names):
    layout = resolve_sites(claims)
    assert layout.site_ranks == site_ranks
    assert layout.site_names == site_names


@pytest.mark.parametrize(
    "claims,message",
    [
        pytest.param(
            [_Claim(None, None), _Claim(None, None, error="MULTIDC_NUM_SITES='x' is not an integer")],
            "rank 1: MULTIDC_NUM_SITES='x' is not an integer",
            id="carried-error-names-rank",
        ),
        pytest.param(_claims(world=4, num_sites=[2, 2, 2, 4]), "ranks disagree on num_sites", id="disagree"),
        pytest.param(_claims(world=4, num_sites=0), "num_sites=0 must be at least 1", id="zero-sites"),
        pytest.param(_claims(world=4, num_sites=-1), "num_sites=-1 must be at least 1", id="negative-sites"),
        pytest.param(_claims(world=4, num_sites=3), "4 ranks cannot be split into num_sites=3", id="not-dividing"),
        pytest.param(_claims(world=2, num_sites=4), "2 ranks cannot be split into num_sites=4", id="more-than-ranks"),
        pytest.param(_claims([0, 0, 1, None]), r"ranks \[3\] have no site", id="some-ranks-unset"),
        pytest.param(_claims([0, 0, 2, 2]), r"site\(s\) \['1'\] have no ranks", id="gap-in-indices"),
        pytest.param(_claims([1, 1, 1, 1]), r"site\(s\) \['0'\] have no ranks", id="index-zero-empty"),
        pytest.param(_claims([0, 0, 1, 1], num_sites=3), r"site\(s\) \['2'\] have no ranks", id="count-too-big"),
        pytest.param(_claims([0, 0, 2, 2], num_sites=2), r"site indices \[2\] are outside 0..1", id="index-too-big"),
        pytest.param(_claims([0, -1, 0, 1]), r"site indices \[-1\] are outside", id="negative-index"),
        pytest.param(_claims(["eu", 1, "eu", 1]), "mix indices and names", id="mixed-kinds"),
        pytest.param(_claims(["eu", "eu", "us", "us"], num_sites=3), "num_sites=3 but ranks name 2 sites", id="names"),
    ],
)
def test_resolve_sites_rejects_unworkable_layout(claims, message):
    with pytest.raises(ValueError, match=message):
        resolve_sites(claims)


@pytest.mark.parametrize(
    "site,num_sites,env,expected",
    [
        (None, None, {}, _Claim(None, None)),
        (1, None, {}, _Claim(1, None)),
        (None, None, {"MULTIDC_SITE": "2"}, _Claim(2, None)),  # digits from the env are an index
        (None, None, {"MULTIDC_SITE": "us-east"}, _Claim("us-east", None)),
        ("eu", None, {"MULTIDC_SITE": "us-east"}, _Claim("eu", None)),  # argument beats env
        (None, None, {"MULTIDC_NUM_SITES": "3"}, _Claim(None, 3)),
        (None, 2, {"MULTIDC_NUM_SITES": "3"}, _Claim(None, 2)),
    ],
)
def test_local_claim_reads_arguments_then_environment(monkeypatch, site, num_sites, env, expected):
    for name in ("MULTIDC_SITE", "MULTIDC_NUM_SITES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    claim, wan = _local_claim(site, num_sites, None)
    assert (claim.site, claim.num_sites, claim.error) == (expected.site, expected.num_sites, expected.error)
    assert claim.wan == wan  # the WAN settings travel with the claim, to be compared across ranks


@pytest.mark.parametrize(
    "site,num_sites,env,message",
    [
        (None, None, {"MULTIDC_NUM_SITES": "two"}, "MULTIDC_NUM_SITES='two' is not an integer"),
        (1.5, None, {}, "site=1.5 must be an int index or a name"),
        (True, None, {}, "site=True must be an int index or a name"),
        (None, "2", {}, "num_sites='2' must be an int"),
        (None, 2.0, {}, "num_sites=2.0 must be an int"),
        (None, None, {"MULTIDC_WAN_STREAMS": "0"}, "MULTIDC_WAN_STREAMS=0 (WanConfig.streams) must be an integer"),
    ],
)
def test_local_claim_carries_errors_instead_of_raising(monkeypatch, site, num_sites, env, message):
    for name in ("MULTIDC_SITE", "MULTIDC_NUM_SITES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    claim, _ = _local_claim(site, num_sites, None)
    assert claim.error is not None and message in claim.error, claim
    with pytest.raises(ValueError, match=re.escape(f"rank 0: {message}")):
        resolve_sites([claim])


@pytest.mark.parametrize(
    "site_ranks,num_rails,equal,rails,site_of",
    [
        (((0, 1), (2, 3)), 2, True, [(0, 2), (1, 3)], {0: 0, 1: 0, 2: 1, 3: 1}),
        (((0, 2), (1, 3)), 2, True, [(0, 1), (2, 3)], {0: 0, 1: 1, 2: 0, 3: 1}),
        (((0, 1, 2), (3,)), 1, False, [(0, 3)], {0: 0, 1: 0, 2: 0, 3: 1}),
        (((0,), (1,), (2,), (3,)), 1, True, [(0, 1, 2, 3)], {0: 0, 1: 1, 2: 2, 3: 3}),
        (((0, 1, 2, 3),), 4, True, [(0,), (1,), (2,), (3,)], {0: 0, 3: 0}),
        (((4, 5, 6), (0, 1), (2, 3)), 2, False, [(4, 0, 2), (5, 1, 3)], {6: 0, 0: 1, 3: 2}),
    ],
)
def test_site_layout_arithmetic(site_ranks, num_rails, equal, rails, site_of):
    layout = SiteLayout(site_ranks=site_ranks, site_names=tuple(str(i) for i in range(len(site_ranks))))
    assert layout.num_sites == len(site_ranks)
    assert layout.num_rails == num_rails
    assert layout.equal_sites is equal
    assert [layout.rail_ranks(j) for j in range(num_rails)] == rails
    assert {rank: layout.site_of(rank) for rank in site_of} == site_of
    with pytest.raises(ValueError, match="rank 99 is in no site"):
        layout.site_of(99)


# ---------------------------------------------------------------------------------------------------- chunks


def _sizes(chunks):
    return [(c.start, c.numel, c.shard_numel) for c in chunks]


@pytest.mark.parametrize(
    "numel,element_size,chunk_mb,num_shards,expected",
    [
        pytest.param(1, 4, 4.0, 1, [(0, 1, 1)], id="one-element-one-shard"),
        pytest.param(1, 4, 4.0, 2, [(0, 1, 1)], id="one-element-padded-to-two-shards"),
        pytest.param(7, 4, 4.0, 2, [(0, 7, 4)], id="odd-size-one-chunk"),
        pytest.param(8, 4, 16 / MIB, 2, [(0, 4, 2), (4, 4, 2)], id="exact-multiple"),
        pytest.param(10, 4, 16 / MIB, 2, [(0, 4, 2), (4, 4, 2), (8, 2, 1)], id="two-per-shard-budget"),
        pytest.param(7, 4, 16 / MIB, 2, [(0, 4, 2), (4, 3, 2)], id="odd-size-padded-last"),
        pytest.param(5, 4, 1 / MIB, 2, [(0, 2, 1), (2, 2, 1), (4, 1, 1)], id="tiny-budget-one-row-per-chunk"),
        pytest.param(3, 4, 1e-12, 1, [(0, 1, 1), (1, 1, 1), (2, 1, 1)], id="tiny-chunk-mb-one-element"),
        pytest.param(
            1 << 20, 4, 1.0, 2, [(i << 18, 1 << 18, 1 << 17) for i in range(4)], id="4MiB-fp32-in-1MiB-chunks"
        ),
    ],
)
def test_plan_chunks_examples(numel, element_size, chunk_mb, num_shards, expected):
    chunks = plan_chunks(numel, element_size, chunk_mb, num_shards)
    assert _sizes(chunks) == expected
    assert all(c.num_shards == num_shards for c in chunks)


def test_plan_chunks_budget_not_multiple_of_shards_is_not_exceeded():
    # 10 elements of budget with 4 shards: chunks of 8, never 12.
    chunks = plan_chunks(20, 4, 40 / MIB, 4)
    assert max(c.padded_numel for c in chunks) == 8
    assert _sizes(chunks) == [(0, 8, 2), (8, 8, 2), (16, 4, 1)]


def test_plan_chunks_spreads_rows_evenly_instead_of_leaving_a_runt():
    # A budget of 4 rows over 17 rows: 5 chunks of 4,4,3,3,3 rows, not 4,4,4,4,1.
    chunks = plan_chunks(17, 1, 4 / MIB, 1)
    assert [c.numel for c in chunks] == [4, 4, 3, 3, 3]


@pytest.mark.parametrize(
    "args",
    [
        (0, 4, 4.0, 2),
        (-3, 4, 4.0, 2),
        (10, 0, 4.0, 2),
        (10, 4, 0.0, 2),
        (10, 4, -1.0, 2),
        (10, 4, math.nan, 2),
        (10, 4, math.inf, 2),
        (10, 4, 4.0, 0),
    ],
)
def test_plan_chunks_rejects_bad_arguments(args):
    with pytest.raises(ValueError, match="plan_chunks needs"):
        plan_chunks(*args)


@settings(max_examples=200, deadline=None)
@given(
    numel=st.integers(1, 50_000),
    element_size=st.sampled_from([1, 2, 4, 8]),
    chunk_bytes=st.integers(1, 100_000),
    num_shards=st.integers(1, 9),
)
def test_plan_chunks_properties(numel, element_size, chunk_bytes, num_shards):
    chunks = plan_chunks(numel, element_size, chunk_bytes / MIB, num_shards)
    # Cover [0, numel) exactly once, in order.
    assert chunks[0].start == 0 and chunks[-1].end == numel
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
    assert all(c.numel >= 1 for c in chunks)
    # Padded size is the shard size times the shards; only the last chunk is padded, by less than one row.
    for c in chunks:
        assert c.num_shards == num_shards and c.padded_numel % num_shards == 0
        assert c.numel <= c.padded_numel < c.numel + num_shards
    assert not any(c.padded for c in chunks[:-1])
    # Within budget, unless one element per shard already exceeds it.
    budget = max(num_shards, (chunk_bytes // element_size) // num_shards * num_shards)
    assert all(c.padded_numel <= budget for c in chunks)
    # Fewest chunks that fit the budget, and balanced: sizes differ by at most one row plus the padding.
    assert len(chunks) == math.ceil(math.ceil(numel / num_shards) / (budget // num_shards))
    padded = [c.padded_numel for c in chunks]
    assert max(padded) - min(padded) <= num_shards
    sizes = [c.numel for c in chunks]
    assert max(sizes) - min(sizes) < 2 * num_shards
