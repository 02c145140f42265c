"""Batch: one submitted READ or WRITE and its completion."""

from __future__ import annotations

from typing import Any

from kvlink import _binding as B


class Batch:
    """Poll it, wait on it with a timeout, or cancel it.

    Once ``cancel()`` returns, or ``wait()``/``poll()`` reports a failure or a
    timeout, the engine never writes into this batch's local memory again.
    """

    def __init__(self, handle: Any, keep: Any, nbytes: int, timeout_s: float):
        self._h = handle
        self._keep = keep  # the local region: its memory must outlive the transfer
        self.nbytes = nbytes
        self._timeout_s = timeout_s

    @property
    def descriptors(self) -> int:
        """Descriptors on the wire, after coalescing and striping."""
        return B.batch_descriptors(self._h)

    def poll(self) -> bool:
        """True when finished; raises the batch's error if it failed."""
        return B.batch_poll(self._h)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until finished; raise its error if it failed. When timeout_s
        (default: the batch's own timeout plus a second) passes first, the
        batch is canceled and TimeoutError_ raised."""
        t = self._timeout_s + 1.0 if timeout_s is None else timeout_s
        B.batch_wait(self._h, max(1, int(t * 1000)))

    def cancel(self) -> bool:
        """Stop the batch: True if this call stopped it (poll/wait then raise
        Canceled), False if it had already finished (its outcome stands)."""
        return B.batch_cancel(self._h)

    def release(self) -> None:
        """Free the C handle now (it is otherwise freed when garbage collected)."""
        if self._h is not None:
            B.batch_release(self._h)
            self._h = None

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._h is not None:
            self.cancel()  # no-op once finished
        self.release()
