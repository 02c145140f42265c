"""Keep one engine rank registered: heartbeat its lease, register again when the server forgot it.

The server keeps its state in memory only, so after a restart every heartbeat answers UnknownEngine; the
heartbeater then registers the rank again and calls ``on_reregistered`` (the engine's published requests are
gone with the old server and will be reported neither pulled nor expired: the prefill side must free them on
its own lease timer).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvlink.bootstrap.errors import BootstrapError, BootstrapUnavailable, Conflict, UnknownEngine
from kvlink.bootstrap.schema import EngineRegistration

if TYPE_CHECKING:
    from kvlink.bootstrap.client import BootstrapClient

log = logging.getLogger(__name__)


class Heartbeater:
    """A daemon thread renewing ``registration`` every ``interval_s`` (default a third of the lease).

    ``start()`` returns at once; the first registration happens on the thread, so an engine can start before
    the bootstrap server. Until the first registration, for ``startup_grace_s``, an unreachable server is
    expected (another rank of the engine is still starting the embedded one: every PP or TP rank but the
    first registers with the first's): retried every 0.2 s and logged at INFO; a warning after that.
    ``stop()`` joins the thread (and unregisters the rank if ``unregister_on_stop``). ``registered`` is set
    while the server is known to hold the rank.
    """

    STARTUP_RETRY_S = 0.2

    def __init__(
        self,
        client: BootstrapClient,
        registration: EngineRegistration,
        lease_s: float,
        *,
        interval_s: float | None = None,
        on_reregistered: Callable[[], None] | None = None,
        unregister_on_stop: bool = False,
        startup_grace_s: float = 30.0,
    ) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.client = client
        self.registration = registration
        self.lease_s = lease_s
        self.interval_s = interval_s if interval_s is not None else lease_s / 3.0
        if not 0 < self.interval_s < lease_s:
            raise ValueError("interval_s must be positive and shorter than lease_s")
        self.on_reregistered = on_reregistered
        self.unregister_on_stop = unregister_on_stop
        self.startup_grace_s = startup_grace_s
        self.registered = threading.Event()
        self.registrations = 0  # how many times the rank was (re-)registered; written by the thread only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeater:
        if self._thread is not None:
            raise RuntimeError("heartbeater already started")
        reg = self.registration
        name = f"kvlink-heartbeat-{reg.engine_id}-dp{reg.dp_rank}tp{reg.tp_rank}pp{reg.pp_rank}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.unregister_on_stop and self.registered.is_set():
            reg = self.registration
            try:
                self.client.unregister_engine(reg.engine_id, reg.tp_rank, reg.dp_rank, reg.pp_rank)
            except BootstrapError as err:
                log.warning("bootstrap: could not unregister %s: %s", reg.engine_id, err)
            self.registered.clear()

    def __enter__(self) -> Heartbeater:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def beat(self) -> None:
        """One heartbeat, registering when needed; raises what the client raises (used by the thread)."""
        reg = self.registration
        if not self.registered.is_set():
            self._register(again=self.registrations > 0)
            return
        try:
            self.client.heartbeat(reg.engine_id, reg.tp_rank, reg.dp_rank, reg.pp_rank, reg.instance)
        except UnknownEngine:
            self.registered.clear()
            log.warning("bootstrap: server forgot engine %s (restart or missed lease); registering again",
                        reg.engine_id)
            self._register(again=True)

    def _register(self, again: bool) -> None:
        self.client.register_engine(self.registration, self.lease_s)
        self.registrations += 1
        self.registered.set()
        if again and self.on_reregistered is not None:
            self.on_reregistered()

    def _run(self) -> None:
        outage = starting = False
        grace_end = time.monotonic() + self.startup_grace_s
        while not self._stop.is_set():
            try:
                self.beat()
                if outage:
                    log.info("bootstrap: server reachable again")
                outage = starting = False
                wait = self.interval_s
            except BootstrapUnavailable as err:
                if self.registrations == 0 and time.monotonic() < grace_end:  # not up yet: expected at start
                    if not starting:
                        log.info("bootstrap: waiting for the server to come up: %s", err)
                    starting = True
                    wait = min(self.interval_s, self.STARTUP_RETRY_S)
                    self._stop.wait(wait)
                    continue
                if not outage:
                    log.warning("bootstrap: heartbeat failed, will retry: %s", err)
                outage = True
                wait = min(self.interval_s, 1.0)
            except Conflict as err:  # a layout change, or (a heartbeat) another process took the rank over
                log.error("bootstrap: registration refused, will retry after the old lease: %s", err)
                wait = self.interval_s
            except Exception:  # never let the thread die silently: the lease would run out
                log.exception("bootstrap: heartbeat failed")
                wait = self.interval_s
            self._stop.wait(wait)
