"""The top-k codec: exactly k values per chunk, a wire size fixed by numel, its stated error, exact grid round trips,
and the property error feedback relies on (what a sync drops stays in the residual and is sent later)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multidc.hierarchical import get_codec
from multidc.hierarchical.compression import TopKCodec

# (density, bits, chunk): the defaults, one-byte and two-byte positions, every bit width, chunks of 1 and odd sizes
SETTINGS = [(1 / 64, 2, 256), (0.0625, 4, 64), (0.02, 8, 1000), (0.3, 1, 7), (1.0, 2, 5), (0.5, 8, 1), (0.01, 2, 300)]
EPS = torch.finfo(torch.float32).eps


def _levels(bits: int) -> torch.Tensor:
    """The codec's level fractions, computed here from their definition: (2j + 1) / (2**bits - 1)."""
    half = 2 ** (bits - 1)
    return torch.tensor([(2 * j + 1) / (2 * half - 1) for j in range(-half, half)], dtype=torch.float64).float()


def _chunks(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    return list(x.split(chunk))


@settings(max_examples=200, deadline=None)
@given(
    setting=st.sampled_from(SETTINGS),
    numel=st.integers(1, 2100),
    exponent=st.integers(-140, 124),
    zero_fraction=st.sampled_from([0.0, 0.5, 0.99, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_error_within_stated_bound_for_any_length_scale_and_sparsity(setting, numel, exponent, zero_fraction, seed):
    codec = TopKCodec(*setting)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 2.0**exponent  # down into float32's subnormals, up to near its max
    x[torch.rand(numel, generator=g) < zero_fraction] = 0
    y = codec.decode(codec.encode(x), numel)
    assert y.dtype == torch.float32 and y.shape == (numel,) and torch.isfinite(y).all()
    excess = ((y.double() - x.double()).abs() - codec.max_abs_error(x).double()).max().item()
    assert excess <= 0, f"{codec.name}: error exceeds max_abs_error by {excess:g} (numel={numel})"


@pytest.mark.parametrize("setting", SETTINGS)
def test_bound_is_the_value_itself_when_dropped_and_a_level_gap_when_kept(setting):
    codec = TopKCodec(*setting)
    x = torch.randn(1234, generator=torch.Generator().manual_seed(1))
    y, bound = codec.decode(codec.encode(x), x.numel()), codec.max_abs_error(x)
    for xc, yc, bc in zip(_chunks(x, codec.chunk), _chunks(y, codec.chunk), _chunks(bound, codec.chunk)):
        kept = yc != 0  # a kept value never decodes to zero in a chunk that is not all zeros
        assert torch.equal(bc[~kept], xc[~kept].abs())
        gap = xc[kept].abs().max() / (2**codec.bits - 1)
        assert (bc[kept] <= gap * (1 + 4 * EPS) + 4 * EPS * xc[kept].abs().max()).all()


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("numel", [1, 3, 255, 1000, 4097])
def test_each_chunk_keeps_exactly_its_k_largest_magnitudes(setting, numel):
    codec = TopKCodec(*setting)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))  # distinct, non-zero magnitudes
    y = codec.decode(codec.encode(x), numel)
    assert codec.k == max(1, round(setting[0] * setting[2]))
    for xc, yc in zip(_chunks(x, codec.chunk), _chunks(y, codec.chunk)):
        k = min(codec.k, xc.numel())  # the last chunk's padding zeros are kept last and never decoded
        largest = set(xc.abs().topk(k).indices.tolist())
        assert set(torch.nonzero(yc).view(-1).tolist()) == largest


@pytest.mark.parametrize("setting", SETTINGS)
def test_wire_size_is_a_function_of_numel_only(setting):
    codec = TopKCodec(*setting)
    density, bits, chunk = setting
    for numel in (1, 2, chunk, chunk + 1, 5000):
        chunks = math.ceil(numel / chunk)
        kept = chunks * codec.k
        expected = 4 * chunks + (1 if chunk <= 256 else 2) * kept + math.ceil(kept * bits / 8)
        assert codec.wire_bytes(numel) == expected
        for x in (torch.randn(numel), torch.zeros(numel), torch.full((numel,), float("nan"))):
            wire = codec.encode(x)
            assert wire.dtype == torch.uint8 and wire.shape == (expected,)


def test_default_spends_under_one_bit_per_parameter():
    codec = get_codec("topk")
    assert (codec.density, codec.bits, codec.chunk, codec.k, codec.name) == (1 / 64, 2, 256, 4, "topk")
    numel = 256 * 1000
    assert 8 * codec.wire_bytes(numel) / numel == (4 * (8 + 2) + 32) / 256 == 0.28125


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("numel", [1, 6, 1000, 2049])
def test_values_already_on_the_grid_round_trip_bit_exactly(setting, numel):
    codec = TopKCodec(*setting)
    g = torch.Generator().manual_seed(numel)
    levels = _levels(codec.bits)
    x = torch.zeros(numel)
    for start in range(0, numel, codec.chunk):
        length = min(codec.chunk, numel - start)
        k = min(codec.k, length)
        positions = torch.randperm(length, generator=g)[:k] + start
        codes = torch.randint(0, 2**codec.bits, (k,), generator=g)
        codes[0] = 0 if codes[0] < 2 ** (codec.bits - 1) else 2**codec.bits - 1  # one of +-m: m is the scale
        scale = torch.rand((), generator=g) * 10.0 ** torch.randint(-30, 30, (), generator=g)
        x[positions] = levels[codes] * scale
    y = codec.decode(codec.encode(x), numel)
    assert torch.equal(y, x)
    assert torch.equal(codec.decode(codec.encode(y), numel), y)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, -1])
