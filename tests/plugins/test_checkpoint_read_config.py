"""ReadConfig validation and how it combines with the Checkpointer's settings: pure, one process."""

from __future__ import annotations

import pytest

from multidc.plugins import Checkpointer, ReadConfig


@pytest.mark.parametrize(("field", "value", "says"), [
    ("piece_bytes", 0, ">= 1"), ("piece_bytes", 4.5, "must be an int"), ("round_bytes", "16M", "must be an int"),
    ("read_ahead_bytes", True, "must be an int"), ("concurrency", 0, ">= 1"),
    ("concurrency", 2.0, "e.g. concurrency=8"),
    ("stripe_min_bytes", -1, ">= 0"), ("stripe_min_bytes", 1.5, "must be an int"),
])
def test_a_bad_read_config_field_is_a_value_error_naming_the_field_and_the_fix(field, value, says):
    with pytest.raises(ValueError, match=rf"ReadConfig\.{field}=") as caught:
        ReadConfig(**{field: value})
    assert says in str(caught.value)


def test_a_read_config_keeps_the_checkpointers_concurrency_and_stripe_size_unless_it_sets_them(tmp_path):
    with Checkpointer(str(tmp_path), stripe_min_mb=2, max_concurrency=3,
                      read_config=ReadConfig(piece_bytes=1 << 20)) as ckpt:
        config = ckpt._read_config
    assert (config.piece_bytes, config.concurrency, config.stripe_min_bytes) == (1 << 20, 3, 2 << 20)
    with Checkpointer(str(tmp_path), stripe_min_mb=2, max_concurrency=3,
                      read_config=ReadConfig(concurrency=5, stripe_min_bytes=0)) as ckpt:
        assert (ckpt._read_config.concurrency, ckpt._read_config.stripe_min_bytes) == (5, 0)
    with pytest.raises(ValueError, match="read_config="):
        Checkpointer(str(tmp_path), read_config={"piece_bytes": 1})
