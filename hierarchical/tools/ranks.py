"""Run a function on N gloo ranks in spawned processes, with a deadline and full clean-up.

``run_ranks(fn, world, *args, env=...)`` calls ``fn(rank, world, *args)`` in each rank after
``init_process_group("gloo")`` over a file:// rendezvous, and returns the per-rank return values (which must
pickle). A rank that raises makes ``run_ranks`` raise with that rank's traceback; a hang past ``timeout``
kills every rank and raises.

Ranks are forked from a forkserver that imported torch once (per calling process), not spawned: a spawned rank
imports torch anew, seconds of CPU on a small machine, which the test suite paid once per rank of every call.
Each rank still starts as a spawned one would: with the caller's environment and working directory at the time of
the call (not the server's), then ``env``, and random generators seeded anew (torch's, numpy's, Python's).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback
from datetime import timedelta

_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch.distributed"]
_CTX.set_forkserver_preload(_PRELOAD)
_ON_START = None


def preload(modules: list[str], on_start=None) -> None:
    """Have the forkserver also import ``modules`` (e.g. ``lightning.pytorch``, which a rank would import in seconds
    of CPU); call it before this process's first ``run_ranks``. A module that raises ImportError there is left out
    and imported by the rank that needs it, as without this call (any other error stops the server: every
    ``run_ranks`` then fails). What such a module read from the environment at import it read in the server's:
    ``on_start`` (a module-level function, called in each rank once its environment is set, before ``fn``) may
    redo it."""
    global _ON_START
    _CTX.set_forkserver_preload([*_PRELOAD, *modules])
    _ON_START = on_start


def _entry(fn, rank, world, init_file, caller, env, args, results, on_start):
    environ, cwd = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(env.get(rank, {}) if isinstance(env, dict) else env[rank])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a fresh seed per rank, as a spawned interpreter draws one: forked from one server, every rank would share its
    # generator state, and ranks that must be made alike (a broadcast at set-up) would be alike by accident
    torch.seed()
    if "numpy" in sys.modules:  # Python's random reseeds itself after a fork; numpy's global generator does not
        sys.modules["numpy"].random.seed()
    try:
        if on_start is not None:
            on_start()
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        buffer = io.BytesIO()
        # torch.save, not the queue's pickling: tensors in a queue share memory with a process that may exit.
        torch.save(fn(rank, world, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, env=None, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; ``env[rank]`` adds environment variables."""
    env, caller = env or {}, (dict(os.environ), os.getcwd())
    with tempfile.TemporaryDirectory() as tmp:
        results = _CTX.Queue()
        procs = [
            _CTX.Process(target=_entry, args=(fn, r, world, os.path.join(tmp, "rdzv"), caller, env, args, results,
                                                    _ON_START))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        values, errors = {}, {}
        try:
            for _ in range(world):
                rank, ok, value = results.get(timeout=timeout)
                (values if ok else errors)[rank] = value
                if errors:
                    break
        except queue.Empty:
            errors[-1] = f"timed out after {timeout}s; ranks done: {sorted(values)}"
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            rank = min(errors)
            raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
        import torch

        return [torch.load(io.BytesIO(values[r]), weights_only=False) for r in range(world)]
