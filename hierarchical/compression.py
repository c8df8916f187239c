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

    def wire_bytes(self, numel: int) -> int:
        """Bytes of ``encode``'s output for a shard of ``numel`` elements. A function of ``numel`` only, so every
        site's row of the all-gather has the same size without a size exchange."""
        raise NotImplementedError

    def decode_sum(self, gathered: torch.Tensor, numel: int, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of the decoded rows of ``gathered`` (one row per site), added in row order in float32; with
        ``weights`` (float32, one per row) each decoded row is first multiplied by its weight (two roundings, no
        fused multiply-add: the same bits on every device)."""
        def weighted(i: int) -> torch.Tensor:
            decoded = self.decode(gathered[i], numel)
            return decoded if weights is None else decoded.mul(weights[i])

        total = weighted(0).clone()
        for i in range(1, len(gathered)):
            total.add_(weighted(i))
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

    def wire_bytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize

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

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel + 4

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

    def wire_bytes(self, numel: int) -> int:
        return numel + 4

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

    def wire_bytes(self, numel: int) -> int:
        return (numel + 1) // 2 + 4

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return _int_scale(xf, 7).expand(x.shape) / 2 + xf.abs() * torch.finfo(torch.float32).eps


# Defaults: SparseLoCo's density (1/64, 1.56%) and 2-bit values. A chunk of 256 is the largest whose positions fit
# one byte (512 would need two: +8 bits per kept value, i.e. +0.125 bit/param at this density) while its float32 scale
# costs 32/256 = 0.125 bit/param; a smaller chunk pays more for scales (64: 0.5 bit/param), a larger one about the
# same in two-byte positions (4096: 0.29 bit/param in all) and has one scale for 64 kept values instead of 4.
_TOPK_DENSITY = 1 / 64
_TOPK_BITS = 2
_TOPK_CHUNK = 256


class TopKCodec(Codec):
    """Chunk-wise top-k with ``bits``-bit values: for DiLoCo's pseudo-gradients, with error feedback.

    The shard is cut into chunks of ``chunk`` elements (the last one padded with zeros). Each chunk sends exactly
    ``k = max(1, round(density * chunk))`` entries, its largest by magnitude, so the wire size is a function of the
    shard's length only (``wire_bytes``). A kept value ``x`` of a chunk whose largest magnitude is ``m`` is sent as
    the nearest of ``2**bits`` symmetric levels ``m * (2j + 1) / (2**bits - 1)``, ``j = -2**(bits-1) ..
    2**(bits-1) - 1``: no zero level (the kept values are the chunk's largest), and ``±m`` are levels, so ``m`` is
    sent exactly and re-encoding a decoded shard gives it back bit for bit.

    Error (``max_abs_error``): a dropped value is not sent, its error is itself (error feedback sends it later);
    a kept one is off by at most ``m / (2**bits - 1)`` (a third of ``m`` at 2 bits) plus float32 rounding. A kept
    zero of a chunk with fewer than ``k`` non-zero values decodes to the smallest positive level. A shard holding
    ``nan`` or ``inf`` decodes to all ``nan``; an all-zero chunk to exact zeros.

    Wire (uint8), for ``c = ceil(numel / chunk)`` chunks: ``c`` float32 scales ``m`` (native byte order) | ``c * k``
    positions within the chunk, one byte each when ``chunk <= 256``, else two (low byte first) | ``c * k`` level
    codes of ``bits`` bits, packed low bits first. That is ``(k * (8 * position_bytes + bits) + 32) / chunk`` bits
    per parameter: ``(4 * (8 + 2) + 32) / 256 = 0.28`` at the defaults (density 1/64, 2 bits, chunk 256, k = 4),
    114x fewer bytes than float32.

    Args:
        density: fraction of each chunk sent, in (0, 1].
        bits: bits per kept value: 1, 2, 4 or 8.
        chunk: elements per chunk, 1 to 65536.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, density: float = _TOPK_DENSITY, bits: int = _TOPK_BITS, chunk: int = _TOPK_CHUNK) -> None:
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"TopKCodec density={density!r} must be a fraction in (0, 1], e.g. {_TOPK_DENSITY}.")
        if isinstance(bits, bool) or bits not in (1, 2, 4, 8):
            raise ValueError(f"TopKCodec bits={bits!r} must be 1, 2, 4 or 8, e.g. {_TOPK_BITS}.")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 65536:
            raise ValueError(f"TopKCodec chunk={chunk!r} must be an integer from 1 to 65536, e.g. {_TOPK_CHUNK}.")
        self.density, self.bits, self.chunk = float(density), bits, chunk
        self.k = max(1, round(density * chunk))
        self.position_bytes = 1 if chunk <= 256 else 2
        defaults = (self.density, bits, chunk) == (_TOPK_DENSITY, _TOPK_BITS, _TOPK_CHUNK)
        self.name = "topk" if defaults else f"topk:{self.density!r}:{bits}:{chunk}"  # a spelling get_codec takes
        half = 2 ** (bits - 1)
        self._half = half
        # level j + half's fraction of the scale: (2j + 1) / (2 * half - 1); the outermost two are exactly -1 and 1
        self._levels = torch.arange(-half, half, dtype=torch.float64).mul(2).add(1).div(2 * half - 1).float()

    def wire_bytes(self, numel: int) -> int:
        chunks = -(-numel // self.chunk)
        kept = chunks * self.k
        return 4 * chunks + self.position_bytes * kept + -(-kept * self.bits // 8)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.reshape(-1).float()
        _, positions, kept = self._select(xf)
        scale = self._scale(kept, xf)
        # nearest level: floor(x / m * (2 * half - 1) / 2); |x| <= m keeps it in -half .. half - 1
        ratio = kept / torch.where(scale > 0, scale, 1.0)[:, None]  # an all-zero chunk: code `half`, decodes to +0
        q = torch.floor(ratio * (self._half - 0.5)).clamp_(-self._half, self._half - 1).nan_to_num_(0)
        codes = (q + self._half).to(torch.uint8).reshape(-1)
        wire = torch.empty(self.wire_bytes(xf.numel()), dtype=torch.uint8, device=xf.device)
        at = scale.numel() * 4
        wire[:at].copy_(scale.view(torch.uint8))
        wire[at : at + self.position_bytes * codes.numel()].copy_(_pack_positions(positions, self.position_bytes))
        wire[at + self.position_bytes * codes.numel() :].copy_(_pack_bits(codes, self.bits))
        return wire

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        chunks = -(-numel // self.chunk)
        kept = chunks * self.k
        at = 4 * chunks
        scale = wire[:at].clone().view(torch.float32)
        positions = _unpack_positions(wire[at : at + self.position_bytes * kept], self.position_bytes)
        codes = _unpack_bits(wire[at + self.position_bytes * kept :], self.bits, kept)
        values = self._levels.to(wire.device)[codes.long()].view(chunks, self.k) * scale[:, None]
        # zeros, or nan for every chunk of a shard that held nan / inf (its scales are all nan)
        rows = (scale * 0)[:, None].expand(chunks, self.chunk).contiguous()
        rows.scatter_(1, positions.view(chunks, self.k), values)
        return rows.view(-1)[:numel]

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.reshape(-1).float()
        rows, positions, kept = self._select(xf)
        scale = self._scale(kept, xf)[:, None]
        eps = torch.finfo(torch.float32).eps
        # half a level spacing, float32 rounding of the ratio and of the decoded product, one subnormal step
        kept_bound = scale / (2 * self._half - 1) + 2 * eps * kept.abs() + 2 * eps * scale + 2.0**-149
        # a dropped value: itself (all nan, like the decoded shard, when the shard holds nan / inf)
        bound = (rows.abs() + scale * 0).scatter_(1, positions, kept_bound)
        return bound.view(-1)[: xf.numel()].view(x.shape)

    def _select(self, xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The shard as ``(chunks, chunk)`` rows (zero-padded), each row's kept positions and their values."""
        pad = -xf.numel() % self.chunk
        rows = (torch.nn.functional.pad(xf, (0, pad)) if pad else xf).view(-1, self.chunk)
        positions = rows.abs().topk(self.k, dim=1, sorted=False).indices
        return rows, positions, rows.gather(1, positions)

    def _scale(self, kept: torch.Tensor, xf: torch.Tensor) -> torch.Tensor:
        """Each chunk's largest kept magnitude; all ``nan`` when the shard holds a non-finite value."""
        scale = kept.abs().amax(dim=1) if kept.numel() else kept.new_zeros(kept.shape[0])
        return torch.where(torch.isfinite(xf).all(), scale, torch.nan)


def _pack_positions(positions: torch.Tensor, width: int) -> torch.Tensor:
    flat = positions.reshape(-1)
    if width == 1:
        return flat.to(torch.uint8)
    return torch.stack([flat & 255, flat >> 8], dim=1).to(torch.uint8).reshape(-1)


def _unpack_positions(packed: torch.Tensor, width: int) -> torch.Tensor:
    if width == 1:
        return packed.long()
    pairs = packed.view(-1, 2).long()
    return pairs[:, 0] | (pairs[:, 1] << 8)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    pad = -codes.numel() % per_byte
    groups = torch.nn.functional.pad(codes, (0, pad)).view(-1, per_byte).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (groups << shifts).sum(dim=1).to(torch.uint8)  # the fields do not overlap: the sum is their bitwise or


def _unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    if bits == 8:
        return packed[:count]
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32)[:, None] >> shifts) & (2**bits - 1)).reshape(-1)[:count]


def is_sparse(name) -> bool:
    """Whether ``name`` (a ``WanConfig`` / ``DiLoCoConfig`` compression value) names a top-k codec: ``"topk"`` or
    ``"topk:DENSITY[:BITS[:CHUNK]]"``, whose dropped values need error feedback."""
    return isinstance(name, str) and (name == "topk" or name.startswith("topk:"))


def get_codec(name: str) -> Codec | None:
    """The codec for a ``WanConfig.compression`` value; ``None`` for ``"none"``.

    ``"topk"`` is ``TopKCodec()`` (density 1/64, 2 bits, chunk 256: 0.28 bit per parameter);
    ``"topk:DENSITY[:BITS[:CHUNK]]"`` sets its arguments, e.g. ``"topk:0.02:4"``.
    """
    if is_sparse(name):
        return _topk_codec(name)
    codecs = {
        "none": None,
        "bf16": _CastCodec("bf16", torch.bfloat16),
        "fp16": Fp16Codec(),
        "int8": Int8Codec(),
        "int4": Int4Codec(),
    }
    if name not in codecs:
        raise ValueError(
            f"unknown WAN compression {name!r}; use one of {sorted([*codecs, 'topk'])} "
            f"(topk also as 'topk:DENSITY[:BITS[:CHUNK]]')."
        )
    return codecs[name]


def _topk_codec(name: str) -> TopKCodec:
    fields = name.split(":")[1:]
    try:
        if len(fields) > 3:
            raise ValueError("more than three fields")
        kinds = (float, int, int)
        return TopKCodec(*(kind(field) for kind, field in zip(kinds, fields)))
    except ValueError as exc:
        raise ValueError(
            f"WAN compression {name!r}: {str(exc).rstrip('.')}; write 'topk' or 'topk:DENSITY[:BITS[:CHUNK]]', "
            f"e.g. 'topk:0.02:2:256'."
        ) from exc