def test_non_finite_value_anywhere_decodes_whole_shard_to_nan(setting, bad, where):
    # A GradScaler must still see an overflowed step after the WAN hop, in every chunk, not a finite remainder.
    codec = TopKCodec(*setting)
    x = torch.randn(777)
    x[where] = bad
    assert torch.isnan(codec.decode(codec.encode(x), 777)).all()
    assert torch.isnan(codec.max_abs_error(x)).all()  # the bound says so too


@pytest.mark.parametrize("setting", SETTINGS)
def test_all_zero_chunks_decode_to_positive_zeros_next_to_a_loud_chunk(setting):
    codec = TopKCodec(*setting)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(600)), 600), torch.zeros(600))
    x = torch.zeros(3 * codec.chunk)
    x[codec.chunk : 2 * codec.chunk] = 1e30 * torch.randn(codec.chunk)
    y = codec.decode(codec.encode(x), x.numel())
    quiet = torch.cat([y[: codec.chunk], y[2 * codec.chunk :]])
    assert torch.equal(quiet, torch.zeros_like(quiet)) and not torch.signbit(quiet).any()


def _feedback_rounds(codec, inputs):
    """Error feedback as the all-reduce keeps it: send input + residual, keep (in float32) what was not sent."""
    residual = torch.zeros_like(inputs[0])
    sent, residuals, rounding = [], [], torch.zeros(inputs[0].numel(), dtype=torch.float64)
    for x in inputs:
        values = x + residual
        decoded = codec.decode(codec.encode(values), values.numel())
        residual = values - decoded
        sent.append(decoded)
        residuals.append(residual)
        rounding += EPS * (values.double().abs() + residual.double().abs())  # the two float32 roundings per round
    return sent, residuals, rounding


def _contraction_bound(codec) -> float:
    """sup ||residual|| per chunk over max ||input|| per chunk, from ||v - C(v)||^2 <= (1 - (1 - k e^2) k / chunk)
    ||v||^2: the dropped part is at most (chunk - k) / k times the kept part, a kept value errs by at most e = 1 /
    (2**bits - 1) of the chunk's largest."""
    e = 1 / (2**codec.bits - 1)
    alpha = math.sqrt(1 - (1 - codec.k * e * e) * codec.k / codec.chunk)
    return alpha / (1 - alpha)


