"""kvlink proxy, concurrent pairing: a prefill that fails by itself after decode got the transfer id has the
id given up at prefill's bootstrap server, so decode stops waiting for it at once; a prefill that succeeded,
or that the proxy cancelled, is left alone."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from kvlink.bootstrap import BootstrapClient
from kvlink.bootstrap.errors import LookupTimeout, RequestReleased, UnknownRequest
from tests.bootstrap.conftest import TOKEN
from tests.fakes_vllm_server import FakeVLLMServer
from tests.proxy.test_router import health, post, released, wait_for

FAILS_AT_S = 0.3  # when the failing prefill fails: decode has its request (and the transfer id) by then
DECODE_WAIT_S = 3.0  # how long the waiting decode long-polls (the connector's lookup_wait_s, shortened)


class FailingPrefill(FakeVLLMServer):
    """Fails FAILS_AT_S after taking the request: answers ``status`` (None: drops the connection unanswered),
    after publishing the request under its transfer id when ``publish``."""

    def __init__(self, bootstrap_url: str, status: int | None, publish: bool = False):
        self.status = status
        super().__init__("p0", bootstrap_url=bootstrap_url, publish=publish, token=TOKEN)

    async def complete(self, request):
        body = await request.json()
        self.bodies.append((request.path, body))
        if self.publish:
            await asyncio.to_thread(self._publish, "req-1", body["kv_transfer_params"]["transfer_id"])
        await asyncio.sleep(FAILS_AT_S)
        if self.status is None:
            request.transport.close()
            return web.Response()
        return web.json_response({"error": {"message": "This model's maximum context length is ..."}},
                                 status=self.status)


class WaitingDecode(FakeVLLMServer):
    """Decode as its connector behaves in concurrent pairing: it long-polls the bootstrap server for the
    transfer id (at most DECODE_WAIT_S), then answers. ``waits``: (seconds waited, how the wait ended)."""

    def __init__(self, bootstrap_url: str):
        self.waits = []
        super().__init__("d0", bootstrap_url=bootstrap_url, token=TOKEN)

    async def complete(self, request):
        body = await request.json()
        self.bodies.append((request.path, body))
        self.waits.append(await asyncio.to_thread(self._wait, body["kv_transfer_params"]["transfer_id"]))
        return web.json_response({"from": self.name, "choices": [{"text": "hi"}]})

    def _wait(self, transfer_id: str) -> tuple[float, str]:
        t0 = time.monotonic()
        with BootstrapClient(self.bootstrap_url, token=TOKEN) as cli:
            try:
                cli.lookup_transfer(transfer_id, wait_s=DECODE_WAIT_S)
                ended = "published"
            except RequestReleased:
                ended = "released"
            except LookupTimeout:
                ended = "timed out"
        return time.monotonic() - t0, ended


@pytest.fixture
def servers(bootstrap, proxy):
    made = []

    def make(prefill_status, engine_ids=("p0",), publish=False):
        p, d = FailingPrefill(bootstrap.url, prefill_status, publish), WaitingDecode(bootstrap.url)
        made.extend((p, d))
        url = proxy(prefill=(p.url,), decode=(d.url,), mode="concurrent", prefill_bootstrap=(bootstrap.url,),
                    prefill_engine_ids=engine_ids, bootstrap_token=TOKEN)
        return p, d, url

    yield make
    for s in made:
        s.stop()


def _decode_wait(d, url):
    status, _, raw = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert status == 200, raw
    (waited, ended), = d.waits
    return waited, ended


@pytest.mark.parametrize("prefill_status", [400, 500])
def test_a_prefill_that_fails_after_decode_got_the_transfer_id_ends_decodes_wait(servers, prefill_status):
    """Prefill's connector never saw the request, so nobody else gives the id up: without the proxy decode
    would wait its whole lookup_wait_s (30 s) before computing the prompt."""
    p, d, url = servers(prefill_status)
    waited, ended = _decode_wait(d, url)
    assert ended == "released" and waited < FAILS_AT_S + 1.0, (waited, ended)
    assert health(url)["transfers_abandoned"] == 1


@pytest.mark.parametrize("prefill_status,engine_ids", [(400, ()), (None, ("p0",))],
                         ids=["no-engine-id-configured", "no-answer"])
def test_a_failed_prefill_whose_engine_is_not_named_has_its_transfer_id_given_up(servers, prefill_status,
                                                                                  engine_ids):
    """Without --prefill-engine-id, or when prefill gave no answer (its request may still finish and publish
    in the engine), the proxy names no engine: the bootstrap server gives the id up only if nothing is
    published or streamed under it (``abandon_transfer`` without an engine id: a bootstrap server of before
    it refuses the call, and decode waits its whole lookup_wait_s as it did)."""
    p, d, url = servers(prefill_status, engine_ids)
    waited, ended = _decode_wait(d, url)
    assert ended == "released" and waited < FAILS_AT_S + 1.0, (waited, ended)


def test_a_request_published_before_prefill_failed_is_left_to_decode(servers, bootstrap):
    """Prefill published the request, then answered an error: decode may be reading the blocks (its READs
    are trusted on prefill holding them), so the proxy must not give them up."""
    p, d, url = servers(500, publish=True)
    waited, ended = _decode_wait(d, url)
    assert ended == "published"
    time.sleep(0.5)  # the proxy heard prefill's 500 long ago
    assert not released(bootstrap, "p0", "req-1")
    assert health(url)["transfers_abandoned"] == 0


@pytest.mark.parametrize("decode_behavior", ["ok", "error500"], ids=["decode-answered", "decode-failed"])
def test_a_prefill_the_proxy_cancelled_is_not_given_up_by_the_proxy(backends, proxy, bootstrap, decode_behavior):
    """The proxy cancels a prefill still running once decode has answered (a second later) or failed (at
    once): prefill's connector sees the abort and gives the id up itself."""
    p, d = backends("p0", "hang"), backends("d0", decode_behavior)
    url = proxy(prefill=(p.url,), decode=(d.url,), mode="concurrent", prefill_bootstrap=(bootstrap.url,),
                prefill_engine_ids=("p0",), bootstrap_token=TOKEN)
    post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert wait_for(lambda: p.cancelled == 1)
    time.sleep(0.3)
    (_, dec), = d.bodies
    with BootstrapClient(bootstrap.url, token=TOKEN) as cli, pytest.raises(UnknownRequest):  # not RequestReleased
        cli.lookup_transfer(dec["kv_transfer_params"]["transfer_id"])
    assert health(url)["transfers_abandoned"] == 0


