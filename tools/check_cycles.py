"""Fail when a module of kvlink imports itself through others; print each import cycle once, with its lines.

import-linter's acyclic_siblings contract (pyproject.toml) keeps the modules and subpackages of every package
free of cycles among themselves, but a cycle through a package's own ``__init__`` (pkg -> pkg.sub.a -> pkg)
is invisible to it; this check sees every module-level cycle. Imports under TYPE_CHECKING are left out, as in
the contracts: they never run. Uses grimp, import-linter's graph library.

    python tools/check_cycles.py [package ...]    (default: kvlink; run from the repository root)
"""

from __future__ import annotations

import sys

import grimp


def import_graph(package: str) -> grimp.ImportGraph:
    return grimp.build_graph(package, exclude_type_checking_imports=True, cache_dir=None)


def find_cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Each cycle as (m0, m1, ..., m0), started at its smallest module name, shortest ones first."""
    found: set[tuple[str, ...]] = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is None:
                continue
            ring = (importer, *back[:-1])  # importer -> imported -> ... -> (importer)
            i = ring.index(min(ring))
            ring = ring[i:] + ring[:i]
            found.add((*ring, ring[0]))
    return sorted(found, key=lambda c: (len(c), c))


def describe(graph: grimp.ImportGraph, cycle: tuple[str, ...]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        lines = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
        steps.append(f"  {a} (line {', '.join(map(str, lines))}) imports {b}")
    return "\n".join(steps)


def main(argv: list[str]) -> int:
    packages = argv or ["kvlink"]
    bad = 0
    for package in packages:
        graph = import_graph(package)
        for cycle in find_cycles(graph):
            bad += 1
            print(f"import cycle in {package}: {' -> '.join(cycle)}\n{describe(graph, cycle)}")
    if bad:
        print(f"{bad} import cycle(s): break each by moving what both sides need into a module below them")
        return 1
    print(f"no import cycle in {', '.join(packages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
