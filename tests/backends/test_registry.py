"""The backend registry: built-in kinds open the right engine, a fake kind can be registered and opened,
and what it cannot open is refused with the reason."""

from __future__ import annotations

import pytest

from kvlink.backends import BACKENDS, MooncakeConfig, open_backend, register_backend, unregister_backend
from kvlink.transport import Engine, EngineConfig
from tests import fakes_transport


@pytest.fixture
def fake_kind():
    register_backend("fake-test", fakes_transport.Engine)
    yield "fake-test"
    if "fake-test" in BACKENDS:
        unregister_backend("fake-test")


def test_built_in_kinds():
    assert tuple(BACKENDS) == ("auto", "tcp", "same-host", "mooncake")


@pytest.mark.parametrize("kind, same_host, reported", [("tcp", "off", "tcp"), ("same-host", "require", "same-host"),
                                                       ("auto", "auto", "same-host")])
def test_native_kinds_open_the_engine_with_their_same_host_mode(kind, same_host, reported):
    with open_backend(kind, EngineConfig(name="n", same_host="off" if kind != "tcp" else "auto")) as b:
        assert isinstance(b, Engine)
        assert b.config.same_host == same_host and b.kind == reported and b.config.name == "n"


def test_native_kinds_take_no_options():
    with pytest.raises(ValueError, match="no backend options"):
        open_backend("tcp", EngineConfig(), MooncakeConfig())


def test_unknown_kind_names_the_known_ones():
    with pytest.raises(ValueError) as err:
        open_backend("rdma", EngineConfig())
    assert "'rdma'" in str(err.value) and "tcp" in str(err.value) and "mooncake" in str(err.value)


def test_a_registered_kind_is_opened_with_config_and_options(fake_kind):
    cfg, opts = EngineConfig(name="f"), object()
    assert fake_kind in BACKENDS
    with open_backend(fake_kind, cfg, opts) as b:
        assert isinstance(b, fakes_transport.Engine) and b.config is cfg and b.options is opts
    with open_backend(fake_kind) as b:
        assert b.config == EngineConfig() and b.options is None  # a default config when none is given


def test_registration_refuses_duplicates_and_bad_names(fake_kind):
    with pytest.raises(ValueError, match="already registered"):
        register_backend(fake_kind, fakes_transport.Engine)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("tcp", fakes_transport.Engine)
    register_backend(fake_kind, lambda c, o: "replaced", replace_existing=True)
    assert open_backend(fake_kind) == "replaced"
    for bad in ("", " x", "a b", None):
        with pytest.raises(ValueError, match="kind"):
            register_backend(bad, fakes_transport.Engine)
    with pytest.raises(TypeError, match="callable"):
        register_backend("fake-other", "not a factory")


def test_unregister(fake_kind):
    unregister_backend(fake_kind)
    assert fake_kind not in BACKENDS
    with pytest.raises(ValueError, match="must be one of"):
        open_backend(fake_kind)
    with pytest.raises(KeyError):
        unregister_backend(fake_kind)


def test_the_registry_view_is_read_only():
    with pytest.raises(TypeError):
        BACKENDS["x"] = fakes_transport.Engine  # type: ignore[index]


def test_mooncake_options_must_be_its_config():
    with pytest.raises(TypeError, match="MooncakeConfig"):
        open_backend("mooncake", EngineConfig(), {"protocol": "tcp"})
