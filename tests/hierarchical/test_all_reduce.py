"""Multi-process gloo tests of the hierarchical all-reduce against an exact reference and torch's own."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
import torch.distributed as dist

from multidc.hierarchical import Topology, WanConfig, all_reduce, get_codec, plan_chunks
from tests._batched import run_cases

# Every case below runs on the same 4 spawned ranks (``four_ranks``): starting ranks is the slow part.
pytestmark = pytest.mark.timeout(600)

SIZES = (1, 7, 4097, 1_000_003)
COMPRESSIONS = ("none", "bf16", "fp16", "int8")
LAYOUTS = {
    "2x2": [0, 0, 1, 1],
    "3+1": [0, 0, 0, 1],
    "4x1": [0, 1, 2, 3],
    "1x4": [0, 0, 0, 0],
    "interleaved": [0, 1, 0, 1],
}


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + n)
    return (torch.randn(n, generator=g, dtype=torch.float64) * (1 + rank)).to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _bound(inputs, parts, compression: str, dtype: torch.dtype, avg: bool) -> torch.Tensor:
    """Elementwise error bound: each site's partial is rounded once by the codec, then float32/dtype sums."""
    codec = get_codec(compression)
    absum = sum(x.double().abs() for x in inputs)
    bound = absum * 8 * torch.finfo(dtype).eps  # reduction-order rounding in the input dtype, generous
    if codec is not None:
        bound = bound + sum(codec.max_abs_error(p.float()).double() for p in parts)
        if compression == "int8":  # per-chunk scale <= the scale of the whole partial
            bound = bound + sum(p.abs().max() / 254 for p in parts)
    world = len(inputs)
    return bound / (world if avg else 1) + 1e-30


def _case_results(rank, world, sites):
    topo = Topology.build(site=sites[rank])
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            inputs = [_inputs(r, n, dtype) for r in range(world)]
            exact = sum(x.double() for x in inputs)
            site_parts = [
                sum(inputs[r].double() for r in range(world) if sites[r] == s) for s in sorted(set(sites))
            ]
            flat = inputs[rank].clone()
            dist.all_reduce(flat)
            for compression in COMPRESSIONS:
                for op in ("sum", "avg"):
                    y = inputs[rank].clone()
                    all_reduce(y, topo, wan=WanConfig(compression=compression, chunk_mb=0.25), op=op)
                    ref = exact / world if op == "avg" else exact
                    bound = _bound(inputs, site_parts, compression, dtype, op == "avg")
                    excess = ((y.double() - ref).abs() - bound).max().item()
                    flat_ref = flat.double() / (world if op == "avg" else 1)
                    flat_diff = (y.double() - flat_ref).abs().max().item()
                    out[(str(dtype), n, compression, op)] = (excess, flat_diff, _digest(y))
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_exact_sum_and_flat_all_reduce_on_every_rank(four_ranks, layout):
    results = four_ranks[f"layout {layout}"]
    for key, (excess, flat_diff, digest) in results[0].items():
        assert excess <= 0, f"{layout} {key}: error exceeds the stated bound by {excess:g}"
        if key[2] == "none" and key[0] == "torch.float32":
            assert flat_diff < 1e-4 * max(1, key[1]) ** 0.5, f"{layout} {key}: differs from torch all_reduce"
        for rank, other in enumerate(results[1:], start=1):
            assert other[key][2] == digest, f"{layout} {key}: rank {rank} differs bitwise from rank 0"


def _replicated(rank, world, sites):
    topo = Topology.build(site=sites[rank])
    per_site = [_inputs(100 + s, 4097, torch.float32) for s in range(topo.num_sites)]
    out = {}
    for compression in (*COMPRESSIONS, "int4"):
        y = per_site[topo.site].clone()  # every rank of a site holds its site's value
        before = topo.wan_stats.snapshot()["bytes_sent"]
        all_reduce(y, topo, wan=WanConfig(compression=compression, chunk_mb=0.005), op="avg", replicated=True)
        exact = sum(x.double() for x in per_site) / topo.num_sites
        codec = get_codec(compression)
        rounding = sum(codec.max_abs_error(x).double() for x in per_site) / topo.num_sites if codec else 0
        bound = 1e-6 * exact.abs().max() + rounding
        sent = topo.wan_stats.snapshot()["bytes_sent"] - before
        out[compression] = (((y.double() - exact).abs() - bound).max().item(), _digest(y), sent)
    return out


