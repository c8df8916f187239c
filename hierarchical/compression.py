"""WAN codecs: how a site-reduced shard is encoded for the inter-site hop and summed back.

Compressed shards travel by all-gather; every rank decodes all sites' shards and adds them in site order in
float32. The sum is therefore the same, bit for bit, on every rank, and precision is lost only once, in
``encode``. Each codec's ``max_abs_error`` states that loss.
"""

from __future__ import annotations

import torch


class Codec:
    """Encode a 1-D float tensor into a 1-D wire tensor and back. Subclasses set ``name``."""

    name = ""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        """Float32 values of one encoded shard of ``numel`` elements."""
        raise NotImplementedError

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise bound on ``|decode(encode(x)) - x|``."""
        raise NotImplementedError

    def decode_sum(self, gathered: torch.Tensor, numel: int) -> torch.Tensor:
        """Sum of the decoded rows of ``gathered`` (one row per site), added in row order in float32."""
        total = self.decode(gathered[0], numel).clone()
        for row in gathered[1:]:
            total.add_(self.decode(row, numel))
        return total


class _CastCodec(Codec):
    """A plain cast, for a target type with float32's exponent range (bfloat16): no overflow, no scale needed."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype
        self._eps = torch.finfo(dtype).eps

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        return wire.float()

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        # Round to nearest: half an ulp, i.e. eps/2 relative; ``tiny`` covers values in the subnormal range.
        tiny = torch.finfo(self.dtype).tiny
        return x.float().abs() * (self._eps / 2) + tiny


class Fp16Codec(Codec):
    """float16 with one power-of-two float32 scale per shard, carried in the last 2 wire elements (4 bytes).

    A plain cast would turn every value above 65504 into ``inf`` and flush values below ``6e-8`` to zero. The
    shard is multiplied by ``2**k`` so that its largest magnitude lands in ``[2**14, 2**15)``; scaling by a power
    of two is exact, so the only loss is float16's rounding: ``eps/2 = 2**-11`` relative, plus half a float16
    subnormal step (scaled back) for values ``2**-28`` times smaller than the shard's largest. ``inf`` and
    ``nan`` stay non-finite, so overflow checks (``GradScaler``) still see them.
    """

    name = "fp16"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = _fp16_scale(xf)
        wire = torch.empty(xf.numel() + 2, dtype=torch.float16, device=x.device)
        wire[:-2].copy_(xf * scale)
        wire[-2:].copy_(scale.reshape(1).view(torch.float16))
        return wire

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        scale = wire[numel : numel + 2].clone().view(torch.float32)
        return wire[:numel].float() / scale

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return xf.abs() * 2.0**-11 + 2.0**-25 / _fp16_scale(xf)


def _fp16_scale(xf: torch.Tensor) -> torch.Tensor:
    amax = xf.abs().max() if xf.numel() else torch.zeros((), device=xf.device)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1); 0, inf, nan give exponent 0
    k = (15 - exponent.to(torch.int32)).clamp(-126, 127)  # a normal float32, so the bits below are exact
    return ((k + 127) << 23).view(torch.float32)


class Int8Codec(Codec):
    """Symmetric int8 with one float32 scale per shard (``max|x| / 127``), carried in the last 4 wire bytes.

    A shard holding ``nan`` or ``inf`` decodes to all ``nan``: non-finite gradients stay visible to overflow
    checks instead of turning into finite garbage.
    """

    name = "int8"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = _int_scale(xf, 127)
        wire = torch.empty(xf.numel() + 4, dtype=torch.uint8, device=x.device)
        q = torch.round(xf / scale).clamp_(-127, 127).nan_to_num_(0).to(torch.int8)
        wire[:-4].copy_(q.view(torch.uint8))
        wire[-4:].copy_(scale.reshape(1).view(torch.uint8))
        return wire

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        scale = wire[numel : numel + 4].clone().view(torch.float32)
        return wire[:numel].view(torch.int8).float() * scale

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        # Half a quantisation step, plus float32 rounding of the division and the product.
        xf = x.float()
        return _int_scale(xf, 127).expand(x.shape) / 2 + xf.abs() * torch.finfo(torch.float32).eps


def _int_scale(xf: torch.Tensor, levels: int) -> torch.Tensor:
    amax = xf.abs().max() if xf.numel() else torch.zeros((), device=xf.device)
    # Floor at the smallest normal float32: an all-zero shard stays exactly zero, a tiny one is not divided by a
    # subnormal (or zero) scale. ``clamp_min`` keeps nan, so a nan anywhere makes the whole shard decode to nan.
    return (amax / levels).clamp_min(torch.finfo(torch.float32).tiny).to(torch.float32)


class Int4Codec(Codec):
    """Symmetric 4-bit integers (-7..7) with one float32 scale per shard (``max|x| / 7``), two values per wire
    byte, then the scale in the last 4 bytes: an eighth of float32's bytes. Coarse (half a step is 1/14 of the
    shard's largest magnitude): meant for DiLoCo's pseudo-gradients (Streaming DiLoCo sends 4-bit outer
    gradients), not per-step gradients. A shard holding ``nan`` or ``inf`` decodes to all ``nan``.
    """

    name = "int4"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = _int_scale(xf, 7)
        q = torch.round(xf / scale).clamp_(-7, 7).nan_to_num_(0).to(torch.uint8) + 8  # 1..15
        if q.numel() % 2:
            q = torch.cat([q, q.new_full((1,), 8)])
        wire = torch.empty(q.numel() // 2 + 4, dtype=torch.uint8, device=x.device)
        wire[:-4].copy_(q[0::2] | (q[1::2] << 4))
        wire[-4:].copy_(scale.reshape(1).view(torch.uint8))
        return wire

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        packed = wire[: (numel + 1) // 2]
        scale = wire[(numel + 1) // 2 : (numel + 1) // 2 + 4].clone().view(torch.float32)
        q = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:numel]
        return (q.float() - 8) * scale

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return _int_scale(xf, 7).expand(x.shape) / 2 + xf.abs() * torch.finfo(torch.float32).eps


def get_codec(name: str) -> Codec | None:
    """The codec for a ``WanConfig.compression`` value; ``None`` for ``"none"``."""
    codecs = {
        "none": None,
        "bf16": _CastCodec("bf16", torch.bfloat16),
        "fp16": Fp16Codec(),
        "int8": Int8Codec(),
        "int4": Int4Codec(),
    }
    if name not in codecs:
        raise ValueError(f"unknown WAN compression {name!r}; use one of {sorted(codecs)}.")
    return codecs[name]
