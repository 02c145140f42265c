"""The proxy gives prefill's KV back when decode never takes the request.

Prefill holds a finished request's blocks until decode reports it (pulled or abandoned) or its lease runs
out. When the proxy's decode leg ends without decode using the KV (decode refused the connection, answered
an error, timed out, or the client left first), nobody else may report it, and prefill's blocks would wait
out their lease (30 s by default): under a decode outage prefill's KV pool fills up with requests nobody
will read. So the proxy reports them ``abandoned`` itself, through the prefill's bootstrap server:

- sequential pairing: the request named in prefill's ``kv_transfer_params``;
- concurrent pairing: the request published under the transfer id, if prefill published it (a prefill
  still computing is cancelled by the proxy instead, and its connector gives the id up itself).

Decode's request may not have ended when the proxy reports it: the client left or the proxy gave up
waiting, and decode hears of the abort only when its API server notices the closed connection, while a
READ it trusts on the strength of a lease the bootstrap server gave it may still be on the wire. So the
reports say they come from the router (``router=True``): a request a reader was handed (looked up by
transfer id, or renewed) is freed only once that lease has run out, or at once when decode releases it itself; readers
hear "released" from the report on (PairingTable.release). A request no reader was handed (decode refused
the connection, or never got that far) is freed at once. A report that fails is logged and dropped: the
lease frees the blocks anyway.

One call is made while decode's request may still be out: ``abandon``, for a concurrent prefill that failed
by itself (its connector may never have seen the request, so nobody else gives the transfer id up, and decode
would wait its whole ``lookup_wait_s`` before computing the prompt). It only gives up an id nothing is
published under: with an engine id, after a lookup finds nothing published (the caller names the engine
only when prefill answered, so nothing can be published after the lookup); without one, the bootstrap
server checks that (409 Conflict when something is published or streamed: prefill's connector handles it).

The calls run on threads of the releaser's own (the bootstrap client is blocking; asyncio's default pool
also resolves the backends' host names, so a slow bootstrap server must not fill it) and never hold up the
client's answer. At most ``MAX_PENDING`` reports, and as many abandons, wait at once: one beyond that is
dropped and counted (the lease frees the blocks; decode's own wait ends), so a flood of failing requests or
a bootstrap outage cannot grow them.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from kvlink.bootstrap.errors import BootstrapError, BootstrapUnavailable, Conflict, Unauthorized, UnknownRequest
from kvlink.bootstrap.pool import ClientPool
from kvlink.bootstrap.schema import Outcome

logger = logging.getLogger(__name__)

PUBLISH_WAIT_S = 2.0  # how long a concurrent request's record is waited for (in the background)
THREADS = 4  # bootstrap calls at once for reports (each may wait PUBLISH_WAIT_S for a record)
MAX_PENDING = 1024  # reports waiting or under way; more are dropped (and counted)


class Releaser:
    """Reports prefill requests abandoned and gives up transfer ids of failed concurrent prefills, in the
    background; ``close`` waits for what is under way."""

    def __init__(self, token: str | None, timeout_s: float = 5.0):
        self._pool = ClientPool(token, timeout_s, retries=1)
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="kvlink-proxy-release")
        # abandon() answers a decode that is waiting: never queued behind reports that wait for records
        self._urgent = ThreadPoolExecutor(2, thread_name_prefix="kvlink-proxy-abandon")
        self._tasks: set[asyncio.Task] = set()  # reports
        self._urgent_tasks: set[asyncio.Task] = set()  # abandons
        self.reported = 0  # requests reported abandoned (for /health)
        self.transfers_abandoned = 0  # transfer ids given up for a failed concurrent prefill (for /health)
        self.dropped = 0  # reports or abandons not made: MAX_PENDING of the kind were waiting (for /health)

    def request(self, bootstrap_url: str, engine_id: str, request_id: str) -> None:
        """Sequential pairing: prefill's ``remote_engine_id``/``remote_request_id`` at ``bootstrap_url``."""
        self._spawn(bootstrap_url, lambda cli: cli.release(engine_id, request_id, Outcome.ABANDONED, router=True),
                    f"request {request_id} of engine {engine_id}", self._reported)

    def transfer(self, bootstrap_url: str, transfer_id: str, engine_id: str | None) -> None:
        """Concurrent pairing: whatever prefill published under ``transfer_id`` (nothing if it did not)."""
        def work(cli):
            # A prefill that finished as the proxy gave up on the request publishes a moment later; one that
            # was stopped mid-compute gives the id up (410 at once) or never publishes (the wait ends).
            rec = cli.lookup_transfer(transfer_id, wait_s=PUBLISH_WAIT_S, engine_id=engine_id, peek=True)
            return cli.release(rec.engine_id, rec.request_id, Outcome.ABANDONED, router=True)

        self._spawn(bootstrap_url, work, f"transfer {transfer_id}", self._reported)

    def abandon(self, bootstrap_url: str, transfer_id: str, engine_id: str | None) -> None:
        """Concurrent pairing, prefill failed by itself: give ``transfer_id`` up unless something is published
        under it, so a decode long-polling it hears "released" at once and computes the prompt."""
        def work(cli):
            if engine_id is not None:  # named, the server would release a published request: look first
                try:
                    rec = cli.lookup_transfer(transfer_id, engine_id=engine_id, peek=True)
                except UnknownRequest:
                    pass  # nothing published: nobody reads it
                else:
                    raise Conflict(f"request {rec.request_id} is published under it; decode may be reading it")
            return cli.abandon_transfer(engine_id, transfer_id)

        self._spawn(bootstrap_url, work, f"transfer {transfer_id}", self._given_up, self._urgent)

    def _reported(self, what: str, url: str) -> None:
        self.reported += 1
        logger.info("proxy: decode did not take %s; reported it abandoned at %s", what, url)

    def _given_up(self, what: str, url: str) -> None:
        self.transfers_abandoned += 1
        logger.info("proxy: prefill failed; gave %s up at %s, so decode computes the prompt", what, url)

    def _spawn(self, url: str, call, what: str, done, threads: ThreadPoolExecutor | None = None) -> None:
        # Each kind has its own bound: a flood of reports does not keep abandons out, nor the other way round.
        # (An abandon dropped leaves decode to its own lookup_wait_s; a report dropped, prefill to its lease.)
        tasks = self._tasks if threads is None else self._urgent_tasks
        if len(tasks) >= MAX_PENDING:
            self.dropped += 1
            logger.warning("proxy: %d calls to bootstrap servers pending; %s not made (%s)", len(tasks), what,
                           "its lease frees it" if threads is None else "decode's own wait ends")
            return

        async def run() -> None:
            try:
                already = await asyncio.get_running_loop().run_in_executor(threads or self._threads, call,
                                                                           self._pool.get(url))
            except (BootstrapUnavailable, Unauthorized) as e:  # the operator should hear of these
                logger.info("proxy: could not report %s abandoned at %s: %s", what, url, e)
                return
            except BootstrapError as e:  # unknown (never published, or released by decode), expired, ...
                logger.debug("proxy: %s not reported abandoned at %s: %s", what, url, e)
                return
            except Exception as e:  # noqa: BLE001 - its lease frees the blocks anyway
                logger.info("proxy: could not report %s abandoned at %s: %s", what, url, e)
                return
            if not already:
                done(what, url)

        task = asyncio.get_running_loop().create_task(run())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def close(self) -> None:
        pending = [*self._tasks, *self._urgent_tasks]
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        for task in pending:
            task.cancel()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._urgent.shutdown(wait=False, cancel_futures=True)
        self._pool.close()
