"""``multidc ckpt ls|verify|rm URL`` (also ``python -m multidc.plugins.checkpoint ...``): inspect, check and
delete checkpoints.

Any fsspec URL (``s3://bucket/prefix``, ``file:///dir``, a path). Credentials and endpoint come from the same
standard places as in training: the AWS environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL[_S3]``, ``AWS_PROFILE``), ``~/.aws/config`` / ``credentials`` and
instance roles, as s3fs reads them; ``--endpoint-url`` overrides the endpoint. Secrets are never printed: errors
name the endpoint, the bucket and the key.

Exit status: 0 success; 1 a checkpoint is corrupt (``verify``); 2 no such checkpoint, or a bad argument; 3 the
store refused access or does not exist; 4 an unexpected error (a bug, or a failure of the environment).

A region-local checkpoint (one store per site, ``checkpoint.regions``) is named by a ``{site}`` template with
``--sites N`` (or ``--sites NAME,NAME``), or by ``--region NAME=URL`` once per region; each region's storage options
come from ``MULTIDC_CKPT_STORAGE_OPTIONS`` (JSON, site -> options), and with no URL at all from ``MULTIDC_CKPT_URL``,
as in training. Every command then covers every region's part (``checkpoint.regions_cli``).

``rm`` deletes committed checkpoints only: a folder without a commit record may be a save in flight, which would
then commit a record pointing at deleted shards. ``--include-uncommitted`` deletes those too (only when no job
writes under the URL). ``ls`` and ``verify`` never create anything (a mistyped local path stays absent).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

from multidc.hierarchical import _env
from multidc.plugins.checkpoint import regions_cli, retention
from multidc.plugins.checkpoint.format import (
    COMMIT,
    CheckpointCorruptError,
    RegionalCommit,
    checkpoint_name,
    decode_any,
    parse_step,
)
from multidc.plugins.checkpoint.object_store import ObjectStore, ObjectStoreError
from multidc.plugins.checkpoint.regions import check_one_store_options, from_env, is_regional
from multidc.plugins.checkpoint.state import SITE_PREFIX
from multidc.plugins.checkpoint.verify import SLICE_BYTES, verify

OK, CORRUPT, MISSING, ACCESS, UNEXPECTED = 0, 1, 2, 3, 4
_MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ls`` / ``verify`` / ``rm`` subcommands, under ``parser`` (``multidc ckpt``, or
    ``python -m multidc.plugins.checkpoint``)."""
    commands = parser.add_subparsers(dest="ckpt_command", required=True)
    for name, text in (("ls", "list committed checkpoints: step, size, sites, layout"),
                       ("verify", "check every shard's size and every item's CRC-32, without loading a model"),
                       ("rm", "delete one committed checkpoint (--step) or every committed checkpoint under the URL "
                        "(--all)")):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("url", nargs="?", default=None,
                         help="checkpoint root: s3://bucket/prefix, file:///dir or a path; or a template with {site} "
                         "(one store per site, with --sites). Default: MULTIDC_CKPT_URL")
        sub.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL[_S3])")
        sub.add_argument("--sites", default=None,
                         help="the sites a {site} template names: N (sites 0..N-1) or NAME,NAME,...")
        sub.add_argument("--region", action="append", default=None, metavar="NAME=URL",
                         help="one region's store of a region-local checkpoint (repeat for each region)")
        if name == "ls":
            sub.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
        if name in ("verify", "rm"):
            which = sub.add_mutually_exclusive_group(required=name == "rm")
            which.add_argument("--step", type=int, default=None, help="the checkpoint of this step")
            which.add_argument("--all", action="store_true", help="every committed checkpoint")
        if name == "rm":
            sub.add_argument("--include-uncommitted", action="store_true",
                             help="also delete folders without a commit record (half-written, or a save in flight: "
                             "use only when no job writes under the URL)")
        if name == "verify":
            sub.add_argument("--slice-mb", type=float, default=SLICE_BYTES / _MIB,
                             help="bytes read per ranged GET, MiB (memory: slice x --concurrency)")
            sub.add_argument("--concurrency", type=int, default=8, help="ranged GETs in flight")