def test_a_prefill_that_succeeded_is_left_to_decode(backends, proxy, bootstrap):
    p = FakeVLLMServer("p0", bootstrap_url=bootstrap.url, publish=True, token=TOKEN)
    try:
        d = WaitingDecode(bootstrap.url)
        try:
            url = proxy(prefill=(p.url,), decode=(d.url,), mode="concurrent", prefill_bootstrap=(bootstrap.url,),
                        prefill_engine_ids=("p0",), bootstrap_token=TOKEN)
            assert _decode_wait(d, url)[1] == "published"
            time.sleep(0.3)
            assert not released(bootstrap, "p0", p.published[0])
            assert health(url)["transfers_abandoned"] == 0
        finally:
            d.stop()
    finally:
        p.stop()


def test_the_releaser_has_threads_of_its_own_and_a_bounded_backlog(monkeypatch):
    """Releases wait on bootstrap servers (up to seconds each). On asyncio's default pool they held the
    threads that also resolve backends' host names, and a flood of failing requests queued them without
    bound; now they run on the releaser's own threads, and past MAX_PENDING a report is dropped and counted
    (its lease frees the blocks)."""
    import threading

    from kvlink.proxy import release

    monkeypatch.setattr(release, "MAX_PENDING", 6)
    gate = threading.Event()

    async def main():
        r = release.Releaser(None)
        monkeypatch.setattr(r._pool, "get", lambda url: None)
        for i in range(8):
            r._spawn("http://127.0.0.1:1", lambda cli: gate.wait(10), f"request {i}", lambda *a: None)
        await asyncio.sleep(0.2)  # the releaser's threads are all held up by the bootstrap call
        t0 = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, time.sleep, 0)  # the default pool is free
        free_in = time.monotonic() - t0
        pending, dropped = len(r._tasks), r.dropped
        gate.set()
        await r.close()
        return free_in, pending, dropped, len(r._tasks)

    free_in, pending, dropped, left = asyncio.run(main())
    assert free_in < 5.0 and (pending, dropped, left) == (6, 2, 0)  # (held, the default pool waited 10 s)


