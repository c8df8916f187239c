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
# Checkpoints (multidc.plugins.Checkpointer without a URL): a URL, a template with {site}, or a JSON object
# site -> URL; storage options as a JSON object (options, or site -> options).
CKPT_URL = "MULTIDC_CKPT_URL"
CKPT_STORAGE_OPTIONS = "MULTIDC_CKPT_STORAGE_OPTIONS"
# With one URL per site: how many other regions also hold each site's own state (an int, default 0).
CKPT_REPLICAS = "MULTIDC_CKPT_REPLICAS"


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


# Parallel layout (multidc.hierarchical.parallel.ParallelLayout) and pipeline settings.
DP_REPLICATE = "MULTIDC_DP_REPLICATE"
DP_SHARD = "MULTIDC_DP_SHARD"
PP_SIZE = "MULTIDC_PP_SIZE"
TP_SIZE = "MULTIDC_TP_SIZE"
PP_SCHEDULE = "MULTIDC_PP_SCHEDULE"
PP_MICROBATCHES = "MULTIDC_PP_MICROBATCHES"

# DiLoCo (multidc.hierarchical.DiLoCoConfig); CROSS_SITE: "allreduce" (per-step gradients) or "diloco".
CROSS_SITE = "MULTIDC_CROSS_SITE"
DILOCO_SYNC_EVERY = "MULTIDC_DILOCO_SYNC_EVERY"
DILOCO_SYNC_EVERY_S = "MULTIDC_DILOCO_SYNC_EVERY_S"
DILOCO_FRAGMENTS = "MULTIDC_DILOCO_FRAGMENTS"
DILOCO_OVERLAP_STEPS = "MULTIDC_DILOCO_OVERLAP_STEPS"
DILOCO_ALPHA = "MULTIDC_DILOCO_ALPHA"
DILOCO_OUTER_LR = "MULTIDC_DILOCO_OUTER_LR"
DILOCO_OUTER_MOMENTUM = "MULTIDC_DILOCO_OUTER_MOMENTUM"
DILOCO_NESTEROV = "MULTIDC_DILOCO_NESTEROV"
DILOCO_COMPRESSION = "MULTIDC_DILOCO_COMPRESSION"
DILOCO_WEIGHTING = "MULTIDC_DILOCO_WEIGHTING"
DILOCO_TARGET_UTILIZATION = "MULTIDC_DILOCO_TARGET_UTILIZATION"


def _or_auto(name: str, read_value, wanted: str, fix: str):
    """``name`` as ``"auto"`` (any case) or ``read_value(name)``, ``None`` when unset; ValueError naming the variable,
    ``wanted`` (what it must be) and ``fix`` (what to set it to)."""
    value = read(name)
    if value is not None and value.lower() == "auto":
        return "auto"
    try:
        return read_value(name)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not {wanted} (nor 'auto'); set it to {fix}, to 'auto', or unset "
                         f"it.") from None


def read_int_or_auto(name: str) -> int | str | None:
    """Return ``name`` as ``"auto"`` (any case) or an int, ``None`` when unset; ValueError naming the variable."""
    return _or_auto(name, read_int, "an integer", "a whole number")


def read_float_or_auto(name: str) -> float | str | None:
    """Return ``name`` as ``"auto"`` (any case) or a float, ``None`` when unset; ValueError naming the variable."""
    return _or_auto(name, read_float, "a number", "a number")


def read_bool(name: str) -> bool | None:
    """Return ``name`` parsed as a boolean (1/0, true/false, yes/no, on/off), ``None`` when unset."""
    value = read(name)
    if value is None:
        return None
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; set it to 1 or 0 (true/false) or unset it.")


def fill_fields(config, table) -> dict[str, str]:
    """Set every ``None`` field of ``config`` from its variable, else its default; return ``{field: variable}``
    for the fields that came from the environment, so an error can name the variable the user actually set.

    ``table``: ``(field, variable, reader, default)`` rows. An explicit argument wins; its variable is not read.
    """
    from_env: dict[str, str] = {}
    for name, variable, reader, default in table:
        if getattr(config, name) is not None:
            continue
        value = reader(variable)
        if value is not None:
            from_env[name] = variable
        # Not ``value or default``: an explicit 0 from the environment must reach validation, not vanish.
        setattr(config, name, default if value is None else value)
    return from_env


def describe(config, name: str, from_env: dict[str, str], variables: dict[str, str]) -> str:
    """``MULTIDC_X=value (Config.x)`` when the value came from the environment, else ``Config.x=value (also
    settable via MULTIDC_X)``: the start of a ValueError message about field ``name``."""
    value = getattr(config, name)
    cls = type(config).__name__
    variable = from_env.get(name)
    if variable is not None:
        return f"{variable}={value!r} ({cls}.{name})"
    return f"{cls}.{name}={value!r} (also settable via {variables[name]})"

# Elastic sites (torchft): opt-in (Lightning / Accelerate), and where the lighthouse listens.
ELASTIC = "MULTIDC_ELASTIC"
LIGHTHOUSE = "MULTIDC_LIGHTHOUSE"
# The address this host advertises to the other sites for torchft's manager and state transfer (default: its name).
ELASTIC_HOST = "MULTIDC_ELASTIC_HOST"
# torchft's own log level (its native side and its Python loggers): error, warn (default), info, debug, trace.
TORCHFT_LOG_LEVEL = "MULTIDC_TORCHFT_LOG_LEVEL"
