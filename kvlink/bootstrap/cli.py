"""``kvlink bootstrap``: run the bootstrap server standalone until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvlink.bootstrap.config import BootstrapConfig
from kvlink.bootstrap.errors import BootstrapConfigError
from kvlink.bootstrap.gate import check_fd_limit
from kvlink.bootstrap.server import BootstrapServer
from kvlink.loglevel import add_log_level


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bootstrap`` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "bootstrap",
        help="run the bootstrap (pairing) server",
        description="Run kvlink's bootstrap server, where prefill and decode engines find each other.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default 0: any free port)")
    parser.add_argument("--token-file", default=None,
                        help="file holding the bearer token every route but /health requires")
    parser.add_argument("--allow-insecure", action="store_true",
                        help="allow serving a non-loopback address without a token")
    parser.add_argument("--max-wait-s", type=float, default=30.0, help="longest long poll (default 30 s)")
    parser.add_argument("--request-lease-s", type=float, default=30.0,
                        help="lease of a published request that gives none (default 30 s)")
    parser.add_argument("--max-engines", type=int, default=4096,
                        help="engines the server keeps at once; more registrations are refused (default 4096)")
    parser.add_argument("--max-ranks-per-engine", type=int, default=4096,
                        help="live ranks (dp x tp x pp) one engine may register; more registrations are refused "
                        "(default 4096)")
    parser.add_argument("--max-requests-per-engine", type=int, default=262_144,
                        help="published requests one engine may have live; more publishes are refused and prefill "
                        "frees their blocks at once (default 262144)")
    parser.add_argument("--idle-timeout-s", type=float, default=30.0,
                        help="close a connection that sends no request for this long (default 30 s)")
    parser.add_argument("--body-timeout-s", type=float, default=10.0,
                        help="a request's body must arrive within this long of its headers (default 10 s)")
    parser.add_argument("--max-connections", type=int, default=4096,
                        help="client connections open at once; more are answered 503 and closed, and long polls "
                        "may hold 3/4 of them (default 4096; the soft descriptor limit is raised to fit)")
    add_log_level(parser, "INFO")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = BootstrapConfig.with_token_file(
            args.token_file,
            host=args.host,
            port=args.port,
            allow_insecure=args.allow_insecure,
            max_wait_s=args.max_wait_s,
            default_request_lease_s=args.request_lease_s,
            max_engines=args.max_engines,
            max_ranks_per_engine=args.max_ranks_per_engine,
            max_requests_per_engine=args.max_requests_per_engine,
            idle_timeout_s=args.idle_timeout_s,
            body_timeout_s=args.body_timeout_s,
            max_connections=args.max_connections,
        )
    except BootstrapConfigError as err:
        print(f"kvlink bootstrap: {err}", file=sys.stderr)
        return 2
    check_fd_limit(config.max_connections, raise_soft=True)  # server.start() warns if still too low
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = BootstrapServer(config)
    try:
        server.start()
    except OSError as err:
        print(f"kvlink bootstrap: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 1
    # One parsable line, so a supervisor (or a test) can learn the port chosen for --port 0.
    print(f"kvlink bootstrap listening on {server.url}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
    return 0
