"""One :class:`BootstrapClient` per bootstrap server URL, shared by threads.

A decode engine talks to as many bootstrap servers as there are prefill engines with embedded servers; the
scheduler side and the worker side each keep one pool, so every server gets one client (and its keep-alive
connections) per process side instead of one per request.
"""

from __future__ import annotations

import threading

from kvlink.bootstrap.client import BootstrapClient
from kvlink.bootstrap.errors import BootstrapError, InvalidField


class ClientPool:
    """Clients by URL, made on first use with the same token, timeout and retries. Thread-safe."""

    def __init__(self, token: str | None, timeout_s: float, retries: int = 1) -> None:
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise InvalidField(f"timeout_s must be a positive number of seconds, got {timeout_s!r}",
                               field="timeout_s")
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise InvalidField(f"retries must be an int >= 0, got {retries!r}", field="retries")
        self._token, self._timeout_s, self._retries = token, float(timeout_s), retries
        self._lock = threading.Lock()  # guards _by_url and _closed
        self._by_url: dict[str, BootstrapClient] = {}
        self._closed = False

    def get(self, url: str) -> BootstrapClient:
        """The client of ``url`` (InvalidField if it is not an http(s)://host:port URL)."""
        with self._lock:
            if self._closed:
                raise BootstrapError(f"bootstrap client pool is closed (asked for {url})")
            client = self._by_url.get(url)
            if client is None:
                client = self._by_url[url] = BootstrapClient(url, token=self._token, timeout_s=self._timeout_s,
                                                             retries=self._retries)
            return client

    def close(self) -> None:
        """Close every client; later ``get`` calls raise BootstrapError. Idempotent."""
        with self._lock:
            self._closed = True
            clients, self._by_url = list(self._by_url.values()), {}
        for client in clients:
            client.close()

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
