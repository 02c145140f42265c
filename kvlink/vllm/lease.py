"""Decode side: keep prefill's leases alive while a pull is still running.

Prefill keeps a finished request's blocks for ``lease_s`` (the bootstrap server expires them after that).
A pull that outlives a lease would otherwise read blocks that prefill already freed and reused. The
LeaseRenewer thread renews (bootstrap ``renew``) every running pull when it is due (a new pull at once, then
every third of its lease), one grouped call per (bootstrap server, prefill engine), and reports pulls whose
lease is already gone so the worker fails them (recompute) instead of trusting the bytes.

Each successful renewal also proves something: prefill still held the blocks when the call was sent, and
will hold them until at least ``sent + lease_s``. ``renewed(pulls, held_until)`` hands that bound to the
worker, which trusts a finished READ only if it ended before the bound (see worker ``_settle_lease``).

A group's renewal runs on its own pool thread, so a hung bootstrap server holds back only its own pulls.
It never touches the transport or vLLM: ``active()`` lists the pulls to keep alive, ``lost(pull, why)``
is called for each one that cannot be renewed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class LeaseTerm:
    """What the renewer needs of one pull. ``next_renew``: set by the renewer; the worker sets 0.0 (due now)."""

    bootstrap_url: str
    engine_id: str
    request_id: str  # prefill's id
    lease_s: float  # renew for this long each time
    next_renew: float  # monotonic time of the next renewal


class LeaseRenewer:
    """Thread that renews the leases of running pulls. ``clients(url)`` gives a BootstrapClient.

    Each (bootstrap server, prefill engine) group is renewed on its own pool thread, one call in flight
    per group: a bootstrap server that hangs delays only its own pulls (their deadline bounds them), never
    the renewals of pulls from healthy servers. ``spawn`` runs a group's call (tests pass ``lambda f: f()``).
    """

    MAX_IDLE_S = 1.0  # how often it looks for new pulls when none is due
    MIN_ROUND_S = 0.01  # rounds at most this often: a burst of new pulls shares one call per engine
    MAX_THREADS = 32  # groups renewed at once

    def __init__(self, clients: Callable[[str], Any], active: Callable[[], Iterable[tuple[Any, LeaseTerm]]],
                 lost: Callable[[Any, str], None],
                 renewed: Callable[[list, float], None] = lambda pulls, held_until: None,
                 spawn: Callable[[Callable[[], None]], Any] | None = None):
        self._clients, self._active, self._lost, self._renewed = clients, active, lost, renewed
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._lock = threading.Lock()
        self._busy: set[tuple[str, str]] = set()  # groups with a call in flight
        self._warned: set[str] = set()
        self._pool = None
        if spawn is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.MAX_THREADS, thread_name_prefix="kvlink-lease")
            spawn = self._pool.submit
        self._spawn = spawn
        self._thread = threading.Thread(target=self._run, name="kvlink-lease-renew", daemon=True)

    def start(self) -> "LeaseRenewer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def kick(self) -> None:
        """A pull is due now (a new one): run a round without waiting for the current sleep to end."""
        self._kick.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.clear()  # before the round: a kick during it makes the wait below return at once
            started = time.monotonic()
            try:
                wait = self.renew_due(started)
            except Exception:  # noqa: BLE001 - never let the renewer die; the pull deadline still bounds
                logger.exception("kvlink: lease renewal round failed")
                wait = self.MAX_IDLE_S
            self._kick.wait(wait)
            self._stop.wait(self.MIN_ROUND_S - (time.monotonic() - started))  # no-op if negative

    def renew_due(self, now: float) -> float:
        """Start a renewal for every group with a pull due (unless one is in flight); return how long to
        sleep until the next pull is due. A group's call kicks the loop when it ends."""
        groups: dict[tuple[str, str], list[tuple[Any, LeaseTerm]]] = {}
        for pull, term in self._active():
            if term.next_renew <= now:
                groups.setdefault((term.bootstrap_url, term.engine_id), []).append((pull, term))
        for key, items in groups.items():
            with self._lock:
                if key in self._busy:
                    continue
                self._busy.add(key)
            try:
                self._spawn(lambda key=key, items=items: self._renew_group(key, items))
            except RuntimeError:  # pool shut down: stopping
                with self._lock:
                    self._busy.discard(key)
        with self._lock:
            busy = set(self._busy)
        next_due = now + self.MAX_IDLE_S
        for _, term in self._active():
            if (term.bootstrap_url, term.engine_id) not in busy:
                next_due = min(next_due, term.next_renew)
        return max(0.01, next_due - time.monotonic())

    def _renew_group(self, key: tuple[str, str], items: list[tuple[Any, LeaseTerm]]) -> None:
        """One grouped renew call; reports lost and held pulls and schedules the group's next renewal."""
        url, engine_id = key
        try:
            lease_s = max(term.lease_s for _, term in items)
            sent = time.monotonic()
            try:
                failed = self._clients(url).renew(engine_id, [term.request_id for _, term in items], lease_s)
            except Exception as e:  # noqa: BLE001 - try again soon; the pull's own deadline bounds it
                if url not in self._warned:
                    self._warned.add(url)
                    logger.warning("kvlink: cannot renew leases at %s: %s (retrying)", url, e)
                retry = time.monotonic() + min(0.5, lease_s / 6)
                for _, term in items:
                    term.next_renew = retry
                return
            self._warned.discard(url)
            held = []
            for pull, term in items:
                status = failed.get(term.request_id)
                if status is not None:
                    self._lost(pull, f"prefill lease of {engine_id}/{term.request_id} is "
                                     f"{getattr(status, 'value', status)}; its blocks may be reused")
                    continue
                held.append(pull)
                term.next_renew = time.monotonic() + term.lease_s / 3
            self._renewed(held, sent + lease_s)
        finally:
            with self._lock:
                self._busy.discard(key)
            self._kick.set()
