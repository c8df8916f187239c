"""``run_ranks`` forks its ranks from a forkserver that imported torch once; each rank must still start as a spawned
one would: the caller's environment and working directory at the time of the call, then ``env``, and its own random
seeds (forked ranks would otherwise share the server's generator state, and ranks that a set-up must make alike
would be alike by accident)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from multidc.hierarchical.tools.ranks import run_ranks


def _report(rank: int, world: int) -> dict:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only  # imported in the server, before any RANK

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"var": os.environ.get("MULTIDC_TEST_RANKS_VAR"), "own": os.environ.get("MULTIDC_TEST_RANKS_OWN"),
            "cwd": os.getcwd(), "sum": total.item(), "pid": os.getpid(), "rank_zero": rank_zero_only.rank,
            "draws": (torch.initial_seed(), torch.rand(2).tolist(), np.random.rand(), random.random())}


def test_ranks_start_with_the_callers_environment_and_cwd_at_the_call_then_env_and_their_own_seeds(
        monkeypatch, tmp_path):
    draws = []
    for value in ("first", "second"):  # the second call must not see what the forkserver saw at its start
        monkeypatch.setenv("MULTIDC_TEST_RANKS_VAR", value)
        monkeypatch.chdir(tmp_path)
        results = run_ranks(_report, 2, env={0: {"RANK": "0"}, 1: {"MULTIDC_TEST_RANKS_OWN": "one", "RANK": "1"}},
                            timeout=120)
        for rank, result in enumerate(results):
            assert result["var"] == value and result["cwd"] == str(tmp_path) and result["sum"] == 3.0
            assert result["own"] == ("one" if rank == 1 else None)
            assert result["pid"] != os.getpid() and result["rank_zero"] == rank  # Lightning's, as its import sets it
        draws += [result["draws"] for result in results]
        monkeypatch.undo()
    for kind in range(4):  # torch's seed and draw, numpy's, Python's: each rank of each call its own
        assert len({repr(d[kind]) for d in draws}) == len(draws), [d[kind] for d in draws]
