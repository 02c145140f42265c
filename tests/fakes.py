"""Fakes shared by the test suites (each fake lives here once)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable


class FakeClock:
    """A monotonic clock that moves only when told to (``advance``). Safe to read from another thread."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        with self._lock:
            self._now += seconds
            return self._now


Reply = tuple[int, dict]


class ScriptedHTTPServer:
    """A tiny HTTP/1.1 server on 127.0.0.1 answering POST/GET with scripted (status, JSON) replies.

    ``script`` is called with the request path for every request; it records every request's path and the
    client port (to see connection reuse). ``close_after_each`` closes every connection after answering,
    as a server that drops idle keep-alive connections would.
    """

    def __init__(self, script: Callable[[str], Reply], close_after_each: bool = False) -> None:
        self.script = script
        self.requests: list[tuple[str, int]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                owner.requests.append((self.path, self.client_address[1]))
                status, body = owner.script(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if close_after_each:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedHTTPServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
