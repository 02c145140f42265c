"""Host staging forced on CPU (``staging: always``) through real vLLM engines in one process: prefill copies
each finished request into its staging pool and gives vLLM its blocks back at once; decode reads into its
landing pool and copies into its blocks. Outputs must equal a single engine's.

In one process an engine steps only inside ``generate``: ``step`` runs tiny requests on an engine until a
condition holds (a server's engine loop does this by itself: test_staging_servers.py).
"""

from __future__ import annotations

import os
import time

import pytest

from tests.vllm.helpers import (BLOCK, Engines, corrupting_kv_config, decode, greedy, held_requests, prefill,
                                recording_kv_config, token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

POOL_MB = 1  # the tiny model: 32 KiB per block of both layers -> 31 slots
STAGED = dict(staging="always", staging_pool_mb=POOL_MB)


@pytest.fixture(scope="module")
def engines(tiny_model):
    e = Engines(tiny_model)
    e.make("base", None)
    e.make("pre", recording_kv_config("kv_producer", **STAGED))
    e.make("dec", dict(recording_kv_config("kv_consumer", **STAGED), kv_load_failure_policy="recompute"))
    e.make("dec_bad", corrupting_kv_config(**STAGED))
    e.make("pre_short", recording_kv_config("kv_producer", lease_s=2.0, **STAGED))
    yield e
    e.close()


def step(engines: Engines, name: str, cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{name}: condition not met within {timeout} s"
        engines.generate(name, token_prompts([4], seed=99), greedy(1))
        time.sleep(0.02)


def planner(engines, name):
    return engines.scheduler_side(name)._planner


def staged_all(engines, name):
    """Every finished request copied into the pool and published (none queued or being copied)."""
    pl = planner(engines, name)
    return lambda: not pl.busy()


def vllm_free_blocks(engines, name) -> int:
    return engines.llms[name].llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool \
        .get_num_free_blocks()


def want(engines, prompts, n=12):
    return [list(o.outputs[0].token_ids) for o in engines.generate("base", prompts, greedy(n))]


def test_staged_decode_equals_baseline_and_frees_prefill_blocks_before_the_pull(engines):
    prompts = token_prompts([BLOCK // 3, BLOCK * 2, BLOCK * 6 + 7], seed=21)
    free_before = vllm_free_blocks(engines, "pre")
    params = prefill(engines, prompts)
    assert all("remote_block_ids" not in kp and kp["transfer_id"] for kp in params)  # slots come by lookup
    step(engines, "pre", staged_all(engines, "pre"))
    # Decode has pulled nothing yet: prefill holds the three requests, but in its pool, not in vLLM's blocks.
    assert len(held_requests(engines.scheduler_side("pre"))) == 3
    assert vllm_free_blocks(engines, "pre") == free_before
    rec = engines.scheduler_connector("pre").recorded_now()
    assert rec["held_blocks"] == 0 and rec["staging_used_blocks"] == 1 + 2 + 7 and rec["staged"] == 3
    assert engines.agents["pre"].recorded_now()["bytes_staged"] == 10 * 32 * 1024
    got = decode(engines, "dec", prompts, params)
    assert got == want(engines, prompts)
    drec = engines.agents["dec"].recorded_now()
    assert drec["pulls_ok"] == 3 and drec["bytes_landed"] == 10 * 32 * 1024
    # Decode's reports free the slots without prefill stepping (the release watcher does it).
    deadline = time.monotonic() + 10
    while planner(engines, "pre").pool.in_use and time.monotonic() < deadline:
        time.sleep(0.05)
    assert planner(engines, "pre").pool.in_use == 0 and held_requests(engines.scheduler_side("pre")) == {}


def test_corrupted_landing_changes_output(engines):
    """Negative control on decode: noise over the blocks the landing copy filled changes the output."""
    prompts = token_prompts([BLOCK * 4], seed=22)
    params = prefill(engines, prompts)
    step(engines, "pre", staged_all(engines, "pre"))
    assert decode(engines, "dec_bad", prompts, params) != want(engines, prompts)


def test_corrupted_staged_copy_changes_output(engines):
    """Negative control on prefill: decode reads the staged copy, not prefill's blocks. Noise over the pool
    after staging changes decode's output; prefill's own blocks were untouched."""
    prompts = token_prompts([BLOCK * 4 + 3], seed=23)
    params = prefill(engines, prompts)
    step(engines, "pre", staged_all(engines, "pre"))
    pool = engines.agents["pre"]._worker._stager.pool
    saved = pool.clone()
    import torch

    pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
    try:
        assert decode(engines, "dec", prompts, params) != want(engines, prompts)
    finally:
        pool.copy_(saved)


def test_pool_full_requests_wait_first_come_and_all_decode_equal(engines):
    """6 requests of 7 blocks, a pool of 31: four are staged, the fifth finds the pool full (counted) and
    keeps its vLLM blocks, the sixth waits behind it; once decode pulls the first four, the rest follow."""
    prompts = token_prompts([BLOCK * 6 + 7] * 6, seed=24)
    rec0 = engines.scheduler_connector("pre").recorded_now()
    params = prefill(engines, prompts)
    pl = planner(engines, "pre")
    step(engines, "pre", lambda: pl.pool.in_use == 28 and pl.device_blocks() == 14)  # four copied
    rec = engines.scheduler_connector("pre").recorded_now()
    assert rec["staging_pool_full"] - rec0.get("staging_pool_full", 0) == 1
    assert rec["held_blocks"] == 14 and rec["staging_used_blocks"] == 28  # two requests keep vLLM blocks
    expected = want(engines, prompts)
    assert decode(engines, "dec", prompts[:4], params[:4]) == expected[:4]
    step(engines, "pre", lambda: pl.pool.in_use == 14 and not pl.busy())
    assert decode(engines, "dec", prompts[4:], params[4:]) == expected[4:]
    assert engines.agents["dec"].recorded_now()["pulls_failed"] == 0


def test_request_larger_than_the_pool_is_refused_and_decode_computes_it(engines):
    prompts = token_prompts([BLOCK * 40], seed=25)  # 40 blocks > 31 slots
    (kp,) = prefill(engines, prompts)
    assert "31" in kp["kvlink_error"] and "staging_pool_mb" in kp["kvlink_error"]
    assert not planner(engines, "pre").busy() and held_requests(engines.scheduler_side("pre")) == {}
    assert decode(engines, "dec", prompts, [kp]) == want(engines, prompts)


def test_staged_copy_freed_at_lease_expiry_without_a_pull(engines):
    """A decode that never pulls: the staged copy's slots are freed when the lease (2 s) ends."""
    pl = planner(engines, "pre_short")
    prefill(engines, token_prompts([BLOCK * 3], seed=26), name="pre_short")
    step(engines, "pre_short", staged_all(engines, "pre_short"))
    assert pl.pool.in_use == 3
    deadline = time.monotonic() + 15
    while pl.pool.in_use and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pl.pool.in_use == 0
    assert engines.scheduler_connector("pre_short").recorded_now()["leases_expired"] >= 1


def test_request_waiting_a_whole_lease_for_room_is_given_up(engines):
    """Pool full for longer than the lease (2 s): the waiting request's vLLM blocks are freed, its transfer is
    abandoned, and decode, whose lookup then ends at once, computes it. (The pool is kept full by claiming
    its slots here, as staged requests that decode never pulls would.)"""
    side, pl = engines.scheduler_side("pre_short"), planner(engines, "pre_short")
    with side._held_lock:
        taken = pl.pool.allocate(pl.pool.capacity)
    assert taken is not None, "an earlier test left slots in use"
    try:
        free_before = vllm_free_blocks(engines, "pre_short")
        prompts = token_prompts([BLOCK * 6 + 7], seed=27)
        params = prefill(engines, prompts, name="pre_short")
        step(engines, "pre_short", lambda: not pl.busy(), timeout=30)
        assert vllm_free_blocks(engines, "pre_short") == free_before
        assert engines.scheduler_connector("pre_short").recorded_now()["staging_expired"] == 1
        t0 = time.monotonic()
        assert decode(engines, "dec", prompts, params) == want(engines, prompts)
        assert time.monotonic() - t0 < 20
    finally:
        with side._held_lock:
            pl.pool.free(taken)
