"""The one place that reads ``MULTIDC_*`` environment variables.

Every other module asks these functions, so a variable's name, parsing and error message live here only.
Values come back as raw strings or ``None``; the config classes validate them and name the variable in their
errors.
"""

from __future__ import annotations

import os

SITE = "MULTIDC_SITE"
NUM_SITES = "MULTIDC_NUM_SITES"
WAN_COMPRESSION = "MULTIDC_WAN_COMPRESSION"
WAN_CHUNK_MB = "MULTIDC_WAN_CHUNK_MB"
WAN_STREAMS = "MULTIDC_WAN_STREAMS"
WAN_TIMEOUT_S = "MULTIDC_WAN_TIMEOUT_S"


def read(name: str) -> str | None:
    """Return the stripped value of ``name``, or ``None`` when it is unset or empty."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def read_int(name: str) -> int | None:
    """Return ``name`` parsed as an int, ``None`` when unset; ValueError naming the variable otherwise."""
    value = read(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; set it to a whole number or unset it.") from None


def read_float(name: str) -> float | None:
    """Return ``name`` parsed as a float, ``None`` when unset; ValueError naming the variable otherwise."""
    value = read(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number; set it to a number or unset it.") from None


# Parallel layout (multidc.strategies.ParallelLayout) and pipeline settings.
DP_REPLICATE = "MULTIDC_DP_REPLICATE"
DP_SHARD = "MULTIDC_DP_SHARD"
PP_SIZE = "MULTIDC_PP_SIZE"
TP_SIZE = "MULTIDC_TP_SIZE"
PP_SCHEDULE = "MULTIDC_PP_SCHEDULE"
PP_MICROBATCHES = "MULTIDC_PP_MICROBATCHES"
