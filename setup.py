"""Build glue: the C engine and, apart from it, the benchmark yardsticks are
compiled by the cffi builders named here (see kvlink/_build_ffi.py)."""

from setuptools import setup

setup(cffi_modules=["kvlink/_build_ffi.py:ffibuilder", "kvlink/_build_ffi.py:baseline_ffibuilder"])
