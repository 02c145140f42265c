"""The same-host path: READs copy the peer's registered memory directly
(process_vm_readv) after the usual handshake, with the same checks and
guarantees as TCP, and fall back to TCP where the kernel forbids it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import numpy as np
import pytest

from kvlink.errors import AccessDenied, Canceled, OutOfRange, SameHostUnavailable, UnknownRegion
from kvlink.transport import Access

TOKEN = b"kvlink-test-token"

TARGET = """
import ctypes, json, sys, numpy as np
from kvlink.transport import Access, Engine, EngineConfig
if sys.argv[1] == "undumpable":
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: nobody may read our memory
buf = np.arange(8 << 20, dtype=np.uint8) * 7
if len(sys.argv) > 3:
    buf[:] = int(sys.argv[3])
e = Engine(EngineConfig(name="remote-target", token=b"kvlink-test-token", same_host="auto",
                        listen=sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1:0"))
r = e.register(buf, Access.READ)
print(json.dumps({"address": e.address, "region": r.id}), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def remote_target():
    procs = []

    def start(mode: str = "normal", *args: str) -> dict:
        p = subprocess.Popen([sys.executable, "-c", TARGET, mode, *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        info = json.loads(p.stdout.readline())
        info["proc"] = p
        return info

    yield start
    for p in procs:
        p.stdin.close()
        p.wait(timeout=10)


def expected_remote(off: int, n: int) -> np.ndarray:
    return (np.arange(off, off + n, dtype=np.uint64) * 7).astype(np.uint8)


def local_pair(make_engine, same_host="auto", size=16 << 20, target_same_host="auto"):
    target = make_engine(name="target", same_host=target_same_host)
    init = make_engine(name="init", listen=None, same_host=same_host)
    src = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    rs = target.register(src, Access.READ)
    rd = init.register(dst)
    return target, init, init.connect(target.address), src, dst, rs, rd


def test_same_host_reads_copy_directly_and_verify(make_engine):
    _, init, peer, src, dst, rs, rd = local_pair(make_engine)
    assert peer.same_host
    rng = np.random.default_rng(5)
    for bs in (32768, 131072, 4096):
        slots = rng.permutation((16 << 20) // bs)[:96].astype(np.uint64) * np.uint64(bs)
        dslots = rng.permutation((16 << 20) // bs)[:96].astype(np.uint64) * np.uint64(bs)
        before = init.stats()["bytes_local"]
        init.read(peer, rd, dslots, rs.id, slots, bs).wait()
        for a, b in zip(dslots.tolist(), slots.tolist()):
            assert np.array_equal(dst[a:a + bs], src[b:b + bs])
        moved_locally = init.stats()["bytes_local"] - before
        # batches under 64 KiB stay on TCP (fewer round trips); larger ones copy directly
        assert moved_locally == (96 * bs if 96 * bs >= 65536 else 0)


def test_same_host_across_processes(make_engine, remote_target, caplog):
    info = remote_target()
    init = make_engine(name="init", listen=None, same_host="require")
    dst = np.zeros(8 << 20, dtype=np.uint8)
    rd = init.register(dst)
    with caplog.at_level(logging.INFO, logger="kvlink.transport.engine"):
        peer = init.connect(info["address"])
    assert peer.same_host
    assert "process_vm_readv" in caplog.text
    init.read(peer, rd, [0, 1 << 20], info["region"], [12345, 4 << 20], 1 << 20).wait()
    assert np.array_equal(dst[:1 << 20], expected_remote(12345, 1 << 20))
    assert np.array_equal(dst[1 << 20:2 << 20], expected_remote(4 << 20, 1 << 20))
    assert init.stats()["bytes_local"] == 2 << 20


def test_a_peer_naming_another_engines_pid_is_read_over_tcp(make_engine, remote_target):
    """A hostile peer M (it holds the token) asks another engine V on the host for its probe answer and hands it
    on as its own: V's pid, and a cookie that reads back intact in V's memory. The requester would then copy
    from V's memory at whatever addresses M names, outside anything V registered, unseen by V's bounds and
    unregister. The kernel's tables show that V does not hold the other end of the requester's connection, so
    the peer stays on TCP ("require": refused, naming why)."""
    import socket
    import struct
    import threading

    from tests import wire

    v = remote_target()
    with wire.connect(v["address"]) as s:  # M asks V
        wire.client_handshake(s, TOKEN, "M")
        s.sendall(wire.frame(wire.LPROBE, seq=1))
        _, probe = wire.recv_frame(s)
    assert struct.unpack_from("<I", probe, 4)[0] == v["proc"].pid  # V's own answer
    lst = socket.create_server(("127.0.0.1", 0))
    served = []

    def answer(c):
        with c:
            try:
                wire.server_handshake(c, TOKEN, "M")
                (_, _, t, _, seq, _), _ = wire.recv_frame(c)
                if t == wire.LPROBE:
                    c.sendall(wire.frame(wire.LPROBE_RESP, probe, seq=seq))
                    served.append(seq)
                c.settimeout(5.0)
                c.recv(1)  # until the requester closes
            except (OSError, ConnectionError):
                pass

    def hostile_m():
        while True:
            try:
                c, _ = lst.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(c,), daemon=True).start()

    threading.Thread(target=hostile_m, daemon=True).start()
    try:
        address = "127.0.0.1:%d" % lst.getsockname()[1]
        strict = make_engine(name="strict", listen=None, same_host="require")
        with pytest.raises(SameHostUnavailable, match=f"pid {v['proc'].pid} does not hold the other end"):
            strict.connect(address)
        init = make_engine(name="init", listen=None, same_host="auto", streams=1)
        assert not init.connect(address).same_host
        assert len(served) == 2  # both probes were answered with V's pid: the check refused them
    finally:
        lst.close()


REQUESTER = """
import json, logging, sys, numpy as np
from kvlink.errors import SameHostUnavailable
from kvlink.transport import Engine, EngineConfig
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
address, region = sys.argv[1], int(sys.argv[2])
out = {}
with Engine(EngineConfig(name="init", listen=None, token=b"kvlink-test-token", same_host="auto")) as e:
    dst = np.zeros(1 << 20, dtype=np.uint8)
    rd = e.register(dst)
    peer = e.connect(address)
    e.read(peer, rd, [0], region, [99], 1 << 20).wait()
    out = {"same_host": peer.same_host, "data": bytes(dst[:64]).hex(), "bytes_local": e.stats()["bytes_local"]}
with Engine(EngineConfig(name="strict", listen=None, token=b"kvlink-test-token", same_host="require")) as e:
    try:
        e.connect(address)
    except SameHostUnavailable as exc:
        out["require_error"] = str(exc)
print(json.dumps(out))
"""


def test_forbidden_by_the_kernel_falls_back_to_tcp(remote_target):
    """A requester without the right to read the target's memory (another uid,
    no CAP_SYS_PTRACE) is told so by the probe and stays on TCP."""
    # Another uid that may still read the checkout (CAP_DAC_READ_SEARCH: a clone under a mode-700 directory
    # such as mktemp -d), but not another process's memory (no CAP_SYS_PTRACE).
    other_uid = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=+dac_read_search",
                 "--ambient-caps=+dac_read_search", sys.executable, "-c"]
    probe = subprocess.run([*other_uid, "import numpy, kvlink"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:  # a setpriv or kernel without ambient capabilities: not this test's subject
        pytest.skip("uid 65534 cannot import this checkout's environment: "
                    f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    info = remote_target()
    r = subprocess.run([*other_uid, REQUESTER, info["address"], str(info["region"])], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["same_host"] is False and out["bytes_local"] == 0
    assert bytes.fromhex(out["data"]) == expected_remote(99, 64).tobytes()
    lines = [line for line in r.stderr.splitlines() if "TCP, because" in line]
    assert len(lines) == 1 and "process_vm_readv of peer pid" in lines[0] and "not permitted" in lines[0]
    assert "KVL_ELOCAL" in out["require_error"] and "refused" in out["require_error"]


def test_same_host_checks_access_and_bounds(make_engine):
    target, init, peer, src, dst, rs, rd = local_pair(make_engine)
    hidden = target.register(np.ones(1 << 20, dtype=np.uint8), Access.NONE)
    with pytest.raises(AccessDenied):
        init.read(peer, rd, [0], hidden.id, [0], 1 << 20).wait()
    with pytest.raises(OutOfRange, match="beyond region"):
        init.read(peer, rd, [0], rs.id, [(16 << 20) - 65536], 1 << 20).wait()
    with pytest.raises(UnknownRegion):
        init.read(peer, rd, [0], 0x7777, [0], 1 << 20).wait()
    assert not dst.any()
    init.read(peer, rd, [0], rs.id, [0], 1 << 20).wait()  # and it keeps working
    assert np.array_equal(dst[:1 << 20], src[:1 << 20])


def test_same_host_cancel_leaves_destination_alone(make_engine):
    _, init, peer, src, dst, rs, rd = local_pair(make_engine, size=256 << 20)
    for _ in range(5):
        b = init.read(peer, rd, [0], rs.id, [0], 256 << 20)
        time.sleep(0.002)
        b.cancel()
        try:
            b.wait()
        except Canceled:
            pass
        dst[:] = 0x11
        time.sleep(0.05)
        assert (dst == 0x11).all()


def test_unregister_waits_for_a_same_host_copy(make_engine):
    _, init, peer, src, dst, rs, rd = local_pair(make_engine, size=128 << 20)
    b = init.read(peer, rd, [0], rs.id, [0], 128 << 20)
    rs.unregister(timeout_s=10)
    try:
        b.wait()
        assert np.array_equal(dst, src)  # it was pinned until the copy was confirmed
    except UnknownRegion:
        pass  # or it was refused before it started
    with pytest.raises(UnknownRegion):
        init.read(peer, rd, [0], rs.id, [0], 1 << 20).wait()


def test_a_target_with_same_host_off_gives_out_no_address_and_the_read_goes_over_tcp(make_engine):
    """Only an engine that opted in answers the probe or a same-host read: one with same_host off sends no
    pid, cookie or address (they would only help a peer on another host map its memory), and the requester
    reads over TCP; "require" fails the connect, naming why."""
    from kvlink.errors import KVLinkError

    target, init, peer, src, dst, rs, rd = local_pair(make_engine, size=1 << 20, target_same_host="off")
    assert not peer.same_host
    init.read(peer, rd, [0], rs.id, [0], 1 << 20).wait()
    assert np.array_equal(dst, src) and init.stats()["bytes_local"] == 0
    strict = make_engine(name="strict", listen=None, same_host="require")
    with pytest.raises(KVLinkError, match="same_host is off"):
        strict.connect(target.address)


def test_a_restarted_same_host_peer_under_the_same_name_is_another_peer(make_engine, remote_target):
    """The peer process restarts at the same address under the same engine name: a reconnect finds another
    pid behind the same-host path and retires the peer (PeerChanged: its region ids name another process's
    memory), for small (TCP) and large (same-host) READs alike; a new connect reads the new process."""
    from kvlink.errors import PeerChanged

    first = remote_target("normal", "127.0.0.1:0", "1")
    init = make_engine(name="init", listen=None, same_host="auto", streams=1)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    rd = init.register(dst)
    peer = init.connect(first["address"])
    assert peer.same_host
    init.read(peer, rd, 0, first["region"], 0, 1 << 20).wait()
    assert (dst == 1).all()
    first["proc"].stdin.close()
    first["proc"].wait(timeout=10)
    second = remote_target("normal", first["address"], "2")
    for n in (4096, 1 << 20, 4096, 1 << 20):  # the connection the first process closed is reopened at once,
        # and another process answers
        with pytest.raises(PeerChanged, match="no longer process|now answers"):
            init.read(peer, rd, 0, first["region"], 0, n).wait()
    again = init.connect(second["address"])
    assert again.id != peer.id and again.same_host
    init.read(again, rd, 0, second["region"], 0, 1 << 20).wait()
    assert (dst == 2).all()


def test_an_engine_older_than_the_same_host_path_is_read_over_tcp_under_auto(make_engine):
    """A kvlink that predates the same-host frames answers the probe with an ERROR frame and closes the
    connection (the relay plays it: it refuses the probe frame as such an engine does). "auto" reads such a
    peer over TCP, with the reason; "require" refuses the connect naming it. Before, "auto" failed the
    connect."""
    from tests.relay import Relay

    target = make_engine(name="target", same_host="auto")
    src = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    region = target.register(src, Access.READ).id
    relay = Relay(target.address, refuse_type=16)  # LPROBE (docs/protocol.md)
    try:
        init = make_engine(name="init", listen=None, same_host="auto")
        dst = np.zeros_like(src)
        peer = init.connect(relay.address)
        assert relay.refused == 1, "the probe was not refused: nothing was tested"
        assert not peer.same_host
        init.read(peer, init.register(dst), [0], region, [0], src.nbytes).wait()
        assert (dst == src).all()
        assert init.stats()["bytes_local"] == 0
        strict = make_engine(name="strict", listen=None, same_host="require")
        with pytest.raises(SameHostUnavailable, match="without the same-host path"):
            strict.connect(relay.address)
    finally:
        relay.close()


def test_a_same_host_peer_whose_address_then_refuses_the_probe_is_retired_and_read_over_tcp_anew(make_engine):
    """A peer read through the same-host path reconnects, and its address now refuses the probe (an older
    kvlink answers there: not the process probed). The peer is retired (PeerChanged, nothing read), and a
    connect opens a new peer that reads over TCP under "auto". Before, every later READ failed
    SameHostUnavailable and connect handed the broken peer back for good."""
    from kvlink.errors import PeerChanged, PeerClosed
    from tests.relay import Relay

    target = make_engine(name="target", same_host="auto")
    src = np.random.default_rng(6).integers(0, 256, 1 << 20, dtype=np.uint8)
    region = target.register(src, Access.READ).id
    relay = Relay(target.address)
    try:
        init = make_engine(name="init", listen=None, same_host="auto", streams=1)
        dst = np.zeros_like(src)
        rdst = init.register(dst)
        peer = init.connect(relay.address)
        assert peer.same_host
        init.read(peer, rdst, [0], region, [0], src.nbytes).wait()
        assert (dst == src).all()
        relay.refuse_type = 16  # LPROBE: from now on an engine that predates it answers at the address
        relay.drop()
        dst[:] = 0
        deadline = time.monotonic() + 10
        while True:  # the first READ may meet the dropped connection
            try:
                init.read(peer, rdst, [0], region, [0], src.nbytes).wait()
                raise AssertionError("read through a peer whose address refuses the probe")
            except PeerChanged:
                break
            except PeerClosed:
                assert time.monotonic() < deadline
        assert not dst.any()
        fresh = init.connect(relay.address)
        assert fresh.id != peer.id and not fresh.same_host
        init.read(fresh, rdst, [0], region, [0], src.nbytes).wait()
        assert (dst == src).all()
    finally:
        relay.close()