REPLICATED_LAYOUTS = ["2x2", "3+1", "interleaved"]


@pytest.mark.parametrize("layout", REPLICATED_LAYOUTS)
def test_replicated_values_average_over_sites_and_each_rank_sends_only_its_share(four_ranks, layout):
    sites = LAYOUTS[layout]
    results = four_ranks[f"replicated {layout}"]
    for compression in (*COMPRESSIONS, "int4"):
        assert all(r[compression][0] <= 0 for r in results), f"{layout} {compression}: beyond the codec bound"
        assert len({r[compression][1] for r in results}) == 1, f"{layout} {compression}: ranks differ"
    sent = [r["none"][2] for r in results]
    rails = min(sites.count(s) for s in set(sites))
    assert max(sent) <= 4097 * 4 * 2 // rails + 64, sent  # each rail: its 1/rails share, not the whole tensor


def _bytes_over_wan(rank, world, compression):
    topo = Topology.build(num_sites=2)
    x = torch.ones(1 << 16)
    all_reduce(x, topo, wan=WanConfig(compression=compression))
    return topo.wan_stats.snapshot()


BYTES_PER_ELEMENT = [("none", 4), ("bf16", 2), ("int8", 1)]


@pytest.mark.parametrize("compression,per_element", BYTES_PER_ELEMENT)
def test_wan_bytes_counted_per_rank_shrink_with_compression(four_ranks, compression, per_element):
    stats = four_ranks[f"bytes {compression}"]
    # 2 sites x 2 ranks: each rank owns half of the tensor and exchanges it once with the other site.
    expected = (1 << 15) * per_element
    for s in stats:
        assert s["calls"] == 1
        assert expected <= s["bytes_sent"] <= expected + 64, s


def _async_and_views(rank, world):
    topo = Topology.build(num_sites=2)
    a = torch.full((3, 5), float(rank + 1))
    b = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    fa = all_reduce(a, topo, async_op=True)
    fb = all_reduce(b, topo, op="avg", async_op=True)
    assert fb.wait() is b and fa.wait() is a
    return a, b


def test_async_op_returns_future_and_handles_non_contiguous_tensors(four_ranks):
    a, b = four_ranks["async"][0]
    assert torch.equal(a, torch.full((3, 5), 10.0))
    assert torch.equal(b, torch.arange(12, dtype=torch.float32).reshape(3, 4).t())


def _layout_error(rank, world, kwargs_per_rank, env_per_rank):
    import os

    os.environ.update(env_per_rank[rank])
    try:
        Topology.build(**kwargs_per_rank[rank])
    except ValueError as exc:
        return str(exc)
    return None


BAD_LAYOUTS = [
    ([{}] * 4, [{"MULTIDC_NUM_SITES": "3"}] * 4, "cannot be split into num_sites=3"),
    ([{"num_sites": 2}, {"num_sites": 2}, {"num_sites": 2}, {"num_sites": 4}], [{}] * 4, "disagree"),
    ([{"site": 0}, {"site": 0}, {"site": 2}, {"site": 2}], [{}] * 4, r"\['1'\] have no ranks"),
    ([{"site": 0}, {"site": 0}, {"site": 1}, {}], [{}] * 4, "ranks \\[3\\] have no site"),
    ([{"site": "a"}, {"site": 1}, {"site": "a"}, {"site": 1}], [{}] * 4, "mix indices and names"),
    ([{}] * 4, [{"MULTIDC_NUM_SITES": "two"}] * 4, "MULTIDC_NUM_SITES='two' is not an integer"),
    ([{}, {}, {}, {}], [{}, {}, {}, {"MULTIDC_NUM_SITES": "x"}], "rank 3: MULTIDC_NUM_SITES"),
    ([{"site": "eu", "num_sites": 3}] * 2 + [{"site": "us", "num_sites": 3}] * 2, [{}] * 4, "name 2 sites"),
]


