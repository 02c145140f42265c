"""Layer-wise streamed KV through real vLLM servers: a prompt that fits in one chunked-prefill step (the
common case on GPUs, whose token budget is 2k-16k) still streams: as each attention layer's KV is written
(on vLLM CPU, on entry to the layer's attention op) prefill announces that the step's blocks hold it, and
decode reads that layer's share while prefill computes on.

Prefill's connector here is tests.fakes_connector.SlowLayersConnector: each layer of a streaming step takes
150 ms longer on entry to its attention op and as long on exit, so decode reads during the forward every
time, not when this host's timing allows. Outputs must equal a single server's, and a decode whose
connector corrupts what it pulled must change them. The "step" granularity is run beside it (256-token
chunks): its one-chunk prompts stream nothing (its pieces come after a step), longer ones stream a piece
after each step but the last, with its own negative control.
Multi-chunk layer-wise streaming, aborts and faults: test_streamed.py, test_streamed_faults.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import trace_lines
from tests.vllm.helpers import (BLOCK, Server, assert_each_streamed, complete, concurrent_proxy, corrupting_kv_config,
                                free_port, kv_config, metric, text, token_prompts)

ONE_CHUNK = ("--max-num-batched-tokens", "2048", "--max-num-seqs", "16")
STEP_CHUNK = 256  # the "step" prefill's chunk: longer prompts take several steps, each streamed after it


@pytest.fixture(scope="module")
def lw(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("layers")
    bport, sport = free_port(), free_port()
    traced = {"KVLINK_TRACE": str(logs / "trace.jsonl")}  # prefill's and decode's timeline, one file
    slow = dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=20.0, stream_kv=True),
                engine_id="prefill-l", kv_connector="SlowLayersConnector",
                kv_connector_module_path="tests.fakes_connector")
    pre = Server(tiny_model, slow, cpu=0, log=logs / "prefill-layer.log", extra_args=ONE_CHUNK, env=traced)
    xport = free_port()  # a prefill that announces every layer when its attention op returns
    on_exit = dict(kv_config("kv_producer", bootstrap_port=xport, lease_s=20.0, stream_kv=True,
                             stream_layer_on_entry=False), engine_id="prefill-x", kv_connector="SlowLayersConnector",
                   kv_connector_module_path="tests.fakes_connector")
    exit_ = Server(tiny_model, on_exit, cpu=0, log=logs / "prefill-exit.log", extra_args=ONE_CHUNK,
                   env={"KVLINK_TRACE": str(logs / "trace-exit.jsonl")})
    step = Server(tiny_model, dict(kv_config("kv_producer", bootstrap_port=sport, lease_s=20.0, stream_kv=True,
                                             stream_granularity="step"), engine_id="prefill-step"),
                  cpu=0, log=logs / "prefill-step.log",
                  extra_args=("--max-num-batched-tokens", str(STEP_CHUNK), "--max-num-seqs", "16"))
    dec = Server(tiny_model, dict(kv_config("kv_consumer", lookup_wait_s=20.0, pull_timeout_s=60.0),
                                  kv_load_failure_policy="recompute"), cpu=1, log=logs / "decode.log", env=traced)
    bad = Server(tiny_model, corrupting_kv_config(lookup_wait_s=20.0), cpu=1, log=logs / "corrupt.log")
    proxies = []
    try:
        for s in (pre, exit_, step, dec, bad):
            s.wait_ready()
        def proxy(prefill, port, engine_id, decode):
            proxies.append(concurrent_proxy(prefill.url, decode.url, port, engine_id))
            return proxies[-1].url

        yield {"pre": pre, "step": step, "dec": dec, "bad": bad, "trace": logs / "trace.jsonl", "layer": proxy(pre, bport, "prefill-l", dec),
               "layer_bad": proxy(pre, bport, "prefill-l", bad), "by_step": proxy(step, sport, "prefill-step", dec),
               "by_step_bad": proxy(step, sport, "prefill-step", bad),
               "exit": exit_, "on_exit": proxy(exit_, xport, "prefill-x", dec), "trace_exit": logs / "trace-exit.jsonl"}
    finally:
        for p in proxies:
            p.stop()
        for s in (pre, exit_, step, dec, bad):
            s.stop()


def test_one_chunk_prompts_stream_layer_by_layer_and_equal_a_single_server(lw):
    """Every prompt is read in part while prefill's one forward still runs. Decode's steps wait for the
    pulls between layers, and the worker (a child process of vLLM's EngineCore) nudges its scheduler out
    of that wait when a pull ends."""
    sizes = [7, 31, 100, 700, 1500]
    prompts = token_prompts(sizes, seed=60)
    want = [text(complete(lw["bad"].url, p)) for p in prompts]
    nudged0 = metric(lw["dec"], "kvlink_pull_waits_nudged_total")
    assert_each_streamed(lw["layer"], lw["pre"], lw["dec"], sizes, prompts, want)
    assert metric(lw["dec"], "kvlink_pull_waits_nudged_total") > nudged0


def test_the_prompts_partial_last_block_is_read_with_the_layers_while_prefill_computes(lw):
    """The one chunk completes the prompt, so its last, partial block is final as each layer writes it:
    decode's first READ, posted while prefill still computes, covers every block decode loads (all but the
    last token), the partial one too, in each of the layers it reads; for a prompt shorter than one block,
    that block."""
    sizes = [7, 100, 700]  # decode loads 6, 99 and 699 tokens: 1, 4 and 22 blocks, the last one partial
    prompts = token_prompts(sizes, seed=64)
    want = [text(complete(lw["bad"].url, p)) for p in prompts]
    for n, prompt, expected in zip(sizes, prompts, want):
        start = len(trace_lines(lw["trace"]))
        assert_each_streamed(lw["layer"], lw["pre"], lw["dec"], [n], [prompt], [expected])
        evs = trace_lines(lw["trace"])[start:]
        (pub,) = [e for e in evs if e["ev"] == "publish"]
        reads = [e for e in evs if e["ev"] == "read_post"]
        blocks = -(-(n - 1) // BLOCK)
        assert reads and reads[0]["t"] < pub["t"], f"{n} tokens: decode read nothing while prefill computed"
        assert reads[0]["blocks"] % blocks == 0, f"{n} tokens: the first READ is not of all {blocks} blocks: {reads[0]}"


def test_a_layer_is_read_on_entry_to_its_attention_op_before_the_attention_runs(lw):
    """vLLM CPU writes a layer's new KV in an op of its own just before the layer's attention op, so prefill
    announces each layer on entry to that op: decode reads it while prefill is held there (SlowLayersConnector
    sleeps on entry, before the attention computes), and the output still equals a single server's."""
    from tests.fakes_connector import SlowLayersConnector

    sizes = [300, 900]
    prompts = token_prompts(sizes, seed=65)
    want = [text(complete(lw["bad"].url, p)) for p in prompts]
    start = len(trace_lines(lw["trace"]))
    assert_each_streamed(lw["layer"], lw["pre"], lw["dec"], sizes, prompts, want)
    evs = trace_lines(lw["trace"])[start:]
    layers = [e for e in evs if e["ev"] == "layer"]
    assert layers and all(e["on_entry"] for e in layers), layers
    # A READ posted after decode heard "layers below k" covers layer k - 1; it proves the point when it ended
    # before that layer's attention ran: inside the entry sleep that followed the layer's announcement.
    entered: dict[int, float] = {}  # layer index -> its latest announcement (one prompt at a time)
    heard, covers, early = 0, {}, []
    for e in evs:
        if e["ev"] == "layer":
            entered[int(e["layer"].split(".")[2])] = e["t"]
        elif e["ev"] == "answer" and e["partial"]:
            heard = e["layers"]
        elif e["ev"] == "read_post" and heard:
            covers[e["batch"]] = entered.get(heard - 1)
        elif e["ev"] == "read_end" and covers.get(e["batch"]) is not None:
            early.append(e["t"] < covers[e["batch"]] + SlowLayersConnector.SLOW_LAYER_S)
    assert any(early), f"no READ of a layer ended before that layer's attention ran: {early}"


