"""Decode requests that share one prefill request: the samples of one prompt (``n > 1``). Pure logic, no I/O
(unit-tested directly); the decode scheduler owns one and calls it on its thread.

vLLM turns a request with ``n > 1`` into ``n`` child requests that all carry the parent's
``kv_transfer_params``, so all of them name one prefill request. Pulling it once for all of them:

- the first child to ask pulls; a sibling that asks while that pull runs is told to wait (vLLM asks it
  again every step). Once the first child's KV is in place, vLLM's prefix cache holds its full blocks, so
  a sibling asking then is offered those blocks locally and pulls only what the cache lacks (at most the
  prompt's last block; the whole prompt again where decode runs without prefix caching, or where the
  first child's pull was armed in lock-step: its pulled blocks leave the cache, lockstep.py);
- prefill is told decode is done with the request only when the last sibling that pulled or waited is
  done: "pulled" if any of them pulled, else "abandoned". A sibling that finishes early (aborted while it
  waited) does not release it under the others.

A server adds the ``n`` children to the engine one by one, so the first may pull and finish before the
others ask. So the decode scheduler keeps prefill's copy ``SIBLING_GRACE_S`` longer after the last sample
it knows of is done; a sibling that asks meanwhile pulls what its prefix cache lacks. A sibling offered the
KV (asked, not yet pulling) keeps it from being released as one that pulls does. Once the release is
decided, a sibling asking later still (held back by ``max_num_seqs``, say) is told the copy is gone and
computes the prompt: its own renewal could otherwise reach the server before the release does, be
answered "held", and make a READ trusted that lands after prefill freed the blocks.
"""

from __future__ import annotations

import collections
import re

from dataclasses import dataclass, field


@dataclass
class _Source:
    pulling: set[str] = field(default_factory=set)
    waiting: set[str] = field(default_factory=set)
    offered: set[str] = field(default_factory=set)  # told to pull, not started yet
    pulled: bool = False  # a sibling's pull ended well


SIBLING_GRACE_S = 2.0  # how long prefill's copy outlives the last sample decode knows of
MAX_RELEASED = 65536  # released keys remembered (oldest forgotten first)
_SAMPLE = re.compile(r"\d+_.")


def is_sample(request_id: str) -> bool:
    """vLLM names the child requests of an ``n > 1`` request ``<index>_<parent id>``."""
    return _SAMPLE.match(request_id) is not None


class Siblings:
    """Per prefill request (``RemoteSource.key``): which decode requests pull it and which wait."""

    def __init__(self) -> None:
        self._by_key: dict[str, _Source] = {}
        self._starts: dict[str, int] = {}  # pulls started per key, until its release is decided (settle)
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()  # decided (settle)

    def ask(self, key: str, rid: str) -> str:
        """``rid`` asks to pull ``key``: "wait" while another request's pull of it runs, "gone" once its
        release was decided (compute the prompt), else "pull" (offered: the release waits for it too)."""
        if key in self._released:
            return "gone"
        s = self._by_key.setdefault(key, _Source())
        if s.pulling - {rid}:
            s.waiting.add(rid)
            return "wait"
        s.waiting.discard(rid)
        s.offered.add(rid)
        return "pull"

    def started(self, key: str, rid: str) -> None:
        """``rid`` pulls ``key`` now (or has been given all of it by the prefix cache: ``ended`` follows)."""
        s = self._by_key.setdefault(key, _Source())
        s.waiting.discard(rid)
        s.offered.discard(rid)
        s.pulling.add(rid)
        self._starts[key] = self._starts.get(key, 0) + 1

    def ended(self, key: str, rid: str, pulled: bool) -> bool | None:
        """``rid`` is done with ``key`` (its pull ended, or it left while waiting). Returns None while a
        sibling still pulls or waits, else whether to tell prefill "pulled" (True) or "abandoned" (False)."""
        s = self._by_key.get(key)
        if s is None:
            return pulled
        s.pulling.discard(rid)
        s.waiting.discard(rid)
        s.offered.discard(rid)
        s.pulled = s.pulled or pulled
        if s.pulling or s.waiting or s.offered:
            return None
        del self._by_key[key]
        return s.pulled

    def starts(self, key: str) -> int:
        """How many pulls of ``key`` have started (a release decided later is void if this grew)."""
        return self._starts.get(key, 0)

    def settle(self, key: str, starts: int) -> bool:
        """A release of ``key`` decided when ``starts`` pulls had started: True (and ``key`` forgotten) when
        no request pulls or waits for it and no pull started since; else False (a later one releases)."""
        if key in self._by_key or self._starts.get(key, 0) != starts:
            return False
        self._starts.pop(key, None)
        self._released[key] = None
        while len(self._released) > MAX_RELEASED:
            self._released.popitem(last=False)
        return True

    def waiting(self, key: str) -> set[str]:
        s = self._by_key.get(key)
        return set(s.waiting) if s else set()

    def __len__(self) -> int:
        return len(self._by_key)
