"""Decode side: the lease renewal calls that keep prefill's blocks alive while a pull runs.

Prefill keeps a finished request's blocks for ``lease_s`` (the bootstrap server expires them after that).
A pull that outlives a lease would otherwise read blocks that prefill already freed and reused. Which
pulls are due, and what a renewal proves, is decided by the pull table (pulls.py: ``Renew`` actions,
one call in flight per (bootstrap server, prefill engine) group). This module only makes the calls.

Each call runs on its own pool thread, so a hung bootstrap server holds back only its own group's
renewals (their pulls' deadline bounds them), never those of healthy servers. A successful renewal
proves that prefill held the blocks when the call was sent and will hold them until at least
``sent + lease_s``; that bound goes back to the table with ``lease_held``.

A sequential pull's params came from decode's client: before its first lease proof the call also looks the
request up (beside the renew call, on a thread of its own: one round trip), and the record prefill published
is the authority (``RecordCheck``): a pull whose params name other block ids, or whose prompt is not the one
prefill computed (decode's own digests of its prompt against the record's), or a Mamba pull loading another
token count, or one reading through ranks of another launch than the one that published, is failed
(``lease_lost``), never trusted. (A client could otherwise name a live prefill request and any block ids of
that engine, or drop or forge the params' prompt fields: another prompt's KV, read into its own decode.)
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvlink.bootstrap.schema import MAX_READER
from kvlink.vllm.pulls import PullTable, Renew

logger = logging.getLogger(__name__)

Apply = Callable[[Callable[[PullTable, float], Any]], None]


@dataclass(frozen=True)
class RecordCheck:
    """What a sequential pull takes on its params' word, to check against prefill's published record: the
    block ids the params name, decode's own digests of its prompt (token count -> params.prompt_digest: of
    the tokens it loads and of its whole prompt), the exact count a Mamba state needs (None: any), the
    launch of the ranks decode reads through, and the counts a record may have (the tokens decode loads, its
    whole prompt; () any): compared also where no digest is (a prompt of embeddings), so that decode never
    counts positions prefill did not compute as filled."""

    blocks: tuple[tuple[int, ...], ...]
    digests: tuple[tuple[int, str], ...] = ()
    num_tokens: int | None = None
    launch: str | None = None
    counts: tuple[int, ...] = ()

    def wrong(self, rec: Any, where: str) -> str | None:
        """Why ``rec`` (the record of ``where``: engine/request) does not back this pull, or None."""
        if tuple(map(tuple, rec.block_ids)) != self.blocks:
            return f"kv_transfer_params name other block ids than prefill published for request {where}: not read"
        if self.num_tokens is not None and rec.num_tokens != self.num_tokens:
            return (f"prefill computed {rec.num_tokens} tokens of request {where}, decode loads {self.num_tokens}: "
                    "a Mamba state continues only from the tokens it saw")
        if self.counts and rec.num_tokens not in self.counts:
            return (f"prefill computed {rec.num_tokens} tokens of request {where}, decode's prompt has "
                    f"{max(self.counts)}: another prompt, its KV is not used")
        mine = dict(self.digests)
        if rec.prompt_sha is not None and mine and mine.get(rec.num_tokens) != rec.prompt_sha:
            return (f"prefill computed another prompt for request {where} ({rec.num_tokens} tokens that are not "
                    "decode's): its KV is not used")
        if rec.launch is not None and rec.launch != self.launch:
            return (f"request {where} was published by another launch of the engine than the ranks decode reads "
                    "through (a restarted prefill under the same engine id): not read")
        return None


def reader_of(engine_id: str, launch: str | None) -> str:
    """How a decode engine names itself to bootstrap servers as a reader of prefill's requests (its lookups,
    renewals and releases: PairingTable.release): its id and start, which its scheduler and workers share.
    Another engine's release then does not free blocks this one still reads. One longer than the wire
    allows (schema.Reader) goes as its digest."""
    reader = engine_id if launch is None else f"{engine_id}@{launch}"
    if len(reader) <= MAX_READER:
        return reader
    return "sha256:" + hashlib.sha256(reader.encode()).hexdigest()[:40]


class LeaseCalls:
    """Runs ``Renew`` actions: ``clients(url)`` gives a BootstrapClient, ``apply(event)`` feeds the table.
    ``reader``: this decode engine (reader_of).

    ``spawn`` runs one call (tests pass ``lambda f: f()`` to run it inline).
    """

    MAX_THREADS = 32  # groups renewed at once

    def __init__(self, clients: Callable[[str], Any], apply: Apply,
                 spawn: Callable[[Callable[[], None]], Any] | None = None, reader: str | None = None):
        self._clients, self._apply, self._reader = clients, apply, reader
        self._warned: set[str] = set()
        self._pool = self._checks = None
        if spawn is None:
            self._pool = ThreadPoolExecutor(self.MAX_THREADS, thread_name_prefix="kvlink-lease")
            spawn = self._pool.submit
            # record checks run beside their group's renew call (one round trip, not two), on threads of their
            # own: a renew call waits for its check, so the two must never share a pool
            self._checks = ThreadPoolExecutor(8, thread_name_prefix="kvlink-lease-check")
        self._spawn = spawn

    def run(self, a: Renew) -> None:
        try:
            self._spawn(lambda: self._call(a))
        except RuntimeError:  # pool shut down: stopping
            pass

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._checks.shutdown(wait=False, cancel_futures=True)

    def _call(self, a: Renew) -> None:
        try:
            self._renew(a)
        except Exception:  # noqa: BLE001 - the group must not stay "in flight" for good: retry it
            logger.exception("kvlink: lease renewal at %s failed", a.group[0])
            self._apply(lambda t, now: t.renew_failed(a.group, a.rids, now))

    def _check_records(self, a: Renew) -> dict[str, str]:
        """Our id -> why, for the pulls in ``a.verify`` whose params the record prefill published for their
        request does not back (``RecordCheck``), or whose record is gone. Raises what the lookup raises (the
        group is then retried: nothing is trusted meanwhile)."""
        from kvlink.bootstrap.schema import RequestRecord

        url, engine_id = a.group
        prefill_id = dict(zip(a.rids, a.request_ids))
        answer = self._clients(url).lookup(engine_id, [prefill_id[rid] for rid, _ in a.verify])
        wrong = {}
        for rid, check in a.verify:
            rec = answer.get(prefill_id[rid])
            if not isinstance(rec, RequestRecord):
                wrong[rid] = (f"prefill request {engine_id}/{prefill_id[rid]} is "
                              f"{getattr(rec, 'value', rec)}; its blocks may be reused")
            elif (why := check.wrong(rec, f"{engine_id}/{prefill_id[rid]}")) is not None:
                wrong[rid] = why
        return wrong

    def _renew(self, a: Renew) -> None:
        url, engine_id = a.group
        sent = time.monotonic()
        checking = None
        if a.verify and self._checks is not None:
            try:
                checking = self._checks.submit(self._check_records, a)
            except RuntimeError:  # shut down: stopping
                return
        try:
            failed, granted = self._clients(url).renew(engine_id, list(a.request_ids), a.lease_s, reader=self._reader)
        except Exception as e:  # noqa: BLE001 - try again soon; the pull's own deadline bounds it
            if url not in self._warned:
                self._warned.add(url)
                logger.warning("kvlink: cannot renew leases at %s: %s (retrying)", url, e)
            self._apply(lambda t, now: t.renew_failed(a.group, a.rids, now))
            return
        try:
            wrong = checking.result() if checking is not None else self._check_records(a) if a.verify else {}
        except Exception as e:  # noqa: BLE001 - nothing unchecked is trusted: the group is asked again soon
            logger.warning("kvlink: cannot look up records at %s: %s (retrying)", url, e)
            self._apply(lambda t, now: t.renew_failed(a.group, a.rids, now))
            return
        self._warned.discard(url)
        held = []
        for rid, request_id in zip(a.rids, a.request_ids):
            status = failed.get(request_id)
            if status is None and rid not in wrong:
                held.append(rid)
                continue
            why = wrong.get(rid) or (f"prefill lease of {engine_id}/{request_id} is "
                                     f"{getattr(status, 'value', status)}; its blocks may be reused")
            self._apply(lambda t, now, rid=rid, why=why: t.lease_lost(a.group, rid, why, now))
        # trusted for what the server granted (prefill's published lease where it is shorter than ours)
        self._apply(lambda t, now: t.lease_held(a.group, tuple(held), sent + granted, now))
