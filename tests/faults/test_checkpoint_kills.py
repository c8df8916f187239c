"""Short version of ``benchmarks/fault_checkpoint_kills.py``: a few random ranks SIGKILLed mid-save, to a local
directory and to the session's SeaweedFS server; after each kill ``latest`` loads and holds its step's values."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

from tests._launch import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fault_checkpoint_kills.py"


def _kills(*args: str) -> dict:
    code, output = run_script([sys.executable, str(SCRIPT), *args], dict(os.environ), timeout=240)
    assert code == 0, output[-6000:]
    line = next(line for line in output.splitlines() if line.startswith('{"benchmark"'))
    return json.loads(line)["results"][0]


def _check(result: dict, kills: int) -> None:
    assert result["kills"] == kills and result["committed"] == kills
    assert result["corrupt"] == 0 and result["problems"] == []
    assert result["saves"] >= kills - result["rounds_without_save"]


def test_random_rank_killed_mid_save_to_a_directory_leaves_a_loadable_latest():
    _check(_kills("--kills", "6", "--store", "local", "--seed", "1"), 6)


def test_random_rank_killed_mid_save_to_s3_leaves_a_loadable_latest(s3_server):
    bucket = s3_server.make_bucket(f"kills-{uuid.uuid4().hex[:8]}").removeprefix("s3://")
    _check(_kills("--kills", "3", "--store", "s3", "--seed", "2", "--s3-endpoint", s3_server.endpoint,
                  "--bucket", bucket), 3)
