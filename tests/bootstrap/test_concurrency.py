"""200 concurrent clients registering, publishing and looking up against one embedded server."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from kvlink.bootstrap import BootstrapClient, Outcome, RequestRecord, RequestStatus

N_CLIENTS = 200


def test_200_concurrent_clients(server, token, make_registration):
    start = threading.Barrier(N_CLIENTS)

    def one(i: int) -> str:
        with BootstrapClient(server.url, token=token, timeout_s=30.0) as cli:
            start.wait()
            engine = f"P{i % 20}"
            rank = i // 20  # 10 TP ranks per engine, registered concurrently
            cli.register_engine(make_registration(engine, tp_rank=rank, tp_size=10, port=6000 + i), lease_s=60.0)
            rids = [f"req-{i}-{k}" for k in range(5)]
            for k, rid in enumerate(rids):
                cli.publish(engine, rid, [[i, k]], 16 * (k + 1), lease_s=60.0, transfer_id=f"t-{i}-{k}")
            found = cli.lookup(engine, [*rids, f"missing-{i}"])
            assert [found[rid].block_ids for rid in rids] == [[[i, k]] for k in range(5)]
            assert found[f"missing-{i}"] is RequestStatus.UNKNOWN
            assert isinstance(cli.lookup_transfer(f"t-{i}-0"), RequestRecord)
            assert cli.get_engine(engine, tp_rank=rank).transport_addr == f"127.0.0.1:{6000 + i}"
            cli.release(engine, rids[0], Outcome.PULLED)
            return engine

    with ThreadPoolExecutor(max_workers=N_CLIENTS) as pool:
        engines = list(pool.map(one, range(N_CLIENTS)))
    assert len(engines) == N_CLIENTS
    with BootstrapClient(server.url, token=token) as cli:
        health = cli.health()
        assert (health.engines, health.requests) == (N_CLIENTS, N_CLIENTS * 4)
        assert all(len(cli.engine_ranks(f"P{e}")) == 10 for e in range(20))
        released = [rid for e in range(20) for rid, _ in cli.poll_released(f"P{e}")]
        assert sorted(released) == sorted(f"req-{i}-0" for i in range(N_CLIENTS))


def test_one_client_shared_by_threads_reuses_connections(server, token, make_registration):
    with BootstrapClient(server.url, token=token, max_idle_connections=4) as cli:
        cli.register_engine(make_registration("P"), lease_s=60.0)
        cli.publish("P", "r", [[1]], 16, lease_s=60.0)

        def work(_: int) -> None:
            for _ in range(25):
                assert isinstance(cli.lookup("P", ["r"])["r"], RequestRecord)

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(work, range(8)))
        assert len(cli._pool._idle) <= 4
