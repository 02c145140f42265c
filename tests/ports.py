"""Ports for test servers that bind later: kvlink/demo/ports.py (the demo and the benchmarks use it too)."""

from kvlink.demo.ports import free_port  # noqa: F401 - the tests import it from here