@pytest.mark.parametrize("case", range(len(BAD_LAYOUTS)), ids=[match for *_, match in BAD_LAYOUTS])
def test_bad_layout_raises_same_value_error_on_every_rank(four_ranks, case):
    import re

    match = BAD_LAYOUTS[case][2]
    messages = four_ranks[f"bad layout {case}"]
    assert all(m is not None and re.search(match, m) for m in messages), messages
    assert len(set(messages)) == 1, messages


def _named_sites(rank, world):
    topo = Topology.build(site=["us-east", "eu-west", "us-east", "eu-west"][rank])
    return topo.site, topo.site_name, topo.num_sites, topo.site_size, topo.local_rank_in_site, topo.rail


def test_named_interleaved_sites_are_ordered_by_lowest_rank(four_ranks):
    assert four_ranks["named"] == [
        (0, "us-east", 2, 2, 0, 0),
        (1, "eu-west", 2, 2, 0, 0),
        (0, "us-east", 2, 2, 1, 1),
        (1, "eu-west", 2, 2, 1, 1),
    ]


def _int8_residual(rank, world, sites):
    from multidc.hierarchical.all_reduce import residual_numel, submit

    topo = Topology.build(site=sites[rank])
    wan = WanConfig(compression="int8", chunk_mb=0.25)
    scale = 100.0 if topo.site == 1 else 1.0  # the sites differ in scale: another site's row is far off
    x = _inputs(rank, 70_001, torch.float32) * scale
    site_sum = sum(_inputs(r, 70_001, torch.float32) * scale for r in range(world) if sites[r] == sites[rank])
    residual = torch.zeros(residual_numel(x.numel(), 4, topo, wan))
    submit(x, topo, wan, op="sum", residual=residual).wait()
    # int8 rounding of this site's partial: |error| <= max|shard| / 254 per chunk, <= max|site sum| / 254.
    return residual.abs().max().item(), site_sum.abs().max().item() / 254, torch.count_nonzero(residual).item()


INT8_SITES = {"site1-first": [1, 1, 0, 0], "named-crossed": ["a", "b", "b", "a"]}


@pytest.mark.parametrize("sites", sorted(INT8_SITES))
def test_int8_residual_is_this_ranks_own_rounding_when_rails_list_sites_out_of_rank_order(four_ranks, sites):
    # The rail group orders its ranks by rank, not by site: the residual must use this rank's own row.
    for rank, (worst, bound, nonzero) in enumerate(four_ranks[f"int8 {sites}"]):
        assert nonzero > 0 and worst <= bound * 1.01, (rank, worst, bound)


TOPK_NUMEL = 70_001


def _topk_wan() -> WanConfig:
    # 6 chunks, the last one padded; shards of 6,554 elements: a partial top-k chunk
    return WanConfig(chunk_mb=0.05, compression="topk")


def _topk_sites(rank, world):
    from multidc.hierarchical.all_reduce import residual_numel, submit

    topo = Topology.build(site=LAYOUTS["2x2"][rank])
    wan = _topk_wan()
    y = _inputs(rank, TOPK_NUMEL, torch.float32)
    residual = torch.zeros(residual_numel(TOPK_NUMEL, 4, topo, wan))
    before = topo.wan_stats.snapshot()["bytes_sent"]
    submit(y, topo, wan, op="sum", residual=residual).wait()  # as the DDP hook calls it: site sum, then the WAN
    sent = topo.wan_stats.snapshot()["bytes_sent"] - before
    replicated = _inputs(100 + topo.site, TOPK_NUMEL, torch.float32)  # as DiLoCo calls it: one value per site
    all_reduce(replicated, topo, wan=wan, op="avg", replicated=True)
    return y, residual, sent, replicated


