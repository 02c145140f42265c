"""`kvlink demo`: the prefill/decode vLLM demo on loopback (kvlink.demo.run)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="prefill + decode vLLM with KVLinkConnector and the proxy, on loopback")
    p.add_argument("--preset", default="tiny", help="local model preset (tiny, kvheavy)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--mode", choices=["sequential", "concurrent"], default="sequential")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvlink.demo.run import main

    return main(["--preset", args.preset, "--max-tokens", str(args.max_tokens), "--mode", args.mode])
