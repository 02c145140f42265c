"""Decode uses prefill's KV only for the prompt tokens prefill computed (params.prompt_digest), through real
vLLM engines in one process. A router that sends decode another prompt than prefill (or two servers that
tokenize the same text otherwise: another chat template, another tokenizer revision) would otherwise hand
decode the KV of other tokens, and it would answer fluently and wrong. Both ways prefill's digest reaches
decode are covered: in sequential pairing's kv_transfer_params (the scheduler compares), and in the record
decode looks up by transfer id (the worker compares)."""

from __future__ import annotations

import os
import time

import pytest

from tests.vllm.helpers import (BLOCK, Engines, decode, greedy, held_requests, prefill, recording_kv_config,
                                token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


@pytest.fixture(scope="module")
def engines(tiny_model):
    e = Engines(tiny_model)
    e.make("base", None)
    e.make("pre", recording_kv_config("kv_producer"))
    e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"))
    yield e
    e.close()


def want(engines, prompts):
    return [list(o.outputs[0].token_ids) for o in engines.generate("base", prompts, greedy())]


def two_prompts(seed: int) -> tuple[list[int], list[int]]:
    """Two prompts of one length that differ in one token in the middle: what a tokenizer that splits one
    word otherwise would give."""
    a = token_prompts([BLOCK * 5 + 3], seed=seed)[0]
    b = list(a)
    b[len(b) // 2] = 4 if a[len(a) // 2] != 4 else 5
    return a, b


def released(engines) -> bool:
    """Prefill frees what it held once decode reports it (its engine must step to hear it)."""
    deadline = time.monotonic() + 20
    while held_requests(engines.scheduler_side("pre")) and time.monotonic() < deadline:
        engines.generate("pre", token_prompts([4], seed=99), greedy(1))
        time.sleep(0.05)
    return held_requests(engines.scheduler_side("pre")) == {}


def by_transfer_id(engines, prompt: list[int], transfer_id: str) -> dict:
    """Prefill computes ``prompt`` under ``transfer_id``; decode's params name only the transfer id (as in
    concurrent pairing), so decode learns blocks and digest from the published record."""
    out = engines.generate("pre", [prompt], greedy(1, {"do_remote_decode": True, "transfer_id": transfer_id}))
    kp = out[0].kv_transfer_params
    assert kp["remote_prompt_sha"]
    return {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_bootstrap_addr": kp["remote_bootstrap_addr"],
            "remote_engine_id": kp["remote_engine_id"]}


def test_prefill_answers_with_the_digest_of_the_prompt_it_computed(engines):
    from kvlink.vllm.params import prompt_digest

    a, b = two_prompts(seed=61)
    [kp] = prefill(engines, [a])
    assert kp["remote_prompt_sha"] == prompt_digest(a) != prompt_digest(b)
    assert decode(engines, "dec", [a], [kp]) == want(engines, [a])  # the same prompt: pulled as always
    assert released(engines)


def test_decode_given_another_prompts_params_computes_its_own(engines):
    a, b = two_prompts(seed=62)
    [kp] = prefill(engines, [a])
    sched_before = engines.scheduler_connector("dec").recorded_now()
    before = engines.agents["dec"].recorded_now()
    assert decode(engines, "dec", [b], [kp]) == want(engines, [b])
    assert engines.scheduler_connector("dec").recorded_now()["prompt_mismatch"] > sched_before["prompt_mismatch"]
    assert engines.agents["dec"].recorded_now()["pulls_ok"] == before["pulls_ok"]  # nothing pulled
    assert released(engines)  # prefill told at once, not left to its lease


def refused_by_transfer_id(engines, computed: list[int], asked: list[int], transfer_id: str) -> dict:
    """Prefill computes ``computed`` under ``transfer_id``, decode is asked ``asked`` with it: decode answers
    as a single engine, refuses prefill's KV (one prompt_mismatch, nothing pulled), and prefill is told.
    Returns decode's counters after."""
    params = by_transfer_id(engines, computed, transfer_id)
    before = engines.agents["dec"].recorded_now()
    assert decode(engines, "dec", [asked], [params]) == want(engines, [asked])
    after = engines.agents["dec"].recorded_now()
    assert after["prompt_mismatch"] - before["prompt_mismatch"] == 1
    assert after["pulls_ok"] == before["pulls_ok"]
    assert released(engines)
    return after


def test_decode_looking_another_prompt_up_by_transfer_id_does_not_use_its_kv(engines):
    a, b = two_prompts(seed=63)
    after = refused_by_transfer_id(engines, a, b, "digest-t1")
    # the same prompt by transfer id: the record's digest agrees, and the KV is pulled
    params = by_transfer_id(engines, a, "digest-t2")
    assert decode(engines, "dec", [a], [params]) == want(engines, [a])
    assert engines.agents["dec"].recorded_now()["pulls_ok"] == after["pulls_ok"] + 1


def test_decode_with_a_shorter_other_prompt_by_transfer_id_does_not_use_its_kv(engines):
    """Prefill's record covers its whole prompt; decode's prompt is another one, a few tokens shorter but
    needing no more blocks than prefill published (so block pairing alone would accept it). Digests cover
    as many tokens only on the same count: a prompt of another length is another prompt."""
    a, b = two_prompts(seed=64)
    refused_by_transfer_id(engines, a, b[:-5], "digest-t3")  # 5 blocks + 3 tokens -> 4 blocks + 30 tokens:
    # still within prefill's blocks


def test_a_digest_added_to_concurrent_params_does_not_stand_in_for_the_records(engines):
    """Concurrent params name only the transfer id; a client that adds its own prompt's digest and count
    passes the scheduler's comparison, and must not turn off the worker's against the record."""
    from kvlink.vllm.params import prompt_digest

    a, b = two_prompts(seed=67)
    params = by_transfer_id(engines, a, "digest-t4")
    forged = dict(params, remote_prompt_sha=prompt_digest(b), remote_num_tokens=len(b))
    before = engines.agents["dec"].recorded_now()
    assert decode(engines, "dec", [b], [forged]) == want(engines, [b])
    after = engines.agents["dec"].recorded_now()
    assert after["prompt_mismatch"] - before["prompt_mismatch"] == 1 and after["pulls_ok"] == before["pulls_ok"]
    assert released(engines)


@pytest.mark.parametrize("dropped", [("remote_prompt_sha",), ("remote_prompt_sha", "remote_num_tokens")])
def test_sequential_params_stripped_of_their_digest_are_checked_against_the_record(engines, monkeypatch, dropped):
    """Sequential params come from decode's client (or a router that drops fields): without the digest the
    scheduler has nothing to compare, so the record prefill published is the authority. Decode asked another
    prompt of as many tokens with prompt A's stripped params answers its own prompt and pulls nothing usable.
    Control: with the record check blind to prompts, decode trusts A's KV for prompt B and answers otherwise."""
    from kvlink.vllm import lease

    a = token_prompts([BLOCK * 5 + 3], seed=65)[0]
    b = token_prompts([BLOCK * 5 + 3], seed=66)[0]
    [kp] = prefill(engines, [a])
    stripped = {k: v for k, v in kp.items() if k not in dropped}
    before = engines.agents["dec"].recorded_now()
    assert decode(engines, "dec", [b], [stripped]) == want(engines, [b])
    assert engines.agents["dec"].recorded_now()["pulls_ok"] == before["pulls_ok"]
    assert released(engines)
    [kp] = prefill(engines, [a])  # the control
    check = lease.RecordCheck.wrong
    monkeypatch.setattr(lease.RecordCheck, "wrong", lambda self, rec, where: check(
        lease.RecordCheck(self.blocks, (), self.num_tokens, self.launch), rec, where))
    got = decode(engines, "dec", [b], [{k: v for k, v in kp.items() if k not in dropped}])
    assert engines.agents["dec"].recorded_now()["pulls_ok"] == before["pulls_ok"] + 1
    assert got != want(engines, [b])
    assert released(engines)


class _Answers:
    """A bootstrap client answering decode's long polls from a list (partial records, then the record)."""

    def __init__(self, answers):
        self.answers = list(answers)

    def lookup_transfer(self, *args, **kwargs):
        return self.answers.pop(0)


@pytest.mark.parametrize("decode_tokens,read", [(64, True), (40, False), (60, False)])
def test_a_streamed_pull_reads_nothing_of_a_prompt_of_another_length(decode_tokens, read):
    """Decode's worker, driven without sockets: prefill streams a 64-token prompt (a piece of its first two
    blocks, then the record). Decode's prompt of 40 or 60 other tokens needs no more blocks than prefill has,
    so only the prompt digest can tell: nothing may be read, at the first piece. 64: decode's own prompt,
    whose piece is read (the control)."""
    from types import SimpleNamespace

    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import prompt_digest
    from kvlink.vllm.scheduler import KVLinkScheduler
    from kvlink.vllm.worker import KVLinkWorker, RankInfo
    from tests.vllm.test_scheduler import _blocks, _decode_request

    sched = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    try:
        params = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1", "transfer_id": "tx"}
        req = _decode_request("d1", decode_tokens, params)  # token ids 10, 11, ...
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, _blocks(list(range(1, -(-decode_tokens // 16) + 1))), n)
        (spec,) = sched._new_pulls
    finally:
        sched.shutdown()
    sha = prompt_digest(range(10, 74))  # prefill's prompt: 64 tokens, the first 40/60 of them decode's own
    common = dict(prompt_sha=sha, prompt_tokens=64, engine_id="pre", request_id="p1", epoch=0, layers=0,
                  launch=None)
    piece = SimpleNamespace(partial=True, block_ids=[[11, 12]], step_block_ids=[], version=1, **common)
    record = SimpleNamespace(partial=False, block_ids=[[11, 12, 13, 14]], num_tokens=64, lease_remaining_s=30.0,
                             version=2, **common)
    w = KVLinkWorker(ConnectorConfig(), RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        w._layer_ids, w._layer_rank = None, {}
        w._clients_for = lambda url: _Answers([piece, record])
        prefill = type("Remote", (), {"looked_up": 0.0})()  # connected before anything was asked
        w._remote = lambda cli, url, engine_id, launch=None: prefill
        carried = []
        w._carry_out = carried.extend
        w._table.submit(spec, 0.0)
        w._resolve(spec)
        posts = [a for a in carried if type(a).__name__ == "Post"]
        assert bool(posts) == read, posts
        assert w._stats.data.get("prompt_mismatch", 0) == (0 if read else 1)
        if not read:
            assert "d1" in w._table.take_results(time.monotonic()).failed
    finally:
        w.shutdown()
