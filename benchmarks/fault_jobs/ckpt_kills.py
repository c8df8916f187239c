"""Kill a random rank at a random point of a checkpoint save, many times; check ``latest`` after each kill.

Each round forks ``world`` ranks (2 to 4, drawn per round) from this process, which has imported torch but never
starts a process group or a storage client itself, so a round starts in a fraction of a second. The ranks load
the newest committed checkpoint (saved by another world size more often than not: resharding), check its values,
then save steps ``latest + 1, latest + 2, ...`` back to back until the driver SIGKILLs one random rank at a
random moment (from the first save on; in the very first round from the first commit on, as before that there
is nothing to protect), lets the others run on for a random short while (a commit in flight may finish), and
SIGKILLs them too. Then a forked verifier loads ``latest`` in a single process (every item's CRC-32 checked)
and compares every value with what that step must hold.

Counts: ``kills``; ``saves`` (commits reported by rank 0); ``committed`` (rounds after which ``latest`` loaded
and matched); ``corrupt`` (``latest`` missing, unloadable, wrong values, or older than a commit already seen).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported here, once, so forked ranks start at once. This process never starts a process group or a storage
# client (their threads would not survive a fork).
from multidc.hierarchical.tools.launch import free_port
from multidc.plugins import Checkpointer

SHAPES = {"embed": (512, 256), "layer.weight": (256, 256), "layer.bias": (256,), "head": (64, 256)}


def expected_state(step: int) -> dict:
    """What checkpoint ``step`` holds: replicated tensors (striped across ranks when saved) and a counter."""
    tensors = {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) * 1e-3 + step
               for name, shape in SHAPES.items()}
    return {"model": tensors, "trainer": {"step": step}}


def _matches(state: dict, step: int) -> str | None:
    want = expected_state(step)
    if state["trainer"]["step"] != step:
        return f"trainer.step {state['trainer']['step']} != {step}"
    for name, tensor in want["model"].items():
        if not torch.equal(state["model"][name], tensor):
            return f"{name} differs from step {step}'s values"
    return None


def _send(fd: int, **message) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())  # < PIPE_BUF: atomic even with several writers


def _rank_main(rank: int, world: int, port: int, url: str, options: dict | None, fd: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                           timeout=timedelta(seconds=60))
    ckpt = Checkpointer(url, storage_options=options, keep_last_k=2, stripe_min_mb=0, timeout_s=60)
    step = 0
    if ckpt.latest() is not None:
        state = expected_state(0)
        info = ckpt.load(state)
        problem = _matches(state, info.step)
        if problem:
            _send(fd, event="bad_load", rank=rank, step=info.step, problem=problem)
        step = info.step
    _send(fd, event="ready", rank=rank, step=step)
    while True:
        step += 1
        ckpt.save(expected_state(step), step=step)
        if rank == 0:
            _send(fd, event="saved", step=step)


def _fork(target, *args) -> int:
    pid = os.fork()
    if pid == 0:  # child: never return into the driver's code
        code = 0
        try:
            # Survivors of a kill fail in their next collective ("Connection closed by peer"): expected, not shown.
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 2)
            target(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def _verify_main(url: str, options: dict | None, fd: int) -> None:
    try:
        ckpt = Checkpointer(url, storage_options=options)
        info = ckpt.latest()
        if info is None:
            _send(fd, event="verified", step=None, problem="no committed checkpoint")
            return
        state = expected_state(0)
        info = ckpt.load(state)
        _send(fd, event="verified", step=info.step, problem=_matches(state, info.step))
    except Exception as exc:  # every failure to load latest is a finding, reported with its message
        _send(fd, event="verified", step=None, problem=f"{type(exc).__name__}: {exc}"[:500])


class _Pipe:
    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self._buffer = b""

    def messages(self) -> list[dict]:
        try:
            while chunk := os.read(self.read_fd, 65536):
                self._buffer += chunk
        except BlockingIOError:
            pass
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


def _reap(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    for pid in pids:
        os.waitpid(pid, 0)


def _wait_for(pipe: _Pipe, event: str, timeout: float, seen: list) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for message in pipe.messages():
            seen.append(message)
            if message["event"] == event:
                return message
        time.sleep(0.005)
    return None


def run_kills(url: str, *, kills: int, storage_options: dict | None = None, worlds=(2, 3, 4), seed: int = 0,
              window_s: float = 0.6, log=print) -> dict:
    """Run ``kills`` rounds against ``url``; return the counts (see the module docstring)."""
    rng = random.Random(seed)
    stats = {"kills": 0, "saves": 0, "committed": 0, "corrupt": 0, "bad_loads": 0, "rounds_without_save": 0,
             "problems": [], "victims": {}, "seconds": 0.0}
    newest_seen, started = 0, time.monotonic()
    while stats["kills"] < kills:
        world = rng.choice(worlds)
        pipe, port, seen = _Pipe(), free_port(), []
        pids = [_fork(_rank_main, r, world, port, url, storage_options, pipe.write_fd) for r in range(world)]
        try:
            # Until something is committed there is nothing to protect: the first round kills after a commit.
            if _wait_for(pipe, "ready" if newest_seen else "saved", 120, seen) is None:
                raise RuntimeError(f"round with {world} ranks never got going; messages: {seen}")
            time.sleep(rng.uniform(0, window_s))
            victim = rng.randrange(world)
            os.kill(pids[victim], signal.SIGKILL)
            time.sleep(rng.uniform(0, 0.2))  # survivors run on: a commit already under way may complete
        finally:
            _reap(pids)
        stats["kills"] += 1
        stats["victims"][victim] = stats["victims"].get(victim, 0) + 1
        seen += pipe.messages()
        saved = [m["step"] for m in seen if m["event"] == "saved"]
        stats["saves"] += len(saved)
        stats["rounds_without_save"] += not saved
        stats["bad_loads"] += sum(m["event"] == "bad_load" for m in seen)
        newest_seen = max([newest_seen, *saved])
        pid = _fork(_verify_main, url, storage_options, pipe.write_fd)
        _, status = os.waitpid(pid, 0)
        result = _wait_for(pipe, "verified", 5, [])
        pipe.close()
        problem = "verifier crashed" if result is None else result["problem"]
        if problem is None and result["step"] < newest_seen:
            problem = f"latest is step {result['step']} but step {newest_seen} was reported committed"
        if problem is None:
            stats["committed"] += 1
        else:
            stats["corrupt"] += 1
            stats["problems"].append(problem)
        log(f"kill {stats['kills']:3d}: world {world}, rank {victim} killed, {len(saved)} saves this round, "
            f"latest {None if result is None else result['step']}: {problem or 'ok'}")
    stats["seconds"] = round(time.monotonic() - started, 1)
    stats["corrupt"] += stats["bad_loads"]
    return stats