def test_with_stream_layer_on_entry_off_layers_are_announced_on_exit_and_equal_a_single_server(lw):
    sizes = [7, 700]
    prompts = token_prompts(sizes, seed=66)
    want = [text(complete(lw["bad"].url, p)) for p in prompts]
    assert_each_streamed(lw["on_exit"], lw["exit"], lw["dec"], sizes, prompts, want)
    layers = [e for e in trace_lines(lw["trace_exit"]) if e["ev"] == "layer"]
    assert layers and not any(e["on_entry"] for e in layers), layers


def test_the_timeline_shows_decode_reading_while_prefill_computes(lw):
    """KVLINK_TRACE through the real servers: for one prompt, prefill's layers and pieces, decode's long
    poll answers and READs come before prefill publishes; the record comes after every piece, and the
    pull is handed to vLLM after it. The events of both processes, on one clock, in one file."""
    prompt = token_prompts([700], seed=63)[0]
    want = text(complete(lw["bad"].url, prompt))
    start = trace_lines(lw["trace"])
    assert_each_streamed(lw["layer"], lw["pre"], lw["dec"], [700], [prompt], [want])
    evs = trace_lines(lw["trace"])[len(start):]
    (pub,) = [e for e in evs if e["ev"] == "publish"]
    tid = pub["transfer_id"]
    answers = [e for e in evs if e["ev"] == "answer" and e["transfer_id"] == tid]
    rid = answers[0]["rid"]
    assert {e["pid"] for e in evs if e["ev"] in ("layer", "piece_send")} != {e["pid"] for e in answers}
    early = [e["ev"] for e in evs if e["t"] < pub["t"]]
    assert early.count("layer") >= 1 and "piece_send" in early, early
    assert [a for a in answers if a["partial"] and a["t"] < pub["t"]], "no piece reached decode before publish"
    reads = [e for e in evs if e["ev"] == "read_post" and rid in e["rids"]]
    assert reads and reads[0]["t"] < pub["t"], "decode read nothing while prefill computed"
    (done,) = [e for e in evs if e["ev"] == "pull_done" and e["rid"] == rid]
    (record,) = [a for a in answers if not a["partial"]]  # (logged by prefill after its publish call returned)
    assert max(a["t"] for a in answers if a["partial"]) <= record["t"] <= done["t"] and not done["failed"]
    # Prefill's engine: the request arrives, computes its layers, finishes, then the record is published.
    (new,) = [e for e in evs if e["ev"] == "engine_new" and e["rid"] == pub["rid"]]
    (fin,) = [e for e in evs if e["ev"] == "finished" and e["rid"] == pub["rid"]]
    layers = [e["t"] for e in evs if e["ev"] == "layer"]
    assert new["t"] < min(layers) and max(layers) < fin["t"] <= pub["t"]
    # Decode's engine: vLLM collects the pull after it is done, and a later step schedules the request.
    (coll,) = [e for e in evs if e["ev"] == "recv_collected" and rid in e["rids"]]
    assert done["t"] <= coll["t"] and coll["pid"] != done["pid"]  # the EngineCore, not the worker
    assert [e for e in evs if e["ev"] == "step" and e["pid"] == coll["pid"] and e["tokens"] and e["t"] > coll["t"]]


