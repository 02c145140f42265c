"""Run a patch on a module right after it is first imported (an import hook; nothing is imported here).

The one home of the hook the test-only site customizations share: tools/nospin's ``sitecustomize`` and
tests/vllm/moe_dp_shim's (which puts this directory on the path too)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch: Callable[[ModuleType], None]):
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # find the real module below us, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def after_import(target: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` once ``target`` has been imported and executed, the first time it is."""
    sys.meta_path.insert(0, _Finder(target, patch))
