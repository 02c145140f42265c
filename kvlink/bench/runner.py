"""What every system under measurement hands the initiator: one system ready
to run one workload. Its own module so the initiator and the peer systems
(peers.py) both build it without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Runner:
    """``op`` is the timed operation, ``verify`` clears the destinations, runs
    once more and checks the bytes."""

    system: str
    op: Callable[[], None]
    verify: Callable[[], bool]
    close: Callable[[], None] = lambda: None
    descriptors: Callable[[], int | None] = lambda: None