class ReadingDecode(FakeVLLMServer):
    """Decode whose connector took the record (looked the transfer id up: its READ is now on the wire, on the
    lease the lookup gave it) and is slow to answer; ``looked_up``: set once it has the record."""

    def __init__(self, bootstrap_url: str):
        import threading

        self.looked_up = threading.Event()
        super().__init__("d0", bootstrap_url=bootstrap_url, token=TOKEN)

    async def complete(self, request):
        body = await request.json()
        self.bodies.append((request.path, body))
        with BootstrapClient(self.bootstrap_url, token=TOKEN) as cli:
            await asyncio.to_thread(cli.lookup_transfer, body["kv_transfer_params"]["transfer_id"], 5.0)
        self.looked_up.set()
        await asyncio.sleep(10)  # the READ, the step: the client leaves first
        return web.json_response({"choices": [{"text": "late"}]})


@pytest.mark.parametrize("decode_read", [True, False], ids=["decode-reading", "decode-never-looked"])
def test_a_client_gone_while_decode_reads_leaves_prefills_blocks_to_the_lease(bootstrap, proxy, decode_read):
    """The client leaves while decode reads prefill's blocks on the lease the bootstrap server gave it (decode
    hears of the abort only when its API server notices the closed connection). The proxy reports the request
    abandoned as the router: prefill must not get the outcome (and free the blocks, which the next request
    then overwrites under decode's READ) before that lease runs out; decode's lookups hear "released" at once.
    A request no reader took is freed at once."""
    from kvlink.bootstrap.schema import Outcome

    p = FakeVLLMServer("p0", bootstrap_url=bootstrap.url, publish=True, token=TOKEN)
    d = ReadingDecode(bootstrap.url) if decode_read else FakeVLLMServer("d0", "hang")
    try:
        url = proxy(prefill=(p.url,), decode=(d.url,), mode="concurrent", prefill_bootstrap=(bootstrap.url,),
                    prefill_engine_ids=("p0",), bootstrap_token=TOKEN)
        with pytest.raises(OSError):
            post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4}, timeout=1.5)  # the client gives up
        assert p.published == ["req-1"]
        assert not decode_read or d.looked_up.is_set()
        with BootstrapClient(bootstrap.url, token=TOKEN) as cli:
            (_, dec), = d.bodies
            transfer_id = dec["kv_transfer_params"]["transfer_id"]
            assert wait_for(lambda: bootstrap.table.stats.released_abandoned == 1)  # the proxy's report
            with pytest.raises(RequestReleased):  # readers: released, from the report on
                cli.lookup_transfer(transfer_id)
            time.sleep(0.3)
            outcomes = cli.poll_released("p0")
            if decode_read:
                assert outcomes == [] and bootstrap.table.stats.releases_deferred == 1  # prefill holds on
                cli.release("p0", "req-1", Outcome.ABANDONED)  # decode, its READ settled: freed now
                assert cli.poll_released("p0") == [("req-1", Outcome.ABANDONED)]
            else:
                assert outcomes == [("req-1", Outcome.ABANDONED)] and bootstrap.table.stats.releases_deferred == 0
    finally:
        p.stop()
        d.stop()