def test_negative_control_corrupted_layer_wise_stream_changes_the_output(lw):
    prompts = token_prompts([300, 900], seed=61)
    want = [text(complete(lw["dec"].url, p)) for p in prompts]
    got = [text(complete(lw["layer_bad"], p, timeout=120)) for p in prompts]
    assert got[0] != want[0] and got[1] != want[1]


def test_by_step_a_one_chunk_prompt_streams_nothing_and_equals_a_single_server(lw):
    prompts = token_prompts([31, STEP_CHUNK - 6], seed=62)
    want = [text(complete(lw["bad"].url, p)) for p in prompts]
    sent0 = metric(lw["step"], "kvlink_pieces_sent_total")
    assert [text(complete(lw["by_step"], p, timeout=120)) for p in prompts] == want
    assert metric(lw["step"], "kvlink_pieces_sent_total") == sent0  # no step before the one that publishes


def test_by_step_prompts_of_several_chunks_stream_and_equal_a_single_server(lw):
    """stream_granularity "step": each chunked-prefill step but the last announces the blocks it completed,
    decode reads them while prefill computes the next chunks, and the answers are the single server's."""
    prompts = token_prompts([700, 1500], seed=63)
    want = [text(complete(lw["bad"].url, p)) for p in prompts]
    sent0, streamed0 = metric(lw["step"], "kvlink_pieces_sent_total"), metric(lw["dec"], "kvlink_blocks_streamed_total")
    assert [text(complete(lw["by_step"], p, timeout=120)) for p in prompts] == want
    assert metric(lw["step"], "kvlink_pieces_sent_total") > sent0
    assert metric(lw["dec"], "kvlink_blocks_streamed_total") > streamed0


def test_negative_control_corrupted_step_wise_stream_changes_the_output(lw):
    prompts = token_prompts([700, 1500], seed=64)
    want = [text(complete(lw["dec"].url, p)) for p in prompts]
    got = [text(complete(lw["by_step_bad"], p, timeout=120)) for p in prompts]
    assert got[0] != want[0] and got[1] != want[1]
