"""Fault script: SIGKILL a random rank at a random point of a checkpoint save, again and again; after every kill
``latest`` must be a committed, checksum-valid checkpoint that loads and holds exactly its step's values.

Ranks (2 to 4, drawn per round, so most loads reshard) save back to back with ``keep_last_k=2`` (retention
deletes while ranks die), to a local directory or to a real S3 server (SeaweedFS, started here, or an existing
endpoint). See ``benchmarks/fault_jobs/ckpt_kills.py`` for the procedure. Prints one line per kill, the counts,
and a JSON line; exits 1 if any ``latest`` was corrupt or lost. Usage::

    python benchmarks/fault_checkpoint_kills.py [--kills 50] [--store local|s3|both] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.fault_jobs import ckpt_kills  # noqa: E402  (after the path fix)


def _make_bucket(endpoint: str, name: str) -> None:
    """Create the bucket in a forked child: this process must not start an S3 client's threads (see ckpt_kills)."""
    def create():
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, anon=True, skip_instance_cache=True).mkdir(name)

    pid = ckpt_kills._fork(create)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"could not create bucket {name!r} at {endpoint}")


def _run(store: str, args, tmp: str) -> dict:
    server = None
    try:
        if store == "local":
            url, options = os.path.join(tmp, "local-ckpt"), None
        else:
            endpoint = args.s3_endpoint
            if endpoint is None:
                from multidc.hierarchical.tools.seaweed import SeaweedS3

                server = SeaweedS3.start(os.path.join(tmp, "seaweed"))
                endpoint = server.endpoint
            bucket = args.bucket or f"kills-{uuid.uuid4().hex[:8]}"
            if args.bucket is None:
                _make_bucket(endpoint, bucket)
            url = f"s3://{bucket}/kills"
            options = {"endpoint_url": endpoint, "anon": True, "client_kwargs": {"region_name": "us-east-1"},
                       "skip_instance_cache": True}
        print(f"[{store}] {args.kills} kills against {url}", flush=True)
        stats = ckpt_kills.run_kills(url, kills=args.kills, storage_options=options, worlds=args.worlds,
                                     seed=args.seed, window_s=args.window_s or (0.6 if store == "local" else 3.0),
                                     log=lambda line: print(f"[{store}] {line}", flush=True))
        return {"store": store, **stats}
    finally:
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50, help="kills per store (default 50)")
    parser.add_argument("--store", choices=("local", "s3", "both"), default="local")
    parser.add_argument("--worlds", default="2,3,4", help="world sizes drawn per round (default 2,3,4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window-s", type=float, default=None,
                        help="kill within this many s of the first save (default 0.6 local, 3 s3: a few saves)")
    parser.add_argument("--s3-endpoint", default=None, help="use this anonymous S3 endpoint instead of starting one")
    parser.add_argument("--bucket", default=None, help="existing bucket on --s3-endpoint (default: create one)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    args.worlds = tuple(int(w) for w in args.worlds.split(","))
    if args.kills < 1 or not all(2 <= w <= 8 for w in args.worlds):
        parser.error("--kills must be >= 1 and every world size from 2 to 8")
    results = []
    with tempfile.TemporaryDirectory(prefix="mdc-kills-") as tmp:
        for store in (("local", "s3") if args.store == "both" else (args.store,)):
            results.append(_run(store, args, tmp))
    print(f"\n{'store':<6} {'kills':>6} {'saves':>6} {'committed':>10} {'corrupt':>8} {'seconds':>8}")
    for r in results:
        print(f"{r['store']:<6} {r['kills']:>6} {r['saves']:>6} {r['committed']:>10} {r['corrupt']:>8} "
              f"{r['seconds']:>8}")
        for problem in r["problems"]:
            print(f"  corrupt: {problem}")
    line = json.dumps({"benchmark": "fault_checkpoint_kills", "results": results})
    print(line)
    if args.json:
        with open(args.json, "w") as out:
            out.write(line + "\n")
    return 1 if any(r["corrupt"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
