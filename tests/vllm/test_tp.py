"""Tensor parallelism. vLLM gives every TP rank its own connector worker with its own shard of the KV
heads and the same block ids. At equal TP rank i of decode must pull from rank i of prefill (never another
rank's shard); different TP sizes are tests/vllm/test_tp_mapping.py's.

- Real vLLM at TP=2: one server with ``kv_role="kv_both"`` hands requests to itself, so each of its two
  worker processes pulls its own shard through the real connector path (publish, bootstrap, transport
  over loopback, finished-receiving aggregated over both ranks by vLLM).
- Separate prefill and decode ranks: KVLinkWorkers of a TP=2 prefill and a TP=2 decode, each rank with
  its own real transport engine (TCP, C core), its own port and KV shard, paired through a real bootstrap
  server, in this process.

Why not two TP=2 servers: on the 2-core test machine their 4 workers' gloo threads (``gloo_tcp_loop``,
13 per worker, all runnable) starve every other process for up to 40 s (docs/NOTES-connector.md).
"""

from __future__ import annotations

import os
import time

import pytest

from tests.ports import free_port
from tests.vllm.helpers import pull_outcome, submit_pull, without_digest

torch = pytest.importorskip("torch")

BLOCKS, HEADS, BLOCK, HEAD2 = 8, 1, 32, 128  # one KV head per rank: the model's 2 heads split over TP=2
TP = 2


def _shard(rank: int, fill: float) -> dict:
    """Two layers of one rank's KV shard, every block distinct per (rank, layer, block)."""
    buf = torch.empty((2, BLOCKS, HEADS, BLOCK, HEAD2), dtype=torch.bfloat16)
    for layer in range(2):
        for b in range(BLOCKS):
            buf[layer, b] = fill + 100 * rank + 10 * layer + b
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(2)}


def _switched(kv: dict) -> dict:
    """``kv`` with the connector that corrupts every pulled block while its flag file exists (negative
    controls on the same server: tests/fakes_connector.py), decode recomputing what it cannot pull."""
    return dict(kv, kv_connector="SwitchedCorruptingConnector", kv_connector_module_path="tests.fakes_connector",
                kv_load_failure_policy="recompute")


def _corrupt_while(flag, check) -> None:
    flag.touch()
    try:
        check()
    finally:
        flag.unlink()


def _check_other(pre_url: str, dec_url: str, prompt: list[int], want: str, timeout: float = 60.0) -> None:
    """Prompt pulled from ``pre_url`` into ``dec_url`` (its KV corrupted there) answers other than ``want``."""
    from tests.vllm.helpers import complete, text

    params = complete(pre_url, prompt, {"do_remote_decode": True}, max_tokens=1, timeout=timeout)["kv_transfer_params"]
    assert text(complete(dec_url, prompt, params, timeout=timeout)) != want


