"""Build glue: the C engine is compiled by the cffi builder named here."""

from setuptools import setup

setup(cffi_modules=["kvlink/_build_ffi.py:ffibuilder"])
