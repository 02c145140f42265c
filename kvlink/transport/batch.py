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
        # kvl_batch_wait takes uint32 ms: a longer wait (inf: forever) is the longest it takes, ~49.7 days
        B.batch_wait(self._h, max(1, int(t * 1000)) if t < 0xFFFFFFFF / 1000 else 0xFFFFFFFF)

    def cancel(self) -> bool:
        """Stop the batch: True if this call stopped it (poll/wait then raise
        Canceled), False if it had already finished (its outcome stands)."""
        return B.batch_cancel(self._h)

    def release(self) -> None:
        """Let the C handle go: the batch is stopped now (nothing lands in its memory once this returns) and
        the handle freed once no call on it is under way in another thread (else when garbage collected)."""
        h, self._h = self._h, None
        if h is not None:
            B.batch_cancel(h)  # what kvl_batch_release would do first; its own cancel is then a no-op
            # Not ffi.release(h): a wait() in another thread holds h and is inside kvl_batch_wait; the
            # ffi.gc destructor (kvl_batch_release) runs when the last reference, ours or its, goes.

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._h is not None:
            self.cancel()  # no-op once finished
        self.release()