def _topk_reference(per_site: list[torch.Tensor], rails: int, compression: str = "topk", weights=None):
    """The result, each rail's residual per site and the bytes each rank sends, with the codec applied by hand to
    each site's shard of each chunk, decoded (times the site's weight) and summed in site order."""
    codec, wan = get_codec(compression), _topk_wan()
    result, residuals, sent = [], [[[] for _ in range(rails)] for _ in per_site], 0
    for chunk in plan_chunks(TOPK_NUMEL, 4, wan.chunk_mb, rails):
        shards = [
            torch.nn.functional.pad(v[chunk.start : chunk.end], (0, chunk.padded_numel - chunk.numel)).split(
                chunk.shard_numel
            )
            for v in per_site
        ]
        summed = []
        for rail in range(rails):
            rows = torch.stack([codec.encode(site_shards[rail]) for site_shards in shards])
            summed.append(codec.decode_sum(rows, chunk.shard_numel, weights))
            for site, site_shards in enumerate(shards):
                residuals[site][rail].append(site_shards[rail] - codec.decode(rows[site], chunk.shard_numel))
        result.append(torch.cat(summed)[: chunk.numel])
        sent += codec.wire_bytes(chunk.shard_numel) * (len(per_site) - 1)
    return torch.cat(result), [[torch.cat(r) for r in site] for site in residuals], sent


def test_topk_codec_end_to_end_equals_the_codec_applied_by_hand_on_every_rank(four_ranks):
    results = four_ranks["topk 2x2"]
    inputs = [_inputs(r, TOPK_NUMEL, torch.float32) for r in range(4)]
    expected, residuals, sent = _topk_reference([inputs[0] + inputs[1], inputs[2] + inputs[3]], rails=2)
    per_site = [_inputs(100 + s, TOPK_NUMEL, torch.float32) for s in range(2)]
    replicated, _, replicated_sent = _topk_reference(per_site, rails=2)
    for rank, (y, residual, rank_sent, y_replicated) in enumerate(results):
        site, rail = divmod(rank, 2)  # 2x2: ranks 0, 1 are site 0's rails 0, 1
        assert torch.equal(y, expected), f"rank {rank}: differs from the codec applied by hand"
        assert torch.equal(residual, residuals[site][rail]), f"rank {rank}: residual is not its own shard's error"
        assert rank_sent == sent, (rank, rank_sent, sent)
        assert torch.equal(y_replicated, replicated / 2), f"rank {rank}: replicated average differs"
    assert 8 * sent < 0.3 * TOPK_NUMEL / 2 * 1.05  # each rank sends under 0.3 bit per element of its half


# "reversed": site 1 holds the lower ranks, so a rail's rows are not in site order
WEIGHTED_LAYOUTS = {name: LAYOUTS[name] for name in ("3+1", "2x2", "4x1")} | {"reversed": [1, 1, 0, 0]}


def _weighted(rank, world, sites):
    """Replicated values averaged with per-site weights: each rank's part is rank + 1 (a site weighs their sum)."""
    topo = Topology.build(site=sites[rank])
    per_site = [_inputs(100 + s, TOPK_NUMEL, torch.float32) for s in range(topo.num_sites)]
    out = {}
    for compression in ("none", "int8", "topk"):
        wan = dataclasses.replace(_topk_wan(), compression=compression)
        y, same, plain = (per_site[topo.site].clone() for _ in range(3))
        all_reduce(y, topo, wan=wan, op="avg", replicated=True, weight=float(rank + 1))
        # sites weighing the same: bitwise the plain mean
        all_reduce(same, topo, wan=wan, op="avg", replicated=True, weight=6.0 / sites.count(topo.site))
        all_reduce(plain, topo, wan=wan, op="avg", replicated=True)
        out[compression] = (y, torch.equal(same, plain), _digest(y))
    half = per_site[topo.site].to(torch.bfloat16)  # uncompressed bf16: weighted in float32, rounded once
    all_reduce(half, topo, wan=dataclasses.replace(_topk_wan(), compression="none"), op="avg", replicated=True,
               weight=float(rank + 1))
    out["bf16"] = (half, True, _digest(half))
    try:
        all_reduce(per_site[topo.site].clone(), topo, wan=_topk_wan(), op="avg", replicated=True,
                   weight=-1.0 if rank == 2 else 1.0)
        out["bad"] = "no error"
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


