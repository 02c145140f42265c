"""kvlink's test suite, a package: its helpers import as tests.wire, tests.fakes, tests.relay ... from the
repository root (pyproject's pytest pythonpath puts it on sys.path)."""
