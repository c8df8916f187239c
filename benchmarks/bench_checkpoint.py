"""Checkpoint save/load to a real S3 server (SeaweedFS on loopback), 4 gloo ranks holding a replicated model.

Compares, in the same run and against the same server:

* ``multidc``       : ``Checkpointer.save`` (sharded, replicated tensors striped across the 4 replicas,
                      parallel multipart), sync; and async (time training is blocked vs time to commit);
* ``lightning``     : Lightning's default ``TorchCheckpointIO`` (rank 0 ``torch.save``s everything into one
                      ``.ckpt`` object; the others wait), the same s3:// URL;
* ``dcp-fsspec``    : plain ``torch.distributed.checkpoint.save`` with torch's ``FsspecWriter`` (defaults);
* ``raw PUT``       : the bound. Every rank PUTs its equal share of the same number of bytes as one object, with
                      the same part size and concurrency and no checkpoint work at all. No striped save can beat
                      it on this server, so ``Lightning save / raw parallel PUT`` is the highest speedup this
                      machine allows; the script prints it next to the target.

Loads: every rank restores the full replica (multidc / DCP load; Lightning: every rank reads the file), against
the ``raw GET`` bound (every rank GETs its share of the saved shards, nothing else), ``raw GET, then exchange``
(the same, then every share sent to the other ranks: the transfers a replicated load cannot avoid) and ``raw GET,
exchange overlapped`` (the same transfers, each piece sent as soon as its GET landed).

Fair timing: every timed operation starts on a settled server (written data flushed, 0.5 s of quiet), and a bound
and the multidc operation it bounds take turns going first (the second of two large writes was seen to run up to
1.2x slower), so use an even ``--repeats``. Peak extra host memory is the kernel's high-water mark (``VmHWM``),
reset before the operation: exact, with nothing sampling meanwhile. Prints median and spread (min-max) of
``--repeats`` runs per figure, the bounds, and one JSON line.

Then PASS / FAIL against the targets (``checkpoint_report.verdicts``), on the medians: save and load against their
bounds, load against Lightning's, peak memory against the rank's share, the async save's blocking time, and the sync
save against Lightning's single-file save. The exit status is 1 when a target fails. The targets are about a model
of at least 200 MB (10^6 bytes) of state: a smaller ``--size-mb`` is refused unless ``--allow-small`` (a smoke run;
its verdicts are printed but do not measure the targets). Lightning must be installed (``pip install
'multidc[lightning]'``): without it the main comparison cannot run, and the script stops with an error. Usage::

    python benchmarks/bench_checkpoint.py [--size-mb 256] [--repeats 4] [--json out.json]
    python benchmarks/bench_checkpoint.py --size-mb 8 --repeats 1 --allow-small     # smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.checkpoint_report import plot, report  # noqa: E402  (after the path fix)
from benchmarks.memory import PeakRSS  # noqa: E402

KEYS = ("BENCHKEY", "bench-secret-not-printed")
MIN_STATE_BYTES = 200 * 10**6  # the targets are about a model of at least 200 MB of state


WIDTH = 2048
SETTLE_S = 0.5  # quiet before each timed operation


def _in_turn(runs: list, rep: int) -> list:
    """``runs`` (the bound first) in measured repeats 1, 3, 5..., reversed in 2, 4, ...: a measurement taken right
    after another large transfer was seen to run slower (up to 1.2x for the second of two saves), so with an even
    number of repeats each goes first equally often (with an odd one the bound goes first once more)."""
    return runs if rep % 2 == 1 else runs[::-1]


def _shape(size_mb: float) -> tuple[int, int]:
    """(embedding rows, square layers) for about ``size_mb`` MiB of fp32 state."""
    emb_rows = int(size_mb * (1 << 20) / 2 / (WIDTH * 4))
    layers = max(1, int(size_mb * (1 << 20) / 2 / (WIDTH * WIDTH * 4)))
    return emb_rows, layers


def state_bytes_for(size_mb: float) -> int:
    """Bytes of model state ``_model(size_mb)`` holds (fp32 embedding + weights and biases of the layers)."""
    emb_rows, layers = _shape(size_mb)
    return 4 * (emb_rows * WIDTH + layers * (WIDTH * WIDTH + WIDTH))


def _model(size_mb: float):
    """An embedding (half the bytes, one big tensor) plus square layers: a typical LM shape mix."""
    import torch

    torch.manual_seed(0)
    emb_rows, layers = _shape(size_mb)
    modules = [torch.nn.Embedding(emb_rows, WIDTH)] + [torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]
    return torch.nn.ModuleList(modules)


def _timed(fn, group):
    """Seconds ``fn`` takes (barriers around it), started on a settled server: what earlier steps wrote is flushed
    to disk and the server has had ``SETTLE_S`` of quiet, so no measurement pays for the writeback of another."""
    import torch.distributed as dist

    if dist.get_rank(group) == 0:
        os.sync()
    dist.barrier(group=group)
    time.sleep(SETTLE_S)
    dist.barrier(group=group)
    start = time.perf_counter()
    out = fn()
    dist.barrier(group=group)
    return time.perf_counter() - start, out


def _max(value: float, group) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _raw_get(store, keys: list[str], buffer, piece_bytes: int, concurrency: int) -> None:
    """Ranged GETs of ``keys`` (whole objects, back to back) into ``buffer``, ``concurrency`` in flight: no
    checkpoint work (no plan, no CRC, no exchange, no copy into tensors)."""
    from concurrent.futures import ThreadPoolExecutor

    from multidc.plugins.checkpoint.storage import byte_view

    view, jobs, at = byte_view(buffer, writable=True), [], 0
    for key in keys:
        size = min(store.size(key), len(view) - at)
        jobs += [(key, start, at + start, min(size, start + piece_bytes) - start)
                 for start in range(0, size, piece_bytes)]
        at += size
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda j: store.read_into(j[0], j[1], view[j[2]:j[2] + j[3]]), jobs))


def _raw_get_and_exchange(store, key: str, parts: list, rank: int, piece_bytes: int, concurrency: int,
                          group) -> None:
    """This rank's share by ranged GETs, then the share sent to every other rank and theirs received (gloo
    send/recv, as multidc's exchange; buffers padded to the largest share): the transfers a replicated load cannot
    avoid, with no checkpoint work."""
    import torch.distributed as dist

    _raw_get(store, [key], parts[rank], piece_bytes, concurrency)
    works = []
    for other in range(len(parts)):
        if other != rank:
            peer = dist.get_global_rank(group, other)
            works += [dist.irecv(parts[other], src=peer, group=group), dist.isend(parts[rank], dst=peer, group=group)]
    for work in works:
        work.wait()


def _raw_get_pipelined(store, key: str, parts: list, rank: int, piece_bytes: int, concurrency: int,
                       group) -> None:
    """The transfers of :func:`_raw_get_and_exchange` overlapped: each piece of this rank's share is sent to the
    other ranks as soon as its GET landed, while the other GETs run (every receive posted up front)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    import torch.distributed as dist

    from multidc.plugins.checkpoint.storage import byte_view

    length, size = parts[rank].numel(), store.size(key)
    bounds = [(start, min(length, start + piece_bytes)) for start in range(0, length, piece_bytes)]
    peers = [(other, dist.get_global_rank(group, other)) for other in range(len(parts)) if other != rank]
    works = [dist.irecv(parts[other][a:b], src=peer, group=group, tag=i)
             for other, peer in peers for i, (a, b) in enumerate(bounds)]
    view = byte_view(parts[rank], writable=True)

    def get(i: int) -> int:
        a, b = bounds[i][0], min(bounds[i][1], size)
        if b > a:
            store.read_into(key, a, view[a:b])
        return i

    with ThreadPoolExecutor(concurrency) as pool:
        for done in as_completed([pool.submit(get, i) for i in range(len(bounds))]):
            a, b = bounds[done.result()]
            works += [dist.isend(parts[rank][a:b], dst=peer, group=group, tag=done.result()) for _, peer in peers]
    for work in works:
        work.wait()