@pytest.mark.parametrize("layout", sorted(WEIGHTED_LAYOUTS))
def test_weighted_replicated_mean_weighs_each_site_by_the_sum_of_its_ranks_parts(four_ranks, layout):
    sites = WEIGHTED_LAYOUTS[layout]
    results = four_ranks[f"weighted {layout}"]
    totals = torch.tensor([sum(r + 1.0 for r in range(4) if sites[r] == s) for s in range(max(sites) + 1)],
                          dtype=torch.float64)
    weights = (totals / totals.sum()).float()
    per_site = [_inputs(100 + s, TOPK_NUMEL, torch.float32) for s in range(len(totals))]
    exact = sum(w.double() * x.double() for w, x in zip(weights, per_site))
    magnitude = sum(w.double() * x.double().abs() for w, x in zip(weights, per_site))
    rails = min(sites.count(s) for s in set(sites))
    for compression in ("none", "int8", "topk"):
        for rank, (y, same_is_plain, _) in enumerate(r[compression] for r in results):
            assert same_is_plain, f"{layout} {compression} rank {rank}: equal weights differ from the plain mean"
            if compression == "none":  # float32 products, summed in gloo's ring order: rounding only
                assert ((y.double() - exact).abs() <= 4 * torch.finfo(torch.float32).eps * magnitude).all()
            else:  # decoded, weighted and summed in site order: the codec applied by hand, bitwise
                expected, _, _ = _topk_reference(per_site, rails, compression, weights)
                assert torch.equal(y, expected), f"{layout} {compression} rank {rank}: differs from by hand"
        assert len({r[compression][2] for r in results}) == 1, f"{layout} {compression}: ranks differ"
    for rank, (half, _, _) in enumerate(r["bf16"] for r in results):
        bound = 2 * torch.finfo(torch.bfloat16).eps * magnitude + 1e-30  # each site rounded once, then the sum
        assert ((half.double() - exact).abs() <= bound).all(), f"{layout} bf16 rank {rank}"
    assert len({r["bf16"][2] for r in results}) == 1, f"{layout} bf16: ranks differ"
    errors = {r["bad"] for r in results}  # one rank's bad part: the same error on every rank, naming it
    assert len(errors) == 1 and "ranks [2] gave [-1.0]" in errors.pop()
    plain = sum(x.double() for x in per_site) / len(per_site)
    assert (exact - plain).abs().max() > 1e-2, "the weights must change the result"


def test_weight_needs_a_replicated_mean():
    with pytest.raises(ValueError, match="replicated=True, op='avg'"):
        all_reduce(torch.ones(3), None, op="sum", replicated=True, weight=1.0)  # refused before the topology is used


@pytest.fixture(scope="module")
def four_ranks():
    """Every case of this module on one set of 4 spawned gloo ranks; ``four_ranks[case]``: per-rank results.
    The cases that must raise come last."""
    assert all(len(sites) == 4 for sites in LAYOUTS.values())
    cases = {f"layout {name}": (_case_results, (sites,)) for name, sites in sorted(LAYOUTS.items())}
    cases |= {f"replicated {name}": (_replicated, (LAYOUTS[name],)) for name in REPLICATED_LAYOUTS}
    cases |= {f"bytes {compression}": (_bytes_over_wan, (compression,)) for compression, _ in BYTES_PER_ELEMENT}
    cases |= {"async": (_async_and_views, ()), "named": (_named_sites, ())}
    cases |= {f"int8 {name}": (_int8_residual, (sites,)) for name, sites in INT8_SITES.items()}
    cases |= {"topk 2x2": (_topk_sites, ())}
    cases |= {f"weighted {name}": (_weighted, (sites,)) for name, sites in WEIGHTED_LAYOUTS.items()}
    cases |= {f"bad layout {i}": (_layout_error, (kwargs, env)) for i, (kwargs, env, _) in enumerate(BAD_LAYOUTS)}
    return run_cases(cases, 4, timeout=540)