# settings whose codec is a contraction by the bound above (k e^2 < 1)
CONTRACTING = [s for s in SETTINGS if TopKCodec(*s).k / (2 ** s[1] - 1) ** 2 < 1]


@settings(max_examples=40, deadline=None)
@given(
    setting=st.sampled_from(CONTRACTING),
    numel=st.integers(1, 1500),
    rounds=st.integers(1, 60),
    seed=st.integers(0, 2**31 - 1),
)
def test_error_feedback_sends_the_running_sum_less_a_bounded_residual(setting, numel, rounds, seed):
    codec = TopKCodec(*setting)
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(numel, generator=g) * 10.0 ** torch.randint(-3, 4, (), generator=g) for _ in range(rounds)]
    sent, residuals, rounding = _feedback_rounds(codec, inputs)
    # Telescoping: sum(sent) = sum(inputs) - final residual, up to the float32 rounding of each round.
    gap = sum(d.double() for d in sent) - (sum(x.double() for x in inputs) - residuals[-1].double())
    assert (gap.abs() <= rounding + 1e-30).all()
    # The residual does not grow with the rounds: per chunk, at most the contraction bound times the largest input.
    largest = torch.stack([torch.stack([c.norm() for c in _chunks(x, codec.chunk)]) for x in inputs]).amax(0)
    for residual in residuals:
        norms = torch.stack([c.norm() for c in _chunks(residual, codec.chunk)])
        assert (norms <= largest * _contraction_bound(codec) * (1 + 1e-3)).all()


def test_error_feedback_delivers_every_entry_of_a_constant_input_on_average():
    codec = get_codec("topk")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    sent, residuals, _ = _feedback_rounds(codec, [x] * 1280)
    mean = sum(d.double() for d in sent) / len(sent)
    # Without feedback each chunk would send the same 4 entries every round and the others never.
    alone = codec.decode(codec.encode(x), x.numel())
    assert (alone != 0).sum() == 4 * math.ceil(3000 / 256)
    assert (mean - x.double()).abs().max() < 0.05 * x.abs().max()
    assert (mean - x.double()).abs().max() <= residuals[-1].abs().max() / len(sent) * (1 + 1e-3)


@pytest.mark.parametrize(
    "spelling,expected",
    [("topk", (1 / 64, 2, 256)), ("topk:0.02", (0.02, 2, 256)), ("topk:0.02:4", (0.02, 4, 256)),
     ("topk:0.5:8:4096", (0.5, 8, 4096)), ("topk:1:1:1", (1.0, 1, 1))],
)
def test_get_codec_spellings_set_density_bits_and_chunk(spelling, expected):
    codec = get_codec(spelling)
    assert (codec.density, codec.bits, codec.chunk) == expected
    again = get_codec(codec.name)  # the name is a spelling that builds the same codec
    assert (again.density, again.bits, again.chunk) == expected


@pytest.mark.parametrize(
    "spelling,match",
    [("topk:", "could not convert"), ("topk:0", "density=0.0"), ("topk:1.5", "density=1.5"),
     ("topk:nan", "density=nan"), ("topk:0.1:3", "bits=3"), ("topk:0.1:2.5", "invalid literal"),
     ("topk:0.1:2:0", "chunk=0"), ("topk:0.1:2:65537", "chunk=65537"), ("topk:0.1:2:64:1", "more than three")],
)
def test_get_codec_bad_topk_spelling_names_the_field_and_the_form(spelling, match):
    with pytest.raises(ValueError, match=match) as info:
        get_codec(spelling)
    assert "'topk:DENSITY[:BITS[:CHUNK]]'" in str(info.value)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"density": 0}, "density=0"), ({"density": True}, "density=True"), ({"bits": 3}, "bits=3"),
     ({"chunk": 256.0}, "chunk=256.0"), ({"chunk": 70000}, "chunk=70000")],
)
def test_topk_codec_rejects_arguments_out_of_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKCodec(**kwargs)