def test_real_vllm_tp2_each_rank_pulls_its_own_shard(tiny_model, tmp_path):
    from tests.vllm.helpers import Server, complete, kv_config, text, token_prompts

    # engine_lease_s: gloo's busy-polling threads can starve the heartbeat thread for over 15 s on 2 cores
    # (docs/NOTES-connector.md item 13), and a lapsed registration expires every published request.
    kv = _switched(kv_config("kv_both", transport_backend="tcp", engine_lease_s=120.0))
    flag = tmp_path / "corrupt"
    srv = Server(tiny_model, kv, cpu="0|1", log=tmp_path / "tp2.log",
                 extra_args=["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                             "--no-enable-prefix-caching"],  # decode must pull, not hit its own cache
                 env={"KVLINK_TEST_CORRUPT_WHILE": str(flag)})
    try:
        srv.wait_ready()
        block_bytes = 2 * 1 * 32 * 64 * 2  # K and V x 1 KV head per rank x 32 tokens x head size 64 x bf16
        pulled = 0
        for n in (20, 64, 300):  # shorter than a block, exactly 2 blocks, several blocks
            prompt = token_prompts([n], seed=40 + n)[0]
            want = text(complete(srv.url, prompt))
            params = complete(srv.url, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
            assert text(complete(srv.url, prompt, params)) == want, n
            pulled += len(params["remote_block_ids"])
        # both ranks pulled their shard of every block: 2 layers x block_bytes per rank
        assert srv.metric("kvlink_pulls_failed_total") == 0.0
        assert srv.metric("kvlink_bytes_pulled_total") == pulled * 2 * block_bytes * 2
        # prompt A sent with prompt B's params (same length): prefill's digest of B tells decode the KV is not
        # A's, and decode computes A itself
        a, b = token_prompts([300, 300], seed=99)
        want = text(complete(srv.url, a))
        failed = srv.metric("kvlink_pulls_failed_total")
        mismatch = srv.metric("kvlink_prompt_mismatch_total") or 0.0
        params_b = complete(srv.url, b, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
        assert text(complete(srv.url, a, params_b)) == want
        assert srv.metric("kvlink_prompt_mismatch_total") == mismatch + 1
        # the same without the digest (a router that drops it): the record prefill published is checked too
        # (its digest is B's), so decode reads nothing of B's KV for A and computes A itself
        params_b = complete(srv.url, b, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
        assert text(complete(srv.url, a, without_digest(params_b))) == want
        assert srv.metric("kvlink_pulls_failed_total") == failed + 2  # (each TP rank's pull)
        # negative control: A's own KV, pulled and then corrupted in decode's blocks, gives another answer,
        # so decode's answer does come from the KV it pulls
        _corrupt_while(flag, lambda: _check_other(srv.url, srv.url, a, want))
        params_a = complete(srv.url, a, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
        assert text(complete(srv.url, a, params_a)) == want
        assert srv.metric("kvlink_pulls_failed_total") == failed + 2  # the others pulled, none recomputed
        deadline = time.monotonic() + 30
        while srv.metric("kvlink_held_blocks") != 0.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert srv.metric("kvlink_held_blocks") == 0.0  # every pulled request freed on the prefill side
    finally:
        srv.stop()



def test_real_vllm_tp2_streams_each_ranks_shard_while_it_computes(tiny_model, tmp_path):
    """Streamed KV at TP=2 on real vLLM: a kv_both server streaming to itself (concurrent pairing, 64-token
    chunks). A piece is readable once both ranks reported it; each decode rank reads its shard of the
    streamed blocks, then the tail, and the answer is the server's own. (The negative control of the TP=2
    read path is the test above: both move blocks through the same plans.)"""
    import concurrent.futures as cf
    import uuid

    from tests.vllm.helpers import Server, complete, concurrent_legs, free_port, kv_config, metric, text, token_prompts

    bport = free_port()
    kv = dict(kv_config("kv_both", transport_backend="tcp", engine_lease_s=120.0, bootstrap_port=bport,
                        stream_kv=True, lookup_wait_s=60.0, pull_timeout_s=120.0), engine_id="tp2-stream")
    srv = Server(tiny_model, kv, cpu="0|1", log=tmp_path / "tp2-stream.log",
                 extra_args=["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                             "--no-enable-prefix-caching", "--max-num-batched-tokens", "64"])
    try:
        srv.wait_ready()
        for n in (20, 300, 700):
            prompt = token_prompts([n], seed=60 + n)[0]
            want = text(complete(srv.url, prompt))
            pre, dec = concurrent_legs(f"http://127.0.0.1:{bport}", "tp2-stream", "t-" + uuid.uuid4().hex)
            with cf.ThreadPoolExecutor(2) as ex:
                first = ex.submit(complete, srv.url, prompt, pre, max_tokens=1, timeout=180)
                got = ex.submit(complete, srv.url, prompt, dec, timeout=180)
                first.result()
                assert text(got.result()) == want, n
        assert metric(srv, "kvlink_pieces_sent_total") > 0
        assert metric(srv, "kvlink_blocks_streamed_total") > 0
        assert metric(srv, "kvlink_pulls_failed_total") == 0
        # Both worker processes registered the launch the scheduler (another process) publishes under: the
        # bootstrap server took every publish and piece above, and fences those of a replaced launch.
        from kvlink.bootstrap import BootstrapClient

        with BootstrapClient(f"http://127.0.0.1:{bport}") as cli:
            regs = cli.engine_ranks("tp2-stream")
        assert len(regs) == 2 and regs[0].launch and regs[0].launch == regs[1].launch
        assert regs[0].instance != regs[1].instance  # each process its own
    finally:
        srv.stop()

@pytest.fixture
def tp2():
    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    port = free_port(2)
    pre_cfg = ConnectorConfig(transport_backend="tcp", transport_port=port)
    dec_cfg = ConnectorConfig(transport_backend="tcp", pull_timeout_s=30.0)
    workers = []
    try:
        pre = [KVLinkWorker(pre_cfg, RankInfo("pre", r, TP, 0, 1, "m"), "kv_producer") for r in range(TP)]
        workers += pre
        dec = [KVLinkWorker(dec_cfg, RankInfo("dec", r, TP, 0, 1, "m"), "kv_consumer") for r in range(TP)]
        workers += dec
        for r in range(TP):
            pre[r].register_kv_caches(_shard(r, 1.0))
            dec[r].register_kv_caches(_shard(r, -1000.0))
            pre[r]._ensure_registered(srv.url)
        with BootstrapClient(srv.url) as cli:
            yield pre, dec, srv.url, cli, port
    finally:
        for w in workers:
            w.shutdown()
        srv.stop()


def test_rank_i_pulls_rank_i_shard_over_its_own_port(tp2):
    pre, dec, url, cli, port = tp2
    regs = sorted(cli.engine_ranks("pre"), key=lambda r: r.tp_rank)
    assert [(r.tp_rank, r.tp_size) for r in regs] == [(0, 2), (1, 2)]
    assert [r.transport_addr for r in regs] == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]

    pairs = [(1, 5), (2, 6), (3, 2)]  # one request, the same block ids on every rank
    cli.publish("pre", "p-r1", [[b for _, b in pairs]], num_tokens=3 * BLOCK, lease_s=30.0)
    for r in range(TP):
        submit_pull(dec[r], url, "r1", pairs)
    assert [pull_outcome(dec[r], "r1") for r in range(TP)] == ["ok", "ok"]
    for r in range(TP):
        for name, t in dec[r].kv_caches.items():
            for local, remote in pairs:
                assert torch.equal(t[local], pre[r].kv_caches[name][remote]), (r, name, local)
                assert not torch.equal(t[local], pre[1 - r].kv_caches[name][remote])  # not the other shard
            assert torch.equal(t[4], _shard(r, -1000.0)[name][4])  # a block not asked for is untouched
    # each decode rank connected to its own prefill rank, nowhere else
    for r in range(TP):
        assert [key for key in dec[r]._remotes] == [(url, "pre")]
        assert dec[r].get_stats().data["pulls_ok"] == 1


def test_real_vllm_tp1_prefill_into_tp2_decode(tiny_model, tmp_path):
    """A TP=1 prefill server and a TP=2 decode server: each decode rank reads its one KV head out of
    prefill's two-head blocks (a head range of each block). float32, so TP=1 and TP=2 compute the same
    tokens and the oracle is exact: decode's answer from pulled KV equals its own local answer. (Skipped on
    fewer than 4 CPUs until session 26: decode's workers' queue loops spun both cores for seconds at a time,
    starving the other server's threads; under tools/nospin, as every test server runs now, it passes on 2.)"""
    from tests.vllm.helpers import Server, complete, kv_config, text, token_prompts

    bport = free_port()
    # Generous timeouts: once decode's two workers have run a request, their communicator threads busy-poll
    # both cores and starve every other thread here for seconds at a time (docs/NOTES-connector.md item 13).
    pre_kv = dict(kv_config("kv_producer", transport_backend="tcp", bootstrap_port=bport, lease_s=300.0,
                            engine_lease_s=300.0), engine_id="prefill-tp1")
    dec_kv = _switched(kv_config("kv_consumer", transport_backend="tcp", engine_lease_s=300.0, lookup_wait_s=60.0,
                                 transfer_timeout_s=90.0, bootstrap_timeout_s=90.0, pull_timeout_s=240.0,
                                 connect_timeout_s=60.0, spread_threads=True))
    flag = tmp_path / "corrupt"
    common = ["--dtype", "float32", "--no-enable-prefix-caching"]
    pre = Server(tiny_model, pre_kv, cpu=0, log=tmp_path / "prefill.log", extra_args=common)
    try:  # prefill serves decode's bootstrap calls and READs: ahead of decode's busy threads
        os.setpriority(os.PRIO_PROCESS, pre.proc.pid, -10)
    except OSError:
        pass
    dec = Server(tiny_model, dec_kv, cpu="0|1", log=tmp_path / "decode-tp2.log",
                 extra_args=[*common, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"],
                 env={"KVLINK_TEST_CORRUPT_WHILE": str(flag)})
    try:
        pre.wait_ready(300)
        dec.wait_ready(300)
        block_bytes = 2 * 1 * 32 * 64 * 4  # K and V x 1 KV head per decode rank x 32 tokens x 64 x fp32
        pulled = 0
        for n in (20, 64, 300):  # shorter than a block, exactly 2 blocks, several blocks
            prompt = token_prompts([n], seed=70 + n)[0]
            want = text(complete(dec.url, prompt, timeout=300))
            params = complete(pre.url, prompt, {"do_remote_decode": True}, max_tokens=1, timeout=300)["kv_transfer_params"]
            assert text(complete(dec.url, prompt, params, timeout=300)) == want, n
            pulled += len(params["remote_block_ids"])
        assert dec.metric("kvlink_pulls_failed_total") == 0.0
        # both decode ranks pulled their own head of every block of both layers, once
        assert dec.metric("kvlink_bytes_pulled_total") == pulled * 2 * block_bytes * 2
        # negative control: A's KV pulled and then corrupted in decode's blocks gives another answer
        a = token_prompts([300], seed=98)[0]
        want = text(complete(dec.url, a, timeout=300))
        _corrupt_while(flag, lambda: _check_other(pre.url, dec.url, a, want, timeout=300))
        deadline = time.monotonic() + 30
        while pre.metric("kvlink_held_blocks") != 0.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pre.metric("kvlink_held_blocks") == 0.0  # prefill freed every pulled request
    finally:
        dec.stop()
        pre.stop()
