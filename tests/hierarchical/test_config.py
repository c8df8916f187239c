"""``WanConfig``: validation of arguments and ``MULTIDC_WAN_*`` environment fallbacks. Pure, no process group."""

from __future__ import annotations

import math
import re

import pytest

from multidc.hierarchical import WanConfig

ENV = ("MULTIDC_WAN_COMPRESSION", "MULTIDC_WAN_CHUNK_MB", "MULTIDC_WAN_STREAMS", "MULTIDC_WAN_TIMEOUT_S")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_concrete_and_valid():
    wan = WanConfig()
    assert (wan.compression, wan.chunk_mb, wan.streams, wan.timeout_s) == ("none", 4.0, 2, 300.0)


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({"compression": "bf16"}, ("compression", "bf16")),
        ({"compression": "INT8"}, ("compression", "int8")),  # case-insensitive, stored lower-case
        ({"compression": "none"}, ("compression", "none")),
        ({"compression": "TopK:0.02"}, ("compression", "topk:0.02:2:256")),  # DiLoCo's; the per-step hooks refuse it
        ({"chunk_mb": 0.001}, ("chunk_mb", 0.001)),
        ({"chunk_mb": 64}, ("chunk_mb", 64)),
        ({"streams": 1}, ("streams", 1)),
        ({"streams": 64}, ("streams", 64)),
        ({"timeout_s": 0.5}, ("timeout_s", 0.5)),
    ],
)
def test_valid_arguments_are_kept(kwargs, expected):
    field, value = expected
    assert getattr(WanConfig(**kwargs), field) == value


@pytest.mark.parametrize(
    "kwargs,field,shown",
    [
        ({"compression": "zstd"}, "compression", "'zstd'"),
        ({"compression": ""}, "compression", "''"),
        ({"compression": "float16"}, "compression", "'float16'"),
        ({"compression": 8}, "compression", "8"),
        ({"compression": True}, "compression", "True"),
        ({"compression": "topk:1.5"}, "compression", "'topk:1.5'"),
        ({"chunk_mb": 0}, "chunk_mb", "0"),
        ({"chunk_mb": -1.5}, "chunk_mb", "-1.5"),
        ({"chunk_mb": math.nan}, "chunk_mb", "nan"),
        ({"chunk_mb": math.inf}, "chunk_mb", "inf"),
        ({"chunk_mb": "4"}, "chunk_mb", "'4'"),
        ({"chunk_mb": True}, "chunk_mb", "True"),
        ({"streams": 0}, "streams", "0"),
        ({"streams": -2}, "streams", "-2"),
        ({"streams": 65}, "streams", "65"),
        ({"streams": 2.0}, "streams", "2.0"),
        ({"streams": "2"}, "streams", "'2'"),
        ({"streams": True}, "streams", "True"),
        ({"timeout_s": 0}, "timeout_s", "0"),
        ({"timeout_s": -30}, "timeout_s", "-30"),
        ({"timeout_s": math.nan}, "timeout_s", "nan"),
        ({"timeout_s": math.inf}, "timeout_s", "inf"),
        ({"timeout_s": "60"}, "timeout_s", "'60'"),
        ({"timeout_s": False}, "timeout_s", "False"),
    ],
)
def test_bad_argument_raises_value_error_naming_field_and_value(kwargs, field, shown):
    with pytest.raises(ValueError, match=re.escape(f"WanConfig.{field}={shown}")):
        WanConfig(**kwargs)


@pytest.mark.parametrize(
    "variable,value,field,expected",
    [
        ("MULTIDC_WAN_COMPRESSION", "fp16", "compression", "fp16"),
        ("MULTIDC_WAN_COMPRESSION", " Int8 ", "compression", "int8"),
        ("MULTIDC_WAN_CHUNK_MB", "0.5", "chunk_mb", 0.5),
        ("MULTIDC_WAN_CHUNK_MB", "16", "chunk_mb", 16.0),
        ("MULTIDC_WAN_STREAMS", "4", "streams", 4),
        ("MULTIDC_WAN_TIMEOUT_S", "12.5", "timeout_s", 12.5),
        ("MULTIDC_WAN_STREAMS", "", "streams", 2),  # empty = unset: the default applies
        ("MULTIDC_WAN_CHUNK_MB", "   ", "chunk_mb", 4.0),
    ],
)
def test_environment_fills_unset_fields(monkeypatch, variable, value, field, expected):
    monkeypatch.setenv(variable, value)
    assert getattr(WanConfig(), field) == expected


