"""Decode's first step in lock-step with prefill's last layers (streamed KV, ``stream_lockstep``).

Without it, decode's one-token step starts only once prefill has published the request and its last
READ has landed: the step (12-25 ms on the benchmark's CPU, bench/results/stream.md) is added to the
time to first token in full. vLLM calls ``wait_for_layer_load`` before every attention layer on decode
too, so the request can be handed to vLLM (reported in ``finished_recving``) while prefill still computes
its last layers: the pull is *armed*. Decode's step then waits, layer by layer, for that layer's KV to
land, and at its end (before vLLM reads the step's output) for the pull's outcome: prefill's published
record at the epoch that was read, and the lease. A pull that fails after it was armed puts its blocks in
the step's ``invalid_block_ids``, and vLLM fails the request (``kv_load_failure_policy: fail``).

When to arm: once every position the pull fills has been announced in at least one layer (prefill is in
the step that ends the prompt), and prefill's remaining layers (the last one announced included: on entry
to its attention op it still computes), at the pace it announced the last ones, end no later than
decode's own lead (its usual step and scheduling, plus ``stream_lockstep_stall_ms`` the other requests of
the step may wait). Where even the last layer takes longer than that, the pull is not armed and ends as
without lock-step. ``ArmClock`` decides; it is pure, like the pull table that holds one per pull.

What vLLM does with an armed request, and why each refusal in ``why_not_lockstep`` exists:
- no async scheduling: vLLM would schedule the next step while the armed one still waits for its READs,
  and could preempt the armed request and give its blocks to another while they land (its load errors
  are charged to running requests only); with ``recompute`` the next step, already in flight, would also
  append a token sampled from the failed one;
- a failed armed pull is a failed "sync load" of a running request (vLLM's ``_handle_invalid_blocks``):
  ``fail`` or ``recompute``;
- the blocks of a reported request enter the prefix cache when vLLM takes it, before their KV is
  confirmed, and a request of that same step may match them: the step that takes it evicts them and waits
  for the pull as the request's own would (``LockstepBook.shared``), reporting them as load errors
  if it failed. With "recompute" vLLM may free a request that matched them as its local hit while its own
  READs still land: prefix caching needs ``fail``;
- one KV cache group: vLLM refuses block-level load errors with several;
- one rank (TP = PP = 1): each rank would confirm its own READs, nothing aggregates that yet;
- no host staging on decode: the landing copy is not layer by layer;
- a backend that can stop a READ before its cancel returns (not Mooncake's): an aborted armed request's
  blocks are given back to vLLM once the cancel has settled, and its step must not end while a READ of
  it may still land.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_STEP_S = 0.02  # decode's step before one was measured
STEP_EMA = 0.2  # weight of a new step in decode's step time
SCHEDULE_S = 0.003  # report -> vLLM schedules the request (the nudge, the collect, the schedule)


def why_not_lockstep(policy: str, async_scheduling: bool, prefix_caching: bool, tp: int, pp: int,
                     groups: int, staged: bool, sync_cancel: bool, granularity: str) -> str | None:
    """Why decode cannot run its first step in lock-step with prefill (None: it can)."""
    if async_scheduling:
        return ("async scheduling (vLLM schedules the next step while the armed one still waits for its READs, "
                "and may preempt the armed request and hand its blocks on while they land): start decode with "
                "--no-async-scheduling")
    if policy not in ("fail", "recompute"):
        return f"kv_load_failure_policy {policy!r}: use \"fail\" or \"recompute\""
    if prefix_caching and policy != "fail":
        return ("prefix caching with kv_load_failure_policy \"recompute\" (vLLM may free the blocks of a request "
                "that matched an armed request's while its own READs still land): use \"fail\", or start decode "
                "with --no-enable-prefix-caching")
    if tp != 1 or pp != 1:
        return f"decode runs TP={tp}, PP={pp} (lock-step confirms one rank's READs only)"
    if groups != 1:
        return f"{groups} KV cache groups (vLLM refuses block-level load errors with several)"
    if staged:
        return "host staging on decode (the landing copy is not layer by layer)"
    if not sync_cancel:
        return "the transport backend cannot stop a READ before its cancel returns"
    if granularity != "layer":
        return "stream_granularity is not \"layer\""
    return None


@dataclass
class ArmClock:
    """When to arm one streamed pull: fed the fewest layers announced over its positions (0 while some
    position has none) each time a piece arrives."""

    num_layers: int
    t0: float = -1.0  # when every position first had a layer announced
    a0: int = 0  # ... and how many

    def ready(self, announced: int, now: float, lead_s: float) -> bool:
        """``announced`` layers hold their KV: prefill still computes the last of them (a layer announced on
        entry to its attention op) and those after it. Every layer at first sight (no pace known): armed,
        the last notice before the record. A pace that leaves more than ``lead_s`` to go: not yet (and not
        at all if that was the last layer: the pull then ends as it would without lock-step)."""
        if announced <= 0:
            return False
        if self.t0 < 0:
            self.t0, self.a0 = now, announced
            return announced >= self.num_layers
        if announced <= self.a0:
            return False
        per_layer = (now - self.t0) / (announced - self.a0)
        return (self.num_layers - announced + 1) * per_layer <= lead_s


@dataclass
class Armed:
    """An armed pull: reported to vLLM, its outcome still to come (None) or not handed out yet."""

    blocks: tuple[int, ...]  # decode's blocks it fills: the step's load errors if it fails
    outcome: bool | None = None  # True: confirmed; False: failed or cancelled
    free_wanted: bool = False  # vLLM finished the request: report it freed once the pull settles
    shared_reported: bool = False  # failed, and a step that took it without running it reported its blocks


def lead_s(step_s: float, stall_ms: float) -> float:
    """How long before prefill's last layer ends a pull may be armed: decode's step and scheduling, and
    what the other requests of the step may wait."""
    return step_s + SCHEDULE_S + stall_ms / 1e3


class LockstepBook:
    """Decode's scheduler side of lock-step: which armed requests may still be written (their pull has not
    settled), which vLLM has not scheduled yet (their first step waits for their KV), which vLLM finished
    while armed (their blocks go back once the worker reports the pull stopped), and, with prefix caching,
    which armed requests vLLM has taken out of waiting for their KV (it cached their pulled blocks then).
    Pure: the scheduler's thread feeds it; vLLM's requests are read through ``is_taken`` and its prefix
    cache reached through ``evict`` (``bind``)."""

    def __init__(self) -> None:
        self.unsettled: set[str] = set()
        self.unscheduled: set[str] = set()
        self.freeing: set[str] = set()
        self.new_frees: list[str] = []
        # With prefix caching: each pull's request and its pulled blocks (lock-step may arm it), and the
        # armed ones vLLM has taken.
        self.prefix_caching = False
        self.requests: dict[str, tuple[Any, tuple[int, ...]]] = {}
        self.taken: set[str] = set()
        self._evict: Callable[[set[int]], Any] | None = None

    def bind(self, evict: Callable[[set[int]], Any]) -> None:
        """How blocks leave vLLM's prefix cache (its KV cache manager's ``evict_blocks``)."""
        self._evict = evict

    def track(self, rid: str, request: Any, blocks: tuple[int, ...]) -> None:
        """A pull that lock-step may arm (prefix caching only): its request and the blocks it fills."""
        if self.prefix_caching:
            self.requests[rid] = (request, tuple(b for b in blocks if b))

    def is_armed(self, rid: str) -> bool:
        return rid in self.unsettled or rid in self.unscheduled

    def finish(self, rid: str, aborted: bool) -> tuple[bool, bool]:
        """vLLM finished request ``rid``: (armed: its free waits for the worker's report that the pull
        stopped; cancel: an abort while its pull may still write, which prefill hears of as abandoned)."""
        if not self.is_armed(rid):
            return False, False
        cancel = rid in self.unsettled and aborted
        self.unsettled.discard(rid)
        self.unscheduled.discard(rid)
        self.new_frees.append(rid)
        self.freeing.add(rid)
        return True, cancel

    def worker_output(self, armed: set[str], settled: dict[str, bool], evict: set[int],
                      finished_sending: Any, cancelled: set[str]) -> set[str]:
        """What the worker armed, settled and wants out of the prefix cache this step
        (metadata.KVLinkWorkerMeta). Returns the armed requests already cancelled: the caller keeps them
        out of finished_recving, which would free their blocks under a READ still on the wire (the worker
        reports them in finished_sending once the cancel settled)."""
        if evict:
            self.evict(evict)  # the step that heard of them reported them as load errors
        gone = armed & cancelled
        self.freeing |= gone
        self.unsettled |= armed - gone
        self.unscheduled |= armed - gone
        self.freeing.difference_update(finished_sending or ())  # (after the arms: a free may come with its arm)
        self.unsettled.difference_update(settled)
        return gone

    def schedule(self, new: list[str]) -> tuple[list[str], list[str]]:
        """A step's schedule: (the armed requests among ``new``, which its step runs in lock-step; the
        armed requests vLLM finished whose blocks the worker must stop writing)."""
        own = [rid for rid in new if rid in self.unscheduled]
        self.unscheduled.difference_update(own)
        frees, self.new_frees = self.new_frees, []
        return own, frees

    def shared(self, own: list[str], pulling: Any, is_taken: Callable[[Any], bool]) -> list[str]:
        """Prefix caching: armed requests vLLM took (out of waiting for their KV) in this step's schedule,
        other than ``own``, the ones this step runs. A request is seen taken at the end of the schedule
        that took it (before any abort): vLLM put its pulled blocks in the prefix cache then, and requests
        of this very step may have matched them. Those blocks leave the cache here, so no later step can
        match them; this step waits for their pull, and reports them as load errors if it ended
        unconfirmed (worker). Later steps need not wait: what matched them ran in this one, which ends only
        once the outcome is known. ``pulling``: the requests whose pulls the scheduler still tracks."""
        live = self.unsettled | self.unscheduled | self.freeing
        now_taken = set()
        for rid in (self.unsettled | self.unscheduled) - self.taken:
            req, blocks = self.requests.get(rid, (None, ()))
            if req is not None and is_taken(req):
                now_taken.add(rid)
                if blocks:
                    self.evict(set(blocks))  # unconfirmed: never matched again
        self.taken = (self.taken | now_taken) & live
        for rid in [r for r in self.requests if r not in live and r not in pulling]:
            del self.requests[rid]
        return sorted(now_taken - set(own))

    def busy(self) -> bool:
        """Prefix caching: something to look at in a step's schedule."""
        return self.prefix_caching and bool(self.unsettled or self.freeing or self.requests)

    def evict(self, blocks: set[int]) -> None:
        if blocks and self._evict is not None:
            self._evict(blocks)
