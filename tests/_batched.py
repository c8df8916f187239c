"""Several cases of a test module on one set of spawned gloo ranks.

Starting ranks is the slow part of most distributed cases on a small machine (each rank is an interpreter that
imports torch and the test module), so a module runs its cases of one world size in one ``run_ranks`` call from a
module-scoped fixture, and each test reads its case's per-rank results.

Each case is ``fn(rank, world, *args)`` as under ``run_ranks``, run in order, every rank through the same cases.
Before each case the rank's environment and torch's global RNG are put back to what the rank started with, so a
case sees what a fresh rank would see: the variables ``run_ranks`` gave it, torch's default seed. A case that
raises on a rank is recorded with its traceback (also printed to stderr); that rank then runs no further case
(the others may be waiting in a collective with it), and the tests of those cases fail naming the first one.
"""

from __future__ import annotations

import os
import sys
import traceback

from multidc.hierarchical.tools.ranks import run_ranks


def _run_cases(rank: int, world: int, cases: dict) -> dict:
    import torch

    environ, seed = dict(os.environ), torch.initial_seed()
    out, failed = {}, None
    for name, (fn, args) in cases.items():
        if failed is not None:
            out[name] = (False, f"not run on rank {rank}: case {failed!r} failed before it on this rank")
            continue
        os.environ.clear()
        os.environ.update(environ)
        torch.manual_seed(seed)
        try:
            out[name] = (True, fn(rank, world, *args))
        except Exception:
            failed, text = name, traceback.format_exc()
            print(f"rank {rank}, case {name!r}:\n{text}", file=sys.stderr, flush=True)
            out[name] = (False, text)
    os.environ.clear()
    os.environ.update(environ)
    return out


class CaseResults:
    """``results[name]``: the per-rank return values of case ``name``; a case that raised on any rank fails the
    test that reads it with that rank's traceback."""

    def __init__(self, per_rank: list[dict]) -> None:
        self._per_rank = per_rank

    def __getitem__(self, name: str) -> list:
        values = []
        for rank, results in enumerate(self._per_rank):
            ok, value = results[name]
            if not ok:
                raise AssertionError(f"case {name!r} failed on rank {rank}:\n{value}")
            values.append(value)
        return values


def run_cases(cases: dict, world: int, *, env=None, timeout: float = 240.0) -> CaseResults:
    """Run every case of ``cases`` (``{name: (fn, args)}``, ``fn`` a module-level function) on the same ``world``
    spawned gloo ranks, one after another."""
    return CaseResults(run_ranks(_run_cases, world, cases, env=env, timeout=timeout))
