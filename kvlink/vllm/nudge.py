"""Decode: a worker nudges its scheduler when a pull ends, so a step that waits while pulls wait for prefill
(``pull_step_wait_ms``) ends then, not at the end of its wait, and the finished pull is handed to vLLM in
that step.

vLLM's scheduler (the EngineCore process) and its workers (child processes of it, or that process itself)
share a host. The scheduler binds a datagram socket in Linux's abstract namespace, named for its pid and
the engine id; a worker sends one byte to the names of its parent's pid and of its own (the scheduler is
one of them). Nothing waits on a nudge: where none can be sent or heard (another OS, workers that are not
the scheduler's children, the name taken), each step waits its whole ``pull_step_wait_ms`` as before. A
nudge is only a hint: any local process could send one, and all it does is end a step's wait early.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time

logger = logging.getLogger(__name__)

_FLAGS = getattr(socket, "SOCK_NONBLOCK", 0) | getattr(socket, "SOCK_CLOEXEC", 0)


def address(pid: int, engine_id: str) -> bytes:
    """The abstract socket name of the scheduler of ``engine_id`` in process ``pid``."""
    return b"\0kvlink-nudge/" + f"{pid}/{engine_id}".encode()[:90]


class NudgeListener:
    """Scheduler side: ``wait`` sleeps up to a timeout, or until a worker nudges."""

    def __init__(self, engine_id: str):
        self._sock: socket.socket | None = None
        self._poll = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | _FLAGS)
        except OSError as e:
            logger.info("kvlink: no nudges from the workers (%s): steps waiting for pulls wait it out", e)
            return
        try:
            sock.bind(address(os.getpid(), engine_id))
        except OSError as e:
            sock.close()
            logger.info("kvlink: no nudges from the workers (%s): steps waiting for pulls wait it out", e)
            return
        sock.setblocking(False)
        self._sock, self._poll = sock, select.poll()
        self._poll.register(sock, select.POLLIN)

    @property
    def listening(self) -> bool:
        return self._sock is not None

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True if a nudge (maybe one that came before this call) ended it."""
        sock, poll = self._sock, self._poll
        if sock is None:
            time.sleep(timeout_s)
            return False
        nudged = False
        try:
            nudged = any(ev & select.POLLIN for _, ev in poll.poll(max(0.0, timeout_s) * 1e3))
            while True:  # one wait per nudge at most: the step that follows hands over what ended
                sock.recv(16)
        except OSError:  # drained (or closed meanwhile: shutting down)
            pass
        return nudged

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Nudger:
    """Worker side: ``nudge`` the scheduler (never blocks, never fails)."""

    def __init__(self, engine_id: str):
        self._to = {address(os.getppid(), engine_id), address(os.getpid(), engine_id)}
        try:
            self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | _FLAGS)
            self._sock.setblocking(False)
        except OSError:
            self._sock = None

    def nudge(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for to in self._to:
            try:
                sock.sendto(b"!", to)
            except OSError:  # nobody there (not the scheduler's process), or its queue is full: a hint lost
                pass

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
