"""kvlink as one child of vLLM's MultiConnector, next to another real vLLM connector (ExampleConnector, the
one that runs on CPU), through real servers and kvlink's proxy: how operators combine PD with a KV store
or offloader (users of other connectors report such combinations failing, vllm#20609).

MultiConnector hands each child its own metadata, its own worker-to-scheduler report (lock-step's) and the
shared connector output, asks the children in order for cache hits and lets the first with a hit load.
Prefill has kvlink first and ExampleConnector (saving every request to disk) second; decode has
ExampleConnector first (an empty store: it never has a hit) and kvlink second, so kvlink runs at either
index. Decode runs lock-step (``stream_lockstep``), the path that uses the most of the connector API:
streamed pieces, the per-layer waits, the worker report and the arm report taken out of the output.

Outputs must equal a single server's, streamed and sequential; a decode whose kvlink child overwrites
each landed layer with noise changes them; lock-step engaged; nothing stays held on either side.
"""

from __future__ import annotations

import pytest

from tests.vllm.helpers import (Server, assert_each_streamed, complete, free_port, kv_config, metric, proxied, text,
                                token_prompts, wait_for)

CHUNKS = ("--max-num-batched-tokens", "512", "--max-num-seqs", "16")
LOCKSTEP = dict(stream_lockstep=True, stream_lockstep_stall_ms=10_000, lookup_wait_s=20.0, pull_timeout_s=60.0)


def example(role: str, store) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}


def multi(role: str, children: list[dict], **top) -> dict:
    return dict({"kv_connector": "MultiConnector", "kv_role": role,
                 "kv_connector_extra_config": {"connectors": children}}, **top)


def fake(kv: dict, connector: str) -> dict:
    return dict(kv, kv_connector=connector, kv_connector_module_path="tests.fakes_connector")


@pytest.fixture(scope="module")
def mc(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("multi")
    bport, engine_id = free_port(), "prefill-multi"
    producer = fake(kv_config("kv_producer", bootstrap_port=bport, lease_s=20.0, stream_kv=True),
                    "SlowLayersConnector")
    pre = Server(tiny_model, multi("kv_producer", [producer, example("kv_producer", logs / "store-pre")],
                                   engine_id=engine_id), cpu=0, log=logs / "prefill.log", extra_args=CHUNKS)
    consumer = kv_config("kv_consumer", **LOCKSTEP)
    dec = Server(tiny_model, multi("kv_consumer", [example("kv_consumer", logs / "store-dec"), consumer],
                                   kv_load_failure_policy="fail"), cpu=1, log=logs / "decode.log")
    bad = Server(tiny_model, multi("kv_consumer", [example("kv_consumer", logs / "store-bad"),
                                                   fake(consumer, "LockstepCorruptingConnector")],
                                   kv_load_failure_policy="fail"), cpu=1, log=logs / "corrupt.log")
    plain = Server(tiny_model, None, cpu=1, log=logs / "plain.log")
    with proxied(pre, (dec, bad, plain), ((dec, "concurrent"), (bad, "concurrent"), (dec, "sequential")), bport,
                 engine_id) as (pd, pd_bad, seq):
        yield {"pre": pre, "dec": dec, "plain": plain, "pd": pd, "pd_bad": pd_bad, "seq": seq}


def test_streamed_lockstep_inside_multiconnector_equals_a_single_server(mc):
    sizes = [7, 100, 700]
    prompts = token_prompts(sizes, seed=120)
    want = [text(complete(mc["plain"].url, p)) for p in prompts]
    armed0 = metric(mc["dec"], "kvlink_lockstep_armed_total")
    assert_each_streamed(mc["pd"], mc["pre"], mc["dec"], sizes, prompts, want)
    assert metric(mc["dec"], "kvlink_lockstep_armed_total") - armed0 == len(sizes), "lock-step did not engage"
    assert metric(mc["dec"], "kvlink_lockstep_failed_total") == 0


def test_sequential_inside_multiconnector_equals_a_single_server(mc):
    prompts = token_prompts([40, 300], seed=121)
    want = [text(complete(mc["plain"].url, p)) for p in prompts]
    ok0 = metric(mc["dec"], "kvlink_pulls_ok_total")
    assert [text(complete(mc["seq"], p, timeout=120)) for p in prompts] == want
    assert metric(mc["dec"], "kvlink_pulls_ok_total") - ok0 == len(prompts), "decode computed instead of pulling"


def test_negative_control_noise_over_the_landed_kv_changes_the_output(mc):
    prompts = token_prompts([300, 900], seed=122)
    want = [text(complete(mc["plain"].url, p)) for p in prompts]
    got = [text(complete(mc["pd_bad"], p, timeout=120)) for p in prompts]
    assert got[0] != want[0] and got[1] != want[1]


def test_nothing_stays_held_on_either_side(mc):
    assert mc["pre"].metric("kvlink_held_requests") is not None, "kvlink's metrics are not exported"
    assert wait_for(lambda: metric(mc["dec"], "kvlink_pulls_in_progress") == 0)
    assert wait_for(lambda: metric(mc["pre"], "kvlink_held_requests") == 0), "prefill still holds blocks"
    assert wait_for(lambda: (mc["dec"].metric("vllm:kv_cache_usage_perc") or 0.0) == 0.0), "decode holds blocks"
