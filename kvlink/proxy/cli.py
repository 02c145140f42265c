"""``kvlink proxy``: command-line front of the PD router (see router.py)."""

from __future__ import annotations

import argparse
import logging

from kvlink.loglevel import add_log_level
from kvlink.proxy.config import MODES, ProxyConfig

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("proxy", help="OpenAI-compatible router for prefill/decode vLLM servers",
                              description="Route /v1/completions and /v1/chat/completions to a "
                              "prefill server then a decode server (round-robin over each pool).")
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill server base URLs")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode server base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=MODES, default="sequential",
                   help="sequential: prefill first, its kv_transfer_params go to decode; "
                   "concurrent: both at once, paired by a transfer id through the bootstrap server")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds prefill's request may take, and "
                   "decode's answer may stay silent (a stream lasts as long as its tokens keep coming)")
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--prefill-bootstrap", nargs="+", default=[], metavar="URL",
                   help="concurrent mode: bootstrap URL of each prefill (one per --prefill, or one)")
    p.add_argument("--prefill-engine-id", nargs="+", default=[], metavar="ID",
                   help="concurrent mode, optional: engine id of each prefill; without it decode "
                   "learns it from the bootstrap server")
    p.add_argument("--bootstrap-token-file", default=None, metavar="PATH",
                   help="file holding the bootstrap servers' bearer token: the proxy reports a prefill request "
                   "decode never took as abandoned, so prefill frees its blocks before their lease runs out")
    add_log_level(p, "INFO")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    token = None
    if args.bootstrap_token_file:
        try:
            with open(args.bootstrap_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"--bootstrap-token-file: {e}") from None
    return ProxyConfig(prefill=tuple(u.rstrip("/") for u in args.prefill),
                       decode=tuple(u.rstrip("/") for u in args.decode),
                       host=args.host, port=args.port, mode=args.mode, timeout_s=args.timeout,
                       connect_timeout_s=args.connect_timeout,
                       prefill_bootstrap=tuple(args.prefill_bootstrap),
                       prefill_engine_ids=tuple(args.prefill_engine_id), bootstrap_token=token)


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvlink.proxy.router import SERVE_OPTIONS, build_app

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        logger.error("kvlink proxy: %s", e)
        return 2
    logger.info("kvlink proxy on http://%s:%d mode=%s prefill=%s decode=%s", cfg.host, cfg.port,
                cfg.mode, list(cfg.prefill), list(cfg.decode))
    web.run_app(build_app(cfg), host=cfg.host, port=cfg.port, print=None, access_log=None,
                handle_signals=True, **SERVE_OPTIONS)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvlink proxy")
    _add_arguments(p)
    return run(p.parse_args(argv))
