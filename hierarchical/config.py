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
AUTO_CHUNK_MB = (4.0, 16.0, 64.0, 128.0)
"""The ``chunk_mb`` values ``chunk_mb="auto"`` chooses from (DiLoCo's syncs)."""
AUTO_STREAMS = (1, 2, 4, 8)
"""The ``streams`` values ``streams="auto"`` chooses from; ``Topology.build`` prepares the largest."""


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

    chunk_mb: float | str | None = None
    """Pipelining granularity in MiB of the input tensor, or ``"auto"``: DiLoCo's syncs start at 4 and pick from
    ``AUTO_CHUNK_MB`` by the planning model at a round's end (see docs/guides/plan.md#auto-in-the-job;
    ``chunk_mb_auto`` is then True). Env ``MULTIDC_WAN_CHUNK_MB`` (a number or ``auto``); default 4."""

    streams: int | str | None = None
    """WAN transfers in flight at once, each on its own connection set, or ``"auto"``: DiLoCo's syncs start at 2
    and pick from ``AUTO_STREAMS`` (``streams_auto`` is then True; ``Topology.build`` prepares 8). Env
    ``MULTIDC_WAN_STREAMS`` (a number or ``auto``); default 2."""

    timeout_s: float | None = None
    """Seconds a WAN collective may take before it fails. Env ``MULTIDC_WAN_TIMEOUT_S``; default 300."""

    chunk_mb_auto: bool = False
    """``chunk_mb`` is decided by DiLoCo from its measured syncs (set by ``chunk_mb="auto"``; ``chunk_mb`` then holds
    the value in use until the first decision: ``chunk_mb=N, chunk_mb_auto=True`` starts at N instead of 4). Per-step
    all-reduces (hierarchical DDP) refuse it."""

    streams_auto: bool = False
    """``streams`` is decided by DiLoCo from its measured syncs (set by ``streams="auto"``; ``streams=N,
    streams_auto=True`` starts at N instead of 2)."""

    def __post_init__(self) -> None:
        self._env_names = _env.fill_fields(self, (
            ("compression", _env.WAN_COMPRESSION, _env.read, "none"),
            ("chunk_mb", _env.WAN_CHUNK_MB, _env.read_float_or_auto, _DEFAULT_CHUNK_MB),
            ("streams", _env.WAN_STREAMS, _env.read_int_or_auto, _DEFAULT_STREAMS),
            ("timeout_s", _env.WAN_TIMEOUT_S, _env.read_float, _DEFAULT_TIMEOUT_S),
        ))
        self._validate()

    @property
    def prepared_streams(self) -> int:
        """The WAN streams a topology must prepare for these settings: ``streams``, or the most ``"auto"`` picks."""
        return AUTO_STREAMS[-1] if self.streams_auto else self.streams

    def refuse_auto(self, owner: str) -> None:
        """A ValueError when ``chunk_mb`` or ``streams`` is ``"auto"``: ``owner`` (a per-step all-reduce) does not
        decide them; only DiLoCo's syncs do."""
        auto = [name for name in ("chunk_mb", "streams") if getattr(self, f"{name}_auto")]
        if auto:
            raise ValueError(
                f"{owner} does not decide WanConfig.{auto[0]}='auto' (also settable via {_FIELD_ENV[auto[0]]}): only "
                f"DiLoCo's syncs (not elastic ones) measure the link and pick it (cross_site='diloco' / "
                f"strategy='diloco'). Give "
                f"{auto[0]} a number (multidc plan prints the cheapest)."
            )

    def _resolve_auto(self) -> None:
        for name, default in (("chunk_mb", _DEFAULT_CHUNK_MB), ("streams", _DEFAULT_STREAMS)):
            value = getattr(self, name)
            if isinstance(value, str):
                if value.strip().lower() != "auto":
                    raise ValueError(f"{self._source(name)} must be a number or 'auto'.")
                setattr(self, name, default)
                setattr(self, f"{name}_auto", True)
            if not isinstance(getattr(self, f"{name}_auto"), bool):
                raise ValueError(f"WanConfig.{name}_auto={getattr(self, f'{name}_auto')!r} must be True or False "
                                 f"(or pass {name}='auto').")

    def _validate(self) -> None:
        self._resolve_auto()
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
    "chunk_mb_auto": _env.WAN_CHUNK_MB,
    "streams_auto": _env.WAN_STREAMS,
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
