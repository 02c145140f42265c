"""The `kvlink` command: bench, bootstrap, proxy, demo."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvlink.loglevel import add_log_level

# subcommand -> module exposing add_parser(subparsers) (each sets its own func)
SUBCOMMANDS = {
    "bench": "kvlink.bench.cli",
    "bootstrap": "kvlink.bootstrap.cli",
    "proxy": "kvlink.proxy.cli",
    "demo": "kvlink.demo.cli",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlink", description="Move paged KV cache from prefill to decode engines.")
    add_log_level(p, "WARNING", "Python logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)
    for name, mod in SUBCOMMANDS.items():
        m = importlib.import_module(mod)
        m.add_parser(sub)
        if sub.choices[name].get_default("func") is None:  # modules that only expose run()
            sub.choices[name].set_defaults(func=m.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
