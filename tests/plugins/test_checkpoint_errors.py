"""Errors passed between ranks name the rank where they happened: pure, no process group."""

from __future__ import annotations

import pickle

import pytest

from multidc.plugins.checkpoint.comm import Comm, _describe, _rebuild
from multidc.plugins.checkpoint.format import CheckpointCorruptError


def test_an_error_rebuilt_from_a_peer_is_secondary_and_passing_it_on_keeps_the_rank_where_it_happened():
    on_rank0 = _rebuild(1, _describe(CheckpointCorruptError("bad crc")))
    assert str(on_rank0) == "rank 1: bad crc" and on_rank0.secondary
    passed_on = _rebuild(0, _describe(pickle.loads(pickle.dumps(on_rank0))))  # e.g. through a later gather
    assert type(passed_on) is CheckpointCorruptError and str(passed_on) == "rank 1: bad crc"


def test_a_gathered_choice_prefers_the_rank_where_the_error_happened_over_a_lower_rank_that_passed_it_on():
    comm = Comm(None, rank=2, world_size=3)
    secondary = _rebuild(1, ("ValueError", "bad setting"))
    described = [_describe(secondary), _describe(ValueError("bad setting")), None]
    with pytest.raises(ValueError, match=r"^rank 1: bad setting$"):
        comm._raise_gathered(described, None)
    with pytest.raises(ValueError, match=r"^rank 1: bad setting$"):  # this rank's copy is secondary: not raised
        comm._raise_gathered(described, _rebuild(1, ("ValueError", "other")))
    with pytest.raises(RuntimeError, match=r"^load failed: rank 1: ValueError: bad setting$"):  # listed once
        comm._raise_gathered(described, None, RuntimeError, "load")


def test_an_error_raised_only_because_another_rank_failed_loses_to_the_one_that_happened():
    from multidc.plugins.checkpoint.comm import raise_gathered
    from multidc.plugins.checkpoint.stop import PeerLeftError

    left = PeerLeftError("another rank left the load")
    assert _describe(left) == ("PeerLeftError", "another rank left the load", None)
    described = [_describe(left), _describe(CheckpointCorruptError("bad crc"))]  # rank 0 only waited for rank 1
    with pytest.raises(CheckpointCorruptError, match=r"^rank 1: bad crc$"):
        raise_gathered(described, left)
    # a listing of every rank's error (a failed save) leaves out the ranks that only stopped because of another
    with pytest.raises(RuntimeError, match=r"^load failed: rank 1: CheckpointCorruptError: bad crc$"):
        Comm(None, rank=0, world_size=2)._raise_gathered(described, left, RuntimeError, "load")
    with pytest.raises(RuntimeError, match=r"^load failed: rank 0: PeerLeftError: another rank left the load$"):
        Comm(None, rank=0, world_size=2)._raise_gathered([described[0], None], left, RuntimeError, "load")
