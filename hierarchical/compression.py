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

    def wire_numel(self, numel: int) -> int:
        """Elements of the wire tensor for a shard of ``numel`` elements."""
        return numel

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
    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype
        self._eps = torch.finfo(dtype).eps

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        return wire.float()

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        # Round to nearest: half an ulp, i.e. eps/2 relative (the smallest fp16 normals aside).
        tiny = torch.finfo(self.dtype).tiny
        return x.float().abs() * (self._eps / 2) + tiny


class Int8Codec(Codec):
    """Symmetric int8 with one float32 scale per shard (``max|x| / 127``), carried in the last 4 wire bytes."""

    name = "int8"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = _int8_scale(xf)
        wire = torch.empty(xf.numel() + 4, dtype=torch.uint8, device=x.device)
        q = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
        wire[:-4].copy_(q.view(torch.uint8))
        wire[-4:].copy_(scale.reshape(1).view(torch.uint8))
        return wire

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        scale = wire[numel : numel + 4].clone().view(torch.float32)
        return wire[:numel].view(torch.int8).float() * scale

    def wire_numel(self, numel: int) -> int:
        return numel + 4

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        return _int8_scale(x.float()).expand(x.shape) / 2


def _int8_scale(xf: torch.Tensor) -> torch.Tensor:
    amax = xf.abs().max() if xf.numel() else torch.zeros((), device=xf.device)
    return torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(torch.float32)


def get_codec(name: str) -> Codec | None:
    """The codec for a ``WanConfig.compression`` value; ``None`` for ``"none"``."""
    codecs = {
        "none": None,
        "bf16": _CastCodec("bf16", torch.bfloat16),
        "fp16": _CastCodec("fp16", torch.float16),
        "int8": Int8Codec(),
    }
    if name not in codecs:
        raise ValueError(f"unknown WAN compression {name!r}; use one of {sorted(codecs)}.")
    return codecs[name]