def main(argv: list[str] | None = None, prog: str = "python -m multidc.plugins.checkpoint") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``ls`` / ``verify`` / ``rm``; returns the exit status (see the module docstring)."""
    try:
        url, options = _url_and_options(args)
        regions = regions_cli.regions_from_args(url, options, sites=args.sites)
        if regions is not None:
            if args.ckpt_command == "verify":
                _check_verify_args(args)
            return {"ls": regions_cli.ls, "verify": regions_cli.verify_all, "rm": regions_cli.rm}[
                args.ckpt_command](regions, args)
        store = ObjectStore(url, storage_options=options)
        if args.ckpt_command == "rm" or store.is_s3 or store.fs.exists(store.root):  # else: nothing there, create
            store.check_access()  # none
        return {"ls": _ls, "verify": _verify, "rm": _rm}[args.ckpt_command](store, args)
    except (ValueError, FileNotFoundError) as exc:  # ObjectStoreNotFoundError is a FileNotFoundError
        code = ACCESS if isinstance(exc, ObjectStoreError) else MISSING
        return _fail(code, str(exc))
    except CheckpointCorruptError as exc:
        return _fail(CORRUPT, str(exc))
    except ObjectStoreError as exc:  # auth refused, store down after retries
        return _fail(ACCESS, str(exc))
    except Exception as exc:  # never Python's status 1, which means "corrupt" here
        return _fail(UNEXPECTED, f"unexpected {type(exc).__name__}: {exc}")


def _url_and_options(args) -> tuple:
    """The URL (a mapping region -> URL for ``--region``) and storage options of the command line, the rest from
    ``MULTIDC_CKPT_URL`` / ``MULTIDC_CKPT_STORAGE_OPTIONS``; ``--endpoint-url`` sets one store's endpoint."""
    url = args.url
    if args.region:
        if url is not None:
            raise ValueError(f"pass either a URL ({url!r}) or --region NAME=URL per region, not both.")
        url = dict(regions_cli.parse_region(text) for text in args.region)
    url, options = from_env(url, None)
    if not is_regional(url):
        check_one_store_options(options, setting=_env.CKPT_STORAGE_OPTIONS)
    if args.endpoint_url:
        if is_regional(url):
            raise ValueError("--endpoint-url sets one store's endpoint; for one store per site set each region's "
                             "endpoint_url in MULTIDC_CKPT_STORAGE_OPTIONS (JSON, site -> options).")
        options = {**(options or {}), "endpoint_url": args.endpoint_url}
    return url, options


def _check_verify_args(args) -> None:
    if args.slice_mb <= 0 or args.concurrency < 1:
        raise ValueError(f"--slice-mb={args.slice_mb} must be > 0 and --concurrency={args.concurrency} >= 1")


def _fail(code: int, message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _describe(store: ObjectStore, step: int, name: str) -> dict:
    commit = decode_any(store.get(f"{name}/{COMMIT}"), store.where(f"{name}/{COMMIT}"))
    if isinstance(commit, RegionalCommit):
        raise ValueError(_regional_hint(store, name))
    sites = sorted({fqn.split(".", 1)[0] for fqn in commit.metadata.state_dict_metadata if fqn.startswith(SITE_PREFIX)})
    created = datetime.datetime.fromtimestamp(commit.created_unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return {"step": step, "name": name, "bytes": sum(commit.files.values()), "sites": sites,
            "world_size": commit.world_size, "shards": len(commit.files), "items": len(commit.locations),
            "created_utc": created}


def _regional_hint(store: ObjectStore, name: str) -> str:
    return (f"{store.where(name)} is one region's part of a region-local checkpoint: name every region, with a "
            "{site} template and --sites N, or --region NAME=URL per region.")


def _ls(store: ObjectStore, args) -> int:
    rows = [_describe(store, step, name) for step, name in retention.committed(store)]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return OK
    if not rows:
        print(f"no committed checkpoint under {store.where()}")
        return OK
    print(f"{'step':>12s} {'size MiB':>10s} {'sites':>12s}  {'layout':28s} {'created (UTC)':19s}")
    for row in rows:
        sites = ",".join(s.removeprefix(SITE_PREFIX) for s in row["sites"]) or "-"
        layout = f"{row['world_size']} ranks, {row['shards']} shards, {row['items']} items"
        print(f"{row['step']:12d} {row['bytes'] / _MIB:10.1f} {sites:>12s}  {layout:28s} {row['created_utc']}")
    return OK


def _chosen(store: ObjectStore, args) -> list[str]:
    if args.all:
        names = [name for _, name in retention.committed(store)]
        if not names:
            raise FileNotFoundError(f"no committed checkpoint under {store.where()}")
        return names
    return [retention.resolve(store, "latest" if args.step is None else args.step)]


def _verify(store: ObjectStore, args) -> int:
    _check_verify_args(args)
    code = OK
    for name in _chosen(store, args):
        started = time.monotonic()
        verdict = verify(store, name, slice_bytes=int(args.slice_mb * _MIB), concurrency=args.concurrency)
        seconds = time.monotonic() - started
        if verdict.problems:
            code = CORRUPT
            print(f"CORRUPT {store.where(name)}: {len(verdict.problems)} problem(s)")
            for problem in verdict.problems:
                print(f"  {problem}")
        else:
            print(f"OK      {store.where(name)}: step {verdict.commit.step}, {verdict.items} items, "
                  f"{verdict.bytes_read / _MIB:.1f} MiB checked in {seconds:.1f} s")
    return code


def _rm(store: ObjectStore, args) -> int:
    if args.all:
        if args.include_uncommitted:
            names = [name for name in store.list_dirs() if parse_step(name) is not None and store.list_files(name)]
        else:
            names = [name for _, name in retention.committed(store)]
        for name in names:
            retention.delete_committed(store, name)
        print(f"deleted {len(names)} checkpoint folder(s) under {store.where()}")
        return OK
    name = checkpoint_name(args.step)
    if not store.list_files(name):  # not list_dirs: S3 servers may list an emptied folder for a while
        raise FileNotFoundError(f"no checkpoint of step {args.step} under {store.where()}")
    if not args.include_uncommitted and not store.exists(f"{name}/{COMMIT}"):
        raise FileNotFoundError(
            f"{store.where(name)} is not committed (half-written, or a save in flight that would then commit "
            "deleted shards): not deleted. Pass --include-uncommitted to delete it when no job writes there.")
    retention.delete_committed(store, name)  # commit record first: never a half-deleted "committed" one
    print(f"deleted {store.where(name)}")
    return OK
