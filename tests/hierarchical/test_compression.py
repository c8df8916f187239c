"""WAN codecs: round trip within each codec's stated ``max_abs_error``, per-shard scales, fixed decode order.

The top-k codec's own properties (k per chunk, exact grid, error feedback) are in ``test_topk_codec.py``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multidc.hierarchical import get_codec

# "topk": per 256-element chunk a 4-byte scale, 4 one-byte positions, 4 2-bit values (1 byte). The denser topk has
# two-byte positions (chunk 1024) and overlapping rows for the decode-order test: 4 + 256 * 2 + 256 / 2 per chunk.
CODECS = ("bf16", "fp16", "int8", "int4", "topk", "topk:0.25:4:1024")
WIRE_BYTES = {
    "bf16": lambda n: 2 * n, "fp16": lambda n: 2 * n + 4, "int8": lambda n: n + 4, "int4": lambda n: (n + 1) // 2 + 4,
    "topk": lambda n: 9 * -(-n // 256), "topk:0.25:4:1024": lambda n: 644 * -(-n // 1024),
}


def _round_trip(codec, x: torch.Tensor) -> torch.Tensor:
    wire = codec.encode(x)
    assert wire.dim() == 1 and wire.numel() * wire.element_size() == WIRE_BYTES[codec.name](x.numel())
    return codec.decode(wire, x.numel())


def _assert_within_bound(codec, x: torch.Tensor) -> None:
    y = _round_trip(codec, x)
    assert y.dtype == torch.float32 and y.shape == (x.numel(),)
    error = (y.double() - x.double()).abs()
    bound = codec.max_abs_error(x).double()
    assert torch.isfinite(y).all(), f"{codec.name}: finite input decoded to non-finite values"
    worst = (error - bound).max().item()
    assert worst <= 0, f"{codec.name}: error exceeds max_abs_error by {worst:g} (numel={x.numel()})"


def _data(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "huge":  # far above float16's 65504
        return x * 1e30
    if kind == "small":  # far below float16's smallest subnormal
        return x * 1e-30
    if kind == "mixed":  # eight decades inside one shard
        return x * 10.0 ** torch.randint(-4, 5, (n,), generator=g).float()
    if kind == "one-hot":
        y = torch.zeros(n)
        y[n // 2] = -3.5
        return y
    return x


@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("kind", ["normal", "zeros", "huge", "small", "mixed", "one-hot"])
@pytest.mark.parametrize("n", [1, 2, 7, 4097, 65_537])
def test_round_trip_error_within_stated_bound(codec_name, kind, n):
    _assert_within_bound(get_codec(codec_name), _data(kind, n, seed=n))


@settings(max_examples=150, deadline=None)
@given(
    codec_name=st.sampled_from(CODECS),
    values=st.lists(
        st.floats(min_value=-(2.0**127), max_value=2.0**127, allow_nan=False, width=32), min_size=1, max_size=64
    ),
)
def test_round_trip_error_within_stated_bound_for_any_finite_values(codec_name, values):
    _assert_within_bound(get_codec(codec_name), torch.tensor(values, dtype=torch.float32))


@pytest.mark.parametrize("codec_name", CODECS)
def test_wire_size_in_bytes(codec_name):
    codec = get_codec(codec_name)
    for n in (1, 7, 1000):
        wire = codec.encode(torch.randn(n))
        assert wire.numel() * wire.element_size() == WIRE_BYTES[codec_name](n) == codec.wire_bytes(n)


@pytest.mark.parametrize("codec_name", CODECS)
def test_zeros_round_trip_exactly(codec_name):
    codec = get_codec(codec_name)
    assert torch.equal(_round_trip(codec, torch.zeros(33)), torch.zeros(33))


@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_stays_non_finite(codec_name, bad):
    # A GradScaler must still see an overflowed gradient after the WAN hop, not finite garbage.
    x = torch.randn(17)
    x[5] = bad
    y = _round_trip(get_codec(codec_name), x)
    assert not torch.isfinite(y[5])


def test_fp16_keeps_values_beyond_the_float16_range():
    codec = get_codec("fp16")
    x = torch.tensor([1e6, -7e4, 3.0, 1e-12])
    y = _round_trip(codec, x)
    assert torch.isfinite(y).all()
    assert torch.allclose(y[:3], x[:3], rtol=2.0**-11, atol=0)


def test_fp16_scale_keeps_relative_precision_for_tiny_shards():
    # 1e-9 is below float16's smallest subnormal (6e-8): a plain cast would send zeros.
    x = torch.randn(100, generator=torch.Generator().manual_seed(3)) * 1e-9
    y = _round_trip(get_codec("fp16"), x)
    assert ((y - x).abs() <= x.abs() * 2.0**-11).all()


def test_int8_all_zero_shard_stays_exactly_zero_next_to_a_large_shard():
    codec = get_codec("int8")
    shards = [torch.zeros(64), torch.randn(64) * 1e4]
    decoded = [_round_trip(codec, s) for s in shards]
    assert torch.equal(decoded[0], torch.zeros(64))


def test_int8_outlier_only_coarsens_its_own_shard():
    codec = get_codec("int8")
    g = torch.Generator().manual_seed(11)
    quiet = torch.randn(256, generator=g)
    loud = torch.randn(256, generator=g)
    loud[17] = 1e6
    quiet_error = (_round_trip(codec, quiet) - quiet).abs().max().item()
    loud_error = (_round_trip(codec, loud) - loud).abs()
    # The quiet shard keeps its own fine step (max|x|/254); the outlier's step (about 3937) applies only to
    # the loud shard, whose ordinary values all collapse to zero.
    assert quiet_error <= quiet.abs().max().item() / 254 * 1.0001
    assert quiet_error < 0.05
    assert loud_error.max().item() > 1.0
    assert loud_error.max().item() <= 1e6 / 254 * 1.0001
    assert torch.equal(_round_trip(codec, loud)[loud.abs() < 100], torch.zeros(255))


def test_int8_scale_is_per_shard_not_per_tensor():
    codec = get_codec("int8")
    small = torch.linspace(-1, 1, 255)
    together = torch.cat([small, torch.tensor([1e3])])
    alone_error = (_round_trip(codec, small) - small).abs().max().item()
    together_error = (_round_trip(codec, together)[:255] - small).abs().max().item()
    assert alone_error <= 1 / 254 + 1e-7
    assert together_error > 100 * alone_error


@pytest.mark.parametrize("name", ["zstd", "", "INT8", "float16", None])
def test_get_codec_unknown_name_raises_value_error_listing_choices(name):
    choices = r"\['bf16', 'fp16', 'int4', 'int8', 'none', 'topk'\]"
    with pytest.raises(ValueError, match=r"unknown WAN compression .*use one of " + choices):
        get_codec(name)


def test_get_codec_none_means_no_codec():
    assert get_codec("none") is None
    assert {get_codec(n).name for n in CODECS} == set(CODECS)


def _fold_in_order(codec, gathered: torch.Tensor, numel: int, order) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float32)
    for row in order:
        total = total + codec.decode(gathered[row], numel)
    return total


# At density 1/64 the four rows below rarely share a position, so no order would show; the denser topk stands in.
@pytest.mark.parametrize("codec_name", [c for c in CODECS if c != "topk"])
def test_decode_sum_adds_sites_in_fixed_row_order_on_every_rank(codec_name):
    codec = get_codec(codec_name)
    numel, sites = 4099, 4
    g = torch.Generator().manual_seed(5)
    # Magnitudes spread so float32 addition is visibly non-associative for these rows.
    parts = [torch.randn(numel, generator=g) * 10.0 ** (3 * s - 4) for s in range(sites)]
    gathered = torch.stack([codec.encode(p) for p in parts])
    # Every rank holds the same gathered rows (the all-gather output) whatever its own site, and decode_sum
    # takes no rank: each rank's own codec folds the rows in site order, so all ranks agree bit for bit.
    in_order = _fold_in_order(codec, gathered, numel, range(sites))
    per_rank = [get_codec(codec_name).decode_sum(gathered.clone(), numel) for _ in range(sites)]
    assert all(torch.equal(result, in_order) for result in per_rank)
    # The order matters for these rows, so the test above would catch an order that varied by rank.
    other_orders = [_fold_in_order(codec, gathered, numel, order) for order in ([3, 2, 1, 0], [1, 0, 3, 2])]
    assert any(not torch.equal(o, in_order) for o in other_orders)