def _rank_main(rank, world, url, options, size_mb, repeats, part_size_mb, concurrency):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from multidc.plugins import Checkpointer, ObjectStore
    from multidc.plugins.checkpoint.format import checkpoint_name, shard_file
    from multidc.plugins.checkpoint.reader import ReadConfig

    group = dist.new_group(backend="gloo")
    model = _model(size_mb)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    store = ObjectStore(url, storage_options=options, part_size_mb=part_size_mb, max_concurrency=concurrency)
    ckpt = Checkpointer(url + "/multidc", storage_options=options, part_size_mb=part_size_mb,
                        max_concurrency=concurrency)
    times: dict[str, list[float]] = {}
    memory: dict[str, list[float]] = {}  # peak extra RSS, max over ranks, bytes
    sampled = set()  # whether PeakRSS had to sample (no high-water mark reset here)

    def record(name, seconds):
        times.setdefault(name, []).append(seconds)

    def measured(name, fn):
        """Time ``fn`` (max over ranks, barriers around) and record its peak extra RSS (max over ranks)."""
        with PeakRSS() as rss:
            seconds, out = _timed(fn, group)
        sampled.add(rss.sampled)
        record(name, seconds)
        memory.setdefault(name, []).append(_max(float(rss.extra), group))
        return out

    def fresh():  # written once, so the load writes into resident memory, as a model's tensors are
        return {k: torch.zeros_like(v) for k, v in model.state_dict().items()}

    def clean():
        dist.barrier(group=group)
        if rank == 0:
            for sub in ("multidc", "lightning", "dcp", "raw"):
                store.delete_tree(sub)
        dist.barrier(group=group)

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # main() checked that it is installed

    from multidc.plugins.checkpoint.storage import byte_view

    raw = byte_view(torch.randint(0, 256, (state_bytes // world,), dtype=torch.uint8))

    lightning_io = TorchCheckpointIO()

    for rep in range(-1, repeats):  # rep -1 warms up connections, buckets and code paths; not recorded
        clean()
        if rep == 0:
            times.clear()
            memory.clear()
        rep += 1

        def put_bound():
            seconds, _ = _timed(lambda: store.put(f"raw/{rep}/rank{rank}", raw), group)
            record("raw parallel PUT (bound)", seconds)

        for run in _in_turn([put_bound, lambda: measured("multidc save", lambda: ckpt.save(
                {"model": model.state_dict()}, step=rep))], rep):
            run()
        shard = f"multidc/{checkpoint_name(rep)}/{shard_file(rank)}"
        sizes = [None] * world
        dist.all_gather_object(sizes, store.size(shard), group=group)
        parts = [torch.zeros(max(sizes), dtype=torch.uint8) for _ in range(world)]
        pieces = ReadConfig().piece_bytes
        target = {"model": fresh()}

        def get_bounds():
            measured("raw parallel GET (bound)", functools.partial(_raw_get, store, [shard], parts[rank], pieces,
                                                                   concurrency))
            measured("raw GET, then exchange", functools.partial(_raw_get_and_exchange, store, shard, parts, rank,
                                                                     pieces, concurrency, group))
            measured("raw GET, exchange overlapped", functools.partial(_raw_get_pipelined, store, shard, parts,
                                                                           rank, pieces, concurrency, group))

        for run in _in_turn([get_bounds, lambda: measured("multidc load", lambda: ckpt.load(target))], rep):
            run()
        assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())
        parts = target = None  # free them before the next measurements

        dist.barrier(group=group)
        start = time.perf_counter()
        handle = ckpt.save({"model": model.state_dict()}, step=1000 + rep, async_save=True)
        blocked = _max(time.perf_counter() - start, group)
        handle.wait()
        dist.barrier(group=group)
        record("multidc async: blocked", blocked)
        record("multidc async: to commit", time.perf_counter() - start)

        path = f"{url}/lightning/step={rep}.ckpt"
        checkpoint = {"state_dict": model.state_dict(), "global_step": rep}
        seconds, _ = _timed(lambda: lightning_io.save_checkpoint(checkpoint, path) if rank == 0 else None, group)
        record("lightning single-file save", seconds)
        loaded = measured("lightning single-file load", lambda: lightning_io.load_checkpoint(path, weights_only=True))
        assert torch.equal(loaded["state_dict"]["0.weight"], model.state_dict()["0.weight"])
        del loaded

        dcp_url = f"{url}/dcp/step_{rep}"
        seconds, _ = _timed(lambda: dcp.save({"model": model.state_dict()},
                                             storage_writer=FsspecWriter(dcp_url, **options),
                                             process_group=group), group)
        record("dcp-fsspec save", seconds)
        target = {"model": fresh()}
        seconds, _ = _timed(lambda: dcp.load(target, storage_reader=FsspecReader(dcp_url, **options),
                                             process_group=group), group)
        record("dcp-fsspec load", seconds)
    clean()
    ckpt.close()
    return {"times": times, "memory": memory, "state_bytes": state_bytes, "rss_sampled": any(sampled)}


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """Refuse what would not measure the targets: too small a state, no Lightning to compare with."""
    import importlib.util

    if importlib.util.find_spec("lightning") is None:
        parser.error("Lightning is not installed, so the main comparison (multidc vs Lightning's single-file save "
                     "to the same s3:// URL) cannot run. Install it: pip install 'multidc[lightning]'.")
    state = state_bytes_for(args.size_mb)
    if state < MIN_STATE_BYTES and not args.allow_small:
        parser.error(f"--size-mb {args.size_mb:g} gives {state / 1e6:.0f} MB of model state; the targets are "
                     f"for at least {MIN_STATE_BYTES / 1e6:.0f} MB. Use --size-mb 200 or more, or pass --allow-small "
                     "for a smoke run whose PASS/FAIL verdicts do not measure the targets.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=256, help="model state per replica, MiB (>= 200)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4, help="even: each method goes first as often")
    parser.add_argument("--part-size-mb", type=float, default=16, help="multidc multipart part size, MiB")
    parser.add_argument("--concurrency", type=int, default=8, help="multidc parallel requests per rank")
    parser.add_argument("--allow-small", action="store_true",
                        help="allow a state under 200 MB (a smoke run: the verdicts do not measure the targets)")
    parser.add_argument("--json", default=None, help="also write the JSON result to this file")
    parser.add_argument("--plot", default=None, help="also plot save and load times and the bounds to this PNG")
    args = parser.parse_args(argv)
    _check_args(parser, args)

    from multidc.hierarchical.tools.ranks import run_ranks
    from multidc.hierarchical.tools.seaweed import SeaweedS3

    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedS3.start(tmp, auth=KEYS)
        try:
            url = server.make_bucket("bench") + "/ckpt"
            options = server.storage_options()
            # Lightning's TorchCheckpointIO takes credentials and endpoint from the standard AWS variables
            env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": KEYS[0],
                   "AWS_SECRET_ACCESS_KEY": KEYS[1], "AWS_DEFAULT_REGION": "us-east-1"}
            results = run_ranks(_rank_main, args.ranks, url, options, args.size_mb, args.repeats, args.part_size_mb,
                                args.concurrency,
                                env={r: env for r in range(args.ranks)}, timeout=3600)
        finally:
            server.stop()
    record = report(results[0], ranks=args.ranks, repeats=args.repeats, part_size_mb=args.part_size_mb,
                    concurrency=args.concurrency, min_state_bytes=MIN_STATE_BYTES)
    return finish(record, args, plot)


def finish(record: dict, args: argparse.Namespace, plot_fn) -> int:
    """Write ``--plot`` and ``--json`` of a benchmark's record; the exit code: 0 when every target passed."""
    if args.plot:
        plot_fn(record, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(record) + "\n")
    return 0 if record["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
