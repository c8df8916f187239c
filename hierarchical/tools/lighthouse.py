"""``multidc lighthouse``: run torchft's lighthouse for elastic sites, in the foreground until SIGINT / SIGTERM.

    multidc lighthouse --bind 0.0.0.0:29510 --min-sites 2     # a majority of 3 sites

Then set ``MULTIDC_LIGHTHOUSE=<this host>:29510`` on every site; ``multidc doctor`` checks that each rank reaches
it. ``--min-sites`` should be a majority of the sites: a restarted lighthouse that has not yet heard every site
can otherwise give two groups of sites a quorum each on the same step (their weights then stay apart).
Its traffic is unauthenticated, unencrypted gRPC, like gloo's: keep the port on the sites' private network.
torchft's own log lines are warnings only; ``MULTIDC_TORCHFT_LOG_LEVEL=info`` shows every quorum with its members.
"""

from __future__ import annotations

import argparse
import signal
import threading


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="0.0.0.0:29510", help="host:port to listen on (default 0.0.0.0:29510)")
    parser.add_argument("--min-sites", type=int, default=1,
                        help="sites a quorum needs (default 1); use a majority of the sites, N // 2 + 1, so that a "
                             "restarted lighthouse cannot form two quorums on the same step")
    parser.add_argument("--join-timeout-ms", type=int, default=60_000,
                        help="how long a new quorum waits for heartbeating sites to join (default 60000)")
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="quorum recomputation interval (default 100)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5_000,
                        help="a site silent this long leaves the next quorum (default 5000)")


def run(args: argparse.Namespace) -> int:
    from multidc.hierarchical.elastic import start_lighthouse

    server = start_lighthouse(args.bind, min_sites=args.min_sites, join_timeout_ms=args.join_timeout_ms,
                              quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    host, _, _ = args.bind.rpartition(":")
    port = server.address().rsplit(":", 1)[1]  # torchft names the machine's hostname; the port is the bound one
    shown = host if host not in ("0.0.0.0", "::", "[::]") else "<this host>"
    print(f"multidc lighthouse: listening on {host}:{port} (min sites {args.min_sites}); set "
          f"MULTIDC_LIGHTHOUSE={shown}:{port} on every site. Ctrl-C stops it.", flush=True)
    try:
        # a timed wait: a signal delivered to one of the server's native threads sets the handler's flag, which the
        # main thread only runs once it wakes
        while not stop.wait(0.2):
            pass
    finally:
        server.shutdown()
    print("multidc lighthouse: stopped", flush=True)
    return 0
