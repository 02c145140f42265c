"""The ``--log-level`` option every kvlink command line takes: one of logging's level names, any case."""

from __future__ import annotations

import argparse

# logging's names (its aliases WARN and FATAL included); 3.10 has no logging.getLevelNamesMapping
LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARNING", "WARN", "INFO", "DEBUG", "NOTSET")


def add_log_level(parser: argparse.ArgumentParser, default: str, help: str | None = None) -> None:
    """``--log-level``: refused by argparse (exit 2, naming the choices) unless a level logging knows."""
    parser.add_argument("--log-level", default=default, choices=LOG_LEVELS, type=str.upper,
                        help=help or f"logging level (default {default})")
