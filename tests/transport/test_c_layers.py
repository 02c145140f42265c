"""The C files form layers (listed in csrc/kvl_internal.h): each calls only
into layers below it, so kvl_engine.c sits on top and nothing calls up into
it. Checked on the objects the compiler makes, not on the text. The
benchmark yardsticks stay out of the production extension."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")

LAYERS = [  # lowest first
    {"kvl_err", "kvl_sha256", "kvl_sock", "kvl_proto", "kvl_events", "kvl_notifs", "kvl_owner"},
    {"kvl_crc32c", "kvl_region", "kvl_auth", "kvl_batch"},
    {"kvl_request"},
    {"kvl_local"},
    {"kvl_client", "kvl_server"},
    {"kvl_engine"},
]
BASELINE = "kvl_baseline"  # its own extension: built with the layer-0 files it uses, used by no engine file

CC = shutil.which("cc") or shutil.which("gcc")
NM = shutil.which("nm")
pytestmark = pytest.mark.skipif(not (CC and NM), reason="needs a C compiler and nm")


def _symbols(obj: str, *flags: str) -> set[str]:
    out = subprocess.run([NM, *flags, obj], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split() and line.split()[-1].startswith("kvl")}


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> dict[str, tuple[set[str], set[str]]]:
    """Per C file: (kvl symbols it defines, kvl symbols it uses from elsewhere)."""
    out = tmp_path_factory.mktemp("obj")
    objs = {}
    for name in sorted(os.listdir(CSRC)):
        if not name.endswith(".c"):
            continue
        stem = name[:-2]
        obj = str(out / f"{stem}.o")
        subprocess.run([CC, "-std=c11", "-O0", "-D_GNU_SOURCE", "-I", CSRC, "-c", os.path.join(CSRC, name), "-o",
                        obj], check=True)
        objs[stem] = (_symbols(obj, "--defined-only", "--extern-only"), _symbols(obj, "--undefined-only"))
    return objs


def test_every_c_file_has_a_layer(objects):
    placed = set().union(*LAYERS) | {BASELINE}
    assert set(objects) == placed, "add new C files to LAYERS here and in csrc/kvl_internal.h"


def test_files_call_only_into_lower_layers(objects):
    layer_of = {stem: i for i, layer in enumerate(LAYERS) for stem in layer}
    layer_of[BASELINE] = len(LAYERS)  # may use anything below; checked apart
    home = {sym: stem for stem, (defined, _) in objects.items() for sym in defined}
    wrong = []
    for stem, (_, used) in objects.items():
        for sym in sorted(used):
            to = home.get(sym)
            if to is None or layer_of[to] >= layer_of[stem] or to == BASELINE:
                wrong.append(f"{stem}.c uses {sym} from {to or 'nowhere'}.c")
            elif stem == BASELINE and layer_of[to] != 0:
                wrong.append(f"{stem}.c uses {sym} from {to}.c: the yardsticks' extension builds only layer 0 in")
    assert not wrong, "\n".join(wrong)


def test_production_extension_has_no_yardsticks():
    import kvlink._kvlink_c as engine

    syms = subprocess.run([NM, engine.__file__], capture_output=True, text=True, check=True).stdout
    assert "kvl_rawtcp" not in syms and "kvl_memcpy_blocks" not in syms
    assert "kvl_batch_cancel" in syms  # the check reads the right file
