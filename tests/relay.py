"""A TCP relay for tests: forwards both directions between a client and an
engine, optionally flipping one byte of the server-to-client stream."""

from __future__ import annotations

import socket
import threading


class CorruptingRelay:
    def __init__(self, upstream: str, flip_after: int | None = None):
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.flip_after = flip_after
        self.flipped = False
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return  # closed
            u = socket.create_connection(self.upstream)
            for a, b, corrupt in ((c, u, False), (u, c, True)):
                t = threading.Thread(target=self._pump, args=(a, b, corrupt), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, corrupt: bool) -> None:
        seen = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if corrupt and self.flip_after is not None and not self.flipped and seen + len(data) > self.flip_after:
                    i = self.flip_after - seen
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
                    self.flipped = True
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
