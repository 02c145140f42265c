"""``python -m kvlink.bootstrap [--host H] [--port P] [--token-file F] [--allow-insecure]``."""

from __future__ import annotations

import argparse
import sys

from kvlink.bootstrap.cli import add_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvlink")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bootstrap", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
