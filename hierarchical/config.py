"""``WanConfig``: how data crosses the WAN between sites."""

from __future__ import annotations

import math
from dataclasses import dataclass

from multidc.hierarchical import _env

COMPRESSIONS = ("none", "bf16", "fp16", "int8")

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
    """Codec for the WAN hop only: ``"none"``, ``"bf16"``, ``"fp16"`` or ``"int8"`` (per-chunk scale).
    Env ``MULTIDC_WAN_COMPRESSION``; default ``"none"``. Intra-site traffic always stays at the input precision."""

    chunk_mb: float | None = None
    """Pipelining granularity in MiB of the input tensor. Env ``MULTIDC_WAN_CHUNK_MB``; default 4."""

    streams: int | None = None
    """WAN transfers in flight at once, each on its own connection set. Env ``MULTIDC_WAN_STREAMS``; default 2."""

    timeout_s: float | None = None
    """Seconds a WAN collective may take before it fails. Env ``MULTIDC_WAN_TIMEOUT_S``; default 300."""

    def __post_init__(self) -> None:
        if self.compression is None:
            self.compression = _or(_env.read(_env.WAN_COMPRESSION), "none")
        if self.chunk_mb is None:
            self.chunk_mb = _or(_env.read_float(_env.WAN_CHUNK_MB), _DEFAULT_CHUNK_MB)
        if self.streams is None:
            self.streams = _or(_env.read_int(_env.WAN_STREAMS), _DEFAULT_STREAMS)
        if self.timeout_s is None:
            self.timeout_s = _or(_env.read_float(_env.WAN_TIMEOUT_S), _DEFAULT_TIMEOUT_S)
        self._validate()

    def _validate(self) -> None:
        compression = str(self.compression).lower()
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"WanConfig.compression={self.compression!r} is not supported; use one of {COMPRESSIONS} "
                f"(also via {_env.WAN_COMPRESSION})."
            )
        self.compression = compression
        if not (isinstance(self.chunk_mb, (int, float)) and math.isfinite(self.chunk_mb) and self.chunk_mb > 0):
            raise ValueError(
                f"WanConfig.chunk_mb={self.chunk_mb!r} must be a positive number of MiB, e.g. 4 "
                f"(also via {_env.WAN_CHUNK_MB})."
            )
        if isinstance(self.streams, bool) or not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise ValueError(
                f"WanConfig.streams={self.streams!r} must be an integer from 1 to 64, e.g. 2 "
                f"(also via {_env.WAN_STREAMS})."
            )
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(
                f"WanConfig.timeout_s={self.timeout_s!r} must be a positive number of seconds "
                f"(also via {_env.WAN_TIMEOUT_S})."
            )


def _or(value, default):
    # Not ``value or default``: an explicit 0 from the environment must reach validation, not vanish.
    return default if value is None else value
