"""ClientPool: one client per URL whatever the threads, the pool's token/timeout/retries on every client,
and close."""

from __future__ import annotations

import threading

import pytest

from kvlink.bootstrap import BootstrapError, BootstrapUnavailable, ClientPool, InvalidField, Unauthorized
from tests.fakes import ScriptedHTTPServer


@pytest.fixture
def engine(client, make_registration):
    client.register_engine(make_registration("P"), lease_s=600.0)
    return "P"


def test_one_client_per_url(server, token):
    with ClientPool(token, timeout_s=5.0) as pool:
        a = pool.get(server.url)
        assert pool.get(server.url) is a
        other = pool.get(server.url.replace("127.0.0.1", "localhost"))
        assert other is not a
        assert a.health().status == "ok" and other.health().status == "ok"


def test_threads_racing_for_a_url_share_one_client(server, token):
    pool = ClientPool(token, timeout_s=5.0)
    got, start = [], threading.Barrier(16)

    def grab():
        start.wait()
        got.append(pool.get(server.url))

    threads = [threading.Thread(target=grab) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 16 and len({id(c) for c in got}) == 1
    pool.close()


def test_clients_carry_the_pools_token(server, engine, token):
    with ClientPool(token, timeout_s=5.0) as good, ClientPool("wrong", timeout_s=5.0) as bad:
        assert good.get(server.url).lookup(engine, ["r"])  # answered: the engine is registered
        with pytest.raises(Unauthorized):
            bad.get(server.url).lookup(engine, ["r"])


def test_clients_carry_the_pools_retries():
    replies = [(503, {"error": "busy"}), (503, {"error": "busy"}), (200, {"lease_s": 3.0})]
    with ScriptedHTTPServer(lambda path: replies.pop(0) if len(replies) > 1 else replies[0]) as fake:
        with ClientPool(None, timeout_s=5.0, retries=1) as pool:
            with pytest.raises(BootstrapUnavailable):
                pool.get(fake.url).heartbeat("P")
            assert len(fake.requests) == 2  # the first try and one retry


def test_close_closes_every_client_and_refuses_more(server, token):
    pool = ClientPool(token, timeout_s=5.0)
    cli = pool.get(server.url)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(BootstrapError, match="closed"):
        cli.health()
    with pytest.raises(BootstrapError, match="pool is closed"):
        pool.get(server.url)


@pytest.mark.parametrize("kw, field", [({"timeout_s": 0}, "timeout_s"), ({"timeout_s": -1.0}, "timeout_s"),
                                       ({"timeout_s": 1.0, "retries": -1}, "retries"),
                                       ({"timeout_s": 1.0, "retries": 1.5}, "retries")])
def test_bad_settings_are_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidField) as err:
        ClientPool(None, **kw)
    assert err.value.field == field


def test_bad_url_is_refused():
    with ClientPool(None, timeout_s=1.0) as pool, pytest.raises(InvalidField, match="bootstrap url"):
        pool.get("ftp://somewhere")
