"""`kvlink bench` as a user runs it: real processes on loopback, small sizes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np

from kvlink.bench.workloads import expected
from kvlink.transport import Engine, EngineConfig

FIELDS = {"system", "workload", "blocks", "block_size", "bytes", "gbps_median", "gbps_min", "gbps_max", "p50_ms",
          "p99_ms", "iters"}
SMALL = ["--buffer-mb", "64", "--iters", "2", "--warmup", "1", "--lat-iters", "5"]


def kvlink(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlink", *args], capture_output=True, text=True, timeout=timeout)


def test_bench_compare_json():
    r = kvlink("bench", *SMALL, "--mem-peers", "2", "--compare", "raw-tcp,memcpy", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    results = [row for row in rows if row["workload"] != "memory"]
    assert {(row["workload"], row["system"]) for row in results} == {
        (w, s) for w in ("paged-32k", "paged-128k", "large-64m", "tiny-64b", "lat-4k", "lat-32k")
        for s in ("kvlink", "raw-tcp", "memcpy")}
    for row in results:
        assert FIELDS <= row.keys()
        assert row["verified"] is True
        assert row["gbps_median"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0
    mem = [row for row in rows if row["workload"] == "memory"][0]
    assert mem["peers"] == 2 and "target_rss_growth_mib" in mem
    assert "paged-32k" in r.stderr  # progress is shown


def test_bench_table_and_custom_blocks():
    r = kvlink("bench", *SMALL, "--mem-peers", "0", "--blocks", "300", "--block-size", "4096", "--compare",
               "raw-tcp,kvlink-same-host")
    assert r.returncode == 0, r.stderr
    assert "paged-300x4096" in r.stdout and "vs raw-tcp" in r.stdout
    assert "kvlink-same-host vs raw-tcp" in r.stdout


def test_bench_two_roles_with_token_file(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("two-hosts-token\n")
    target = subprocess.Popen([sys.executable, "-m", "kvlink", "bench", "--role", "target", "--listen", "127.0.0.1:0",
                               "--token-file", str(tok), "--buffer-mb", "64"], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(target.stdout.readline())
        r = kvlink("bench", "--role", "initiator", "--peer", info["address"], "--raw-port", str(info["raw_port"]),
                   "--token-file", str(tok), "--workloads", "paged-32k,lat-4k", "--mem-peers", "0", "--json",
                   *SMALL)
        assert r.returncode == 0, r.stderr
        assert {json.loads(x)["workload"] for x in r.stdout.splitlines()} == {"paged-32k", "lat-4k"}
        wrong = tmp_path / "wrong"
        wrong.write_text("another-token")
        r = kvlink("bench", "--role", "initiator", "--peer", info["address"], "--raw-port", str(info["raw_port"]),
                   "--token-file", str(wrong), "--workloads", "lat-4k", *SMALL)
        assert r.returncode != 0 and "KVL_EAUTH" in r.stderr
    finally:
        target.terminate()
        target.wait(timeout=20)


def test_bench_target_serves_with_stdin_at_eof_until_sigterm(tmp_path):
    """Started as under nohup, systemd or `ssh -n` (stdin at end of file), the
    target keeps serving; SIGTERM stops it cleanly."""
    tok = tmp_path / "token"
    tok.write_text("detached-token")
    target = subprocess.Popen([sys.executable, "-m", "kvlink", "bench", "--role", "target", "--listen", "127.0.0.1:0",
                               "--token-file", str(tok), "--buffer-mb", "16"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(target.stdout.readline())
        time.sleep(1.0)  # a target that stopped at end of stdin is gone by now
        assert target.poll() is None, target.stderr.read()
        dst = np.zeros(4096, dtype=np.uint8)
        with Engine(EngineConfig(listen=None, token=b"detached-token", name="probe")) as eng:
            peer = eng.connect(info["address"])
            eng.read(peer, eng.register(dst), 0, info["region"], 8192, dst.nbytes).wait()
        assert np.array_equal(dst.view(np.uint64), expected(np.array([8192]), dst.nbytes, info["seed"])[0])
        target.send_signal(signal.SIGTERM)
        _, err = target.communicate(timeout=20)
        assert target.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()


def test_bench_rejects_unknown_names():
    r = kvlink("bench", "--compare", "carrier-pigeon", *SMALL)
    assert r.returncode != 0 and "unknown system 'carrier-pigeon'" in r.stderr
    r = kvlink("bench", "--workloads", "nope", *SMALL)
    assert r.returncode != 0 and "unknown ['nope']" in r.stderr