@pytest.mark.parametrize(
    "variable,value,shown",
    [
        ("MULTIDC_WAN_COMPRESSION", "gzip", "MULTIDC_WAN_COMPRESSION='gzip'"),
        ("MULTIDC_WAN_CHUNK_MB", "-1", "MULTIDC_WAN_CHUNK_MB=-1.0"),
        ("MULTIDC_WAN_CHUNK_MB", "0", "MULTIDC_WAN_CHUNK_MB=0.0"),
        ("MULTIDC_WAN_CHUNK_MB", "nan", "MULTIDC_WAN_CHUNK_MB=nan"),
        ("MULTIDC_WAN_CHUNK_MB", "four", "MULTIDC_WAN_CHUNK_MB='four' is not a number"),
        ("MULTIDC_WAN_STREAMS", "0", "MULTIDC_WAN_STREAMS=0"),
        ("MULTIDC_WAN_STREAMS", "2.5", "MULTIDC_WAN_STREAMS='2.5' is not an integer"),
        ("MULTIDC_WAN_STREAMS", "many", "MULTIDC_WAN_STREAMS='many' is not an integer"),
        ("MULTIDC_WAN_TIMEOUT_S", "-5", "MULTIDC_WAN_TIMEOUT_S=-5.0"),
        ("MULTIDC_WAN_TIMEOUT_S", "inf", "MULTIDC_WAN_TIMEOUT_S=inf"),
        ("MULTIDC_WAN_TIMEOUT_S", "1m", "MULTIDC_WAN_TIMEOUT_S='1m' is not a number"),
    ],
)
def test_bad_environment_value_raises_value_error_naming_the_variable(monkeypatch, variable, value, shown):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=re.escape(shown)):
        WanConfig()


@pytest.mark.parametrize(
    "variable,value,kwargs",
    [
        ("MULTIDC_WAN_COMPRESSION", "int8", {"compression": "bf16"}),
        ("MULTIDC_WAN_COMPRESSION", "int8", {"compression": "none"}),
        ("MULTIDC_WAN_CHUNK_MB", "32", {"chunk_mb": 1.0}),
        ("MULTIDC_WAN_STREAMS", "8", {"streams": 1}),
        ("MULTIDC_WAN_TIMEOUT_S", "5", {"timeout_s": 60.0}),
    ],
)
def test_explicit_argument_beats_environment(monkeypatch, variable, value, kwargs):
    monkeypatch.setenv(variable, value)
    (field, given), = kwargs.items()
    assert getattr(WanConfig(**kwargs), field) == given


@pytest.mark.parametrize(
    "variable,kwargs",
    [
        ("MULTIDC_WAN_COMPRESSION", {"compression": "bf16"}),
        ("MULTIDC_WAN_CHUNK_MB", {"chunk_mb": 1.0}),
        ("MULTIDC_WAN_STREAMS", {"streams": 1}),
        ("MULTIDC_WAN_TIMEOUT_S", {"timeout_s": 60.0}),
    ],
)
def test_explicit_argument_ignores_a_malformed_environment_value(monkeypatch, variable, kwargs):
    monkeypatch.setenv(variable, "not-a-value")
    (field, given), = kwargs.items()
    assert getattr(WanConfig(**kwargs), field) == given


def test_unrelated_bad_environment_value_still_raises(monkeypatch):
    # An explicit chunk_mb does not hide a broken MULTIDC_WAN_STREAMS: that field still comes from the env.
    monkeypatch.setenv("MULTIDC_WAN_STREAMS", "zero")
    with pytest.raises(ValueError, match="MULTIDC_WAN_STREAMS='zero'"):
        WanConfig(chunk_mb=1.0)


def test_explicit_bad_argument_error_mentions_its_environment_variable():
    with pytest.raises(ValueError, match="MULTIDC_WAN_CHUNK_MB") as info:
        WanConfig(chunk_mb=-1)
    assert "WanConfig.chunk_mb=-1" in str(info.value)
