"""For vLLM servers of the tests and of ``bench_stream.py --device-core``: vLLM's shared-memory queue loops
nap instead of spinning.

vLLM's engine core and worker main threads busy-wait on these queues for a second after each message.
On a GPU host each has a core of its own; on a 2-core test machine several servers' spinners starve
everything else (a streamed piece took 387 ms to reach the bootstrap server in a test; decode's API
server waited up to 550 ms for CPU in the benchmark) and, holding the GIL as they spin, slow the other
threads of their process. On this path every Python process of such a server runs this at start-up. When vLLM's
``shm_broadcast`` module is first imported, its ``sched_yield`` (called in a loop while a reader waits
for the next message, for a second after each one, and while a writer waits for room) becomes a
``NAP_S`` sleep: the loop still polls the queue, so no wake-up can be missed (blocking on vLLM's
notify socket instead loses wake-ups: 5 s stalls), but it leaves the CPU and the GIL to the process's
other threads between polls. Costs up to ``NAP_S`` per message (a benchmark's single server pays it
alike). A vLLM without that function is left alone (and says so).
"""

from __future__ import annotations

import sys
import time

from after_import import after_import  # this directory is on the path: that is how this file runs

TARGET = "vllm.distributed.device_communicators.shm_broadcast"
NAP_S = 500e-6


def _nap() -> None:
    time.sleep(NAP_S)


def _patch(module) -> None:
    if not callable(getattr(module, "sched_yield", None)):
        print(f"tools/nospin: {TARGET} has no sched_yield; its queues spin as usual", file=sys.stderr)
        return
    module.sched_yield = _nap


after_import(TARGET, _patch)
