"""``WanConfig``: how data crosses the WAN between sites."""

from __future__ import annotations

import math
from dataclasses import dataclass

from multidc.hierarchical import _env
from multidc.hierarchical.compression import get_codec, is_sparse

COMPRESSIONS = ("none", "bf16", "fp16", "int8", "int4")
TOPK_FORMS = "'topk' or 'topk:DENSITY[:BITS[:CHUNK]]' (e.g. 'topk:0.02:2:256')"

_DEFAULT_CHUNK_MB = 4.0
_DEFAULT_STREAMS = 2
_DEFAULT_TIMEOUT_S = 300.0


@dataclass(kw_only=True)
class WanConfig:
    """Settings for the inter-site (WAN) hop of the hierarchical all-reduce.

    A field left at ``None`` takes its ``MULTIDC_WAN_*`` environment variable, else the built-in default, so
    ``accelerate launch`` / ``torchrun`` users can tune the WAN without code changes. After construction every
    field holds a concrete, validated value.
    """

    compression: str | None = None
    """Codec for the WAN hop only: ``"none"``, ``"bf16"``, ``"fp16"``, ``"int8"`` or ``"int4"`` (the scaled ones
    carry one scale per shard of each chunk, so fp16 does not overflow above 65504; bounds in ``compression.py``;
    int4 is meant for DiLoCo's pseudo-gradients), or the sparse ``"topk"`` / ``"topk:DENSITY[:BITS[:CHUNK]]"``
    for ``all_reduce(..., residual=)`` called directly (the caller keeps the error feedback); DiLoCo takes its
    codec from ``DiLoCoConfig.compression`` instead, and the per-step hooks refuse top-k.
    Env ``MULTIDC_WAN_COMPRESSION``; default ``"none"``. Intra-site traffic always stays at the input precision."""

    chunk_mb: float | None = None
    """Pipelining granularity in MiB of the input tensor. Env ``MULTIDC_WAN_CHUNK_MB``; default 4."""

    streams: int | None = None
    """WAN transfers in flight at once, each on its own connection set. Env ``MULTIDC_WAN_STREAMS``; default 2."""

    timeout_s: float | None = None
    """Seconds a WAN collective may take before it fails. Env ``MULTIDC_WAN_TIMEOUT_S``; default 300."""

    def __post_init__(self) -> None:
        self._env_names = _env.fill_fields(self, (
            ("compression", _env.WAN_COMPRESSION, _env.read, "none"),
            ("chunk_mb", _env.WAN_CHUNK_MB, _env.read_float, _DEFAULT_CHUNK_MB),
            ("streams", _env.WAN_STREAMS, _env.read_int, _DEFAULT_STREAMS),
            ("timeout_s", _env.WAN_TIMEOUT_S, _env.read_float, _DEFAULT_TIMEOUT_S),
        ))
        self._validate()

    def _validate(self) -> None:
        self.compression = compression_name(self.compression, self._source("compression"))
        if not positive_number(self.chunk_mb):
            raise ValueError(f"{self._source('chunk_mb')} must be a positive number of MiB, e.g. 4.")
        if isinstance(self.streams, bool) or not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise ValueError(f"{self._source('streams')} must be an integer from 1 to 64, e.g. 2.")
        if not positive_number(self.timeout_s):
            raise ValueError(f"{self._source('timeout_s')} must be a positive number of seconds, e.g. 300.")

    def _source(self, name: str) -> str:
        return _env.describe(self, name, self._env_names, _FIELD_ENV)


_FIELD_ENV = {
    "compression": _env.WAN_COMPRESSION,
    "chunk_mb": _env.WAN_CHUNK_MB,
    "streams": _env.WAN_STREAMS,
    "timeout_s": _env.WAN_TIMEOUT_S,
}


def compression_name(value, source: str) -> str:
    """``value`` as a config stores it: lower-case, a top-k spelling in ``get_codec``'s canonical form (so equal
    codecs compare equal across ranks).

    Raises:
        ValueError: naming ``source`` (the field, or the variable it came from) and the accepted forms.
    """
    name = value.lower() if isinstance(value, str) else None
    if name in COMPRESSIONS:
        return name
    if is_sparse(name):
        try:
            return get_codec(name).name
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc
    raise ValueError(f"{source} is not supported; use one of {COMPRESSIONS}, or {TOPK_FORMS}.")


def positive_number(value) -> bool:
    # bool is an int subclass; ``chunk_mb=True`` is a mistake, not 1 MiB.
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
