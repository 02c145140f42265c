"""No byte lands in decode's blocks after decode gave them back: a streamed pull cancelled while a piece's
READ is on the wire, over real kvlink TCP engines and the throttling Relay.

A prefill and a decode KVLinkWorker (as tests/vllm/test_worker.py builds them, but with the real ``tcp``
backend) and an embedded bootstrap server. Prefill's transport is advertised through a Relay, so the
READ of a streamed piece can be held slow: decode's kernel is handed the bytes a few KiB at a time, for
seconds. Prefill's pieces are reported to the bootstrap server as its PieceSender would, so decode's
worker reads them through its real concurrent path (long poll, piece, READ).

The control case lets a held READ go on instead of cancelling it: the same checksum then sees the
blocks change, so the check would notice a write after the give-back.

Also here, through the same real path: pieces that arrive out of order and twice are applied once (the
first arrival wins), and decode reads each block once; and a streamed pull over every transport backend
(kvlink's TCP and same-host paths, Mooncake's transfer engine) lands whole.
"""

from __future__ import annotations

import hashlib
import time
import uuid

import pytest

from tests.relay import Relay
from tests.vllm.helpers import free_port, pull_outcome, register_two_layers, scrape

torch = pytest.importorskip("torch")

BLOCKS, HEADS, BLOCK, HEAD2 = 48, 2, 32, 128  # 16 KiB a block a layer, 32 KiB a block over both layers
PIECE = 24  # blocks of the streamed piece: 768 KiB, one stream of the transport (< 1 MiB, not striped)
SLOW_RATE = 32 << 10  # bytes/s while throttled: the piece's READ would take ~24 s


@pytest.fixture
def relayed():
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer
    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    tport = free_port()
    relay = Relay(f"127.0.0.1:{tport}")
    pre = W.KVLinkWorker(ConnectorConfig(transport_backend="tcp", transport_port=tport,
                                         transport_advertise=relay.address),
                         W.RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    dec = W.KVLinkWorker(ConnectorConfig(transport_backend="tcp", pull_timeout_s=120.0, lookup_wait_s=60.0,
                                         transfer_timeout_s=120.0),
                         W.RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        register_two_layers(pre, dec, srv.url, BLOCKS, HEADS, BLOCK, HEAD2)
        yield pre, dec, srv.url, relay
    finally:
        dec.shutdown()
        pre.shutdown()
        relay.close()
        srv.stop()


def _stream(dec, url: str, rid: str, local: list[int]) -> str:
    """Hand decode a concurrent pull (transfer id only: it long-polls for prefill's pieces and record)."""
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    tid = "t-" + uuid.uuid4().hex
    dec._submit(PullSpec(request_id=rid, local_block_ids=tuple(local), first_block=0,
                         source=RemoteSource(bootstrap_url=url, engine_id="pre", transfer_id=tid)))
    return tid


def _piece(url: str, tid: str, rid: str, remote: list[int], index: int = 1) -> None:
    """Prefill reports the first blocks of a request it is still computing (what PieceSender sends)."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.bootstrap.schema import StreamPiece

    with BootstrapClient(url) as cli:
        cli.stream_pieces("pre", 0, 1, [StreamPiece(transfer_id=tid, request_id="p-" + rid, index=index,
                                                    num_tokens=BLOCK * len(remote), block_ids=[remote])])


def _publish(url: str, tid: str, rid: str, remote: list[int]) -> None:
    from kvlink.bootstrap import BootstrapClient

    with BootstrapClient(url) as cli:
        cli.publish("pre", "p-" + rid, [remote], num_tokens=BLOCK * len(remote), lease_s=60.0, transfer_id=tid)


def _checksum(worker, blocks: list[int]) -> str:
    h = hashlib.sha256()
    for t in worker.kv_caches.values():
        h.update(t[blocks].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _same_as_source(pre, dec, local: list[int], remote: list[int]) -> bool:
    return all(torch.equal(dec.kv_caches[n][local], pre.kv_caches[n][remote]) for n in dec.kv_caches)


def _counted(dec, key: str) -> int:
    with dec._lock:
        return dec._table.counts.get(key, 0)


def _outcome(dec, rid: str, wait_s: float) -> str:
    """'given back' once decode reports the request to vLLM (its blocks are vLLM's again)."""
    out = pull_outcome(dec, rid, wait_s)
    return "given back" if out == "ok" else out


def _warm(pre, dec, url: str, first: int = 1) -> None:
    """A whole streamed pull at full speed (piece, then the record's tail) into blocks ``first``..+3: decode
    connects through the relay, so the throttled bytes that follow are READ data, not the handshake."""
    local, remote = list(range(first, first + 4)), [40, 41, 42, 43]
    rid = f"warm{first}"
    tid = _stream(dec, url, rid, local)
    _piece(url, tid, rid, remote[:2])
    deadline = time.monotonic() + 60
    while _counted(dec, "blocks_streamed") < 2:  # the piece is read before the record comes
        assert time.monotonic() < deadline, "the streamed piece was never read"
        time.sleep(0.01)
    _publish(url, tid, rid, remote)
    assert _outcome(dec, rid, 60) == "given back"
    assert _same_as_source(pre, dec, local, remote)
    dec.get_stats()  # counted from zero again


def _held_piece_read(pre, dec, url, relay, rid):
    """Start a streamed pull whose piece's READ the relay holds slow; return once its bytes flow."""
    _warm(pre, dec, url)
    local, remote = list(range(8, 8 + PIECE)), list(range(BLOCKS - PIECE - 1, BLOCKS - 1))
    before = _checksum(dec, local)
    relay.throttle(SLOW_RATE)
    tid = _stream(dec, url, rid, local + [8 + PIECE])  # one block more than the piece: the tail
    _piece(url, tid, rid, remote)
    assert relay.first_byte.wait(60), "the piece's READ never started"
    return local, remote, tid, before


def test_no_byte_lands_after_a_cancelled_streamed_read_gave_its_blocks_back(relayed):
    pre, dec, url, relay = relayed
    local, remote, _, before = _held_piece_read(pre, dec, url, relay, "s1")
    deadline = time.monotonic() + 60
    while _checksum(dec, local) == before:  # cancel once the READ's first bytes have landed: mid-READ
        assert time.monotonic() < deadline, "no byte of the held READ ever landed"
        time.sleep(0.01)
    dec.start_load_kv(_cancels("s1"))  # vLLM aborted the request
    assert _outcome(dec, "s1", 60) == "given back"  # cancelled: released as finished, not failed
    given_back = _checksum(dec, local)
    relay.throttle(None)  # whatever the relay and the kernels still hold now flows at full speed
    time.sleep(2.0)
    assert _checksum(dec, local) == given_back, "bytes landed in the blocks after they went back to vLLM"
    assert not _same_as_source(pre, dec, local, remote), "the READ was not cut short: nothing was tested"
    # The engine goes on serving: the next pull lands whole.
    _warm(pre, dec, url, first=36)


def test_control_a_held_read_that_goes_on_does_change_the_blocks(relayed):
    """Without the cancel, the same checksum sees the READ's bytes land after the moment it was taken."""
    pre, dec, url, relay = relayed
    local, remote, tid, _ = _held_piece_read(pre, dec, url, relay, "s2")
    held = _checksum(dec, local)
    relay.throttle(None)
    deadline = time.monotonic() + 30
    while not _same_as_source(pre, dec, local, remote) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _checksum(dec, local) != held
    assert _same_as_source(pre, dec, local, remote)
    _publish(url, tid, "s2", remote + [BLOCKS - 1])
    assert _outcome(dec, "s2", 60) == "given back"


def _cancels(rid: str):
    from kvlink.vllm.metadata import KVLinkMetadata

    return KVLinkMetadata(cancels=[rid])


def test_reordered_and_duplicate_pieces_are_applied_once_and_each_block_read_once(relayed):
    """Prefill's pieces reach the real bootstrap server out of order and twice (a retried call, a late
    one): a piece whose index was applied already changes nothing, even with other blocks in it (first
    arrival wins), progress never goes back, and decode reads each block once, then only the tail."""
    pre, dec, url, _ = relayed
    _warm(pre, dec, url)
    local, remote = list(range(10, 18)), list(range(20, 28))
    applied0 = scrape(url, "kvlink_bootstrap_stream_pieces_total") or 0.0
    dups0 = scrape(url, "kvlink_bootstrap_stream_duplicates_total") or 0.0
    streamed0 = _counted(dec, "blocks_streamed")
    tid = _stream(dec, url, "d1", local)
    _piece(url, tid, "d1", remote[:4], index=2)  # index 2 comes first
    deadline = time.monotonic() + 60
    while _counted(dec, "blocks_streamed") < streamed0 + 4:
        assert time.monotonic() < deadline, "the first piece was never read"
        time.sleep(0.01)
    _piece(url, tid, "d1", remote[:2], index=1)  # late: below the last applied index
    _piece(url, tid, "d1", [30, 31, 32, 33, 34, 35], index=2)  # the same index again, other blocks
    _piece(url, tid, "d1", remote[:6], index=3)
    while _counted(dec, "blocks_streamed") < streamed0 + 6:
        assert time.monotonic() < deadline, "the third piece was never read"
        time.sleep(0.01)
    _publish(url, tid, "d1", remote)  # the end of the stream: the last two blocks are the tail
    assert _outcome(dec, "d1", 60) == "given back"
    assert _same_as_source(pre, dec, local, remote)
    assert _counted(dec, "blocks_streamed") == streamed0 + 6  # blocks 30-35 were never read
    assert (scrape(url, "kvlink_bootstrap_stream_pieces_total") or 0.0) == applied0 + 2
    assert (scrape(url, "kvlink_bootstrap_stream_duplicates_total") or 0.0) == dups0 + 2


@pytest.fixture(params=["tcp", "same-host", "mooncake"])
def backend_pair(request):
    """Prefill and decode workers over one backend kind, no relay, and an embedded bootstrap server."""
    if request.param == "mooncake":
        pytest.importorskip("mooncake")
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer
    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    cfg = ConnectorConfig(transport_backend=request.param, pull_timeout_s=60.0)
    pre = W.KVLinkWorker(cfg, W.RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    dec = W.KVLinkWorker(cfg, W.RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        register_two_layers(pre, dec, srv.url, BLOCKS, HEADS, BLOCK, HEAD2)
        yield request.param, pre, dec, srv.url
    finally:
        dec.shutdown()
        pre.shutdown()
        srv.stop()


def test_a_streamed_pull_lands_whole_over_every_backend(backend_pair):
    """Two pieces read while prefill 'computes', then the record's tail: every block equals prefill's."""
    kind, pre, dec, url = backend_pair
    local, remote = list(range(3, 11)), [30, 12, 44, 7, 19, 25, 40, 2]  # scattered, as vLLM allocates
    tid = _stream(dec, url, "b1", local)
    deadline = time.monotonic() + 60
    for index, upto in ((1, 3), (2, 6)):
        _piece(url, tid, "b1", remote[:upto], index=index)
        while _counted(dec, "blocks_streamed") < upto:
            assert time.monotonic() < deadline, f"piece {index} was never read"
            time.sleep(0.01)
    _publish(url, tid, "b1", remote)
    assert _outcome(dec, "b1", 60) == "given back"
    assert dec.engine.kind == kind
    assert _same_as_source(pre, dec, local, remote)
    assert _counted(dec, "blocks_streamed") == 6  # the last two blocks came as the tail
    untouched = [b for b in range(BLOCKS) if b not in local]
    assert not any(dec.kv_caches[n][untouched].any() for n in dec.kv_caches)  # nothing else was written


def _layer_piece(url: str, tid: str, rid: str, whole: list[int], step: list[int], layers: int, index: int) -> None:
    """Prefill, mid-forward: ``whole`` blocks are done in every layer, ``step``'s in the layers below ``layers``."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.bootstrap.schema import StreamPiece

    with BootstrapClient(url) as cli:
        cli.stream_pieces("pre", 0, 1, [StreamPiece(
            transfer_id=tid, request_id="p-" + rid, index=index, num_tokens=BLOCK * len(whole), block_ids=[whole],
            step_block_ids=[step], layers=layers)])


def _layer_equal(pre, dec, layer: int, local: list[int], remote: list[int]) -> bool:
    name = f"model.layers.{layer}.self_attn.attn"
    return torch.equal(dec.kv_caches[name][local], pre.kv_caches[name][remote])


def test_a_layer_wise_streamed_pull_reads_each_layer_range_and_lands_whole_over_every_backend(backend_pair):
    """Layer-wise pieces: the step's blocks are read in the layers prefill reports done, and no further; the
    next piece reads the rest of them; the record's tail the remaining blocks. Every block equals prefill's."""
    kind, pre, dec, url = backend_pair
    local, remote = list(range(3, 11)), [30, 12, 44, 7, 19, 25, 40, 2]
    tid = _stream(dec, url, "l1", local)
    _layer_piece(url, tid, "l1", remote[:2], remote[2:5], layers=1, index=1)  # layer 0 of the step is done
    deadline = time.monotonic() + 60
    while not (_layer_equal(pre, dec, 0, local[:5], remote[:5]) and _layer_equal(pre, dec, 1, local[:2], remote[:2])):
        assert time.monotonic() < deadline, "the layer-wise piece was never read"
        time.sleep(0.01)
    time.sleep(0.2)  # a READ of more than the piece said would have landed by now
    assert not dec.kv_caches["model.layers.1.self_attn.attn"][local[2:5]].any(), "read a layer prefill had not done"
    _layer_piece(url, tid, "l1", remote[:5], remote[5:6], layers=2, index=2)  # the step ended; the next one's 1st
    while not _layer_equal(pre, dec, 1, local[:6], remote[:6]):
        assert time.monotonic() < deadline, "the second layer-wise piece was never read"
        time.sleep(0.01)
    assert not dec.kv_caches["model.layers.0.self_attn.attn"][local[6:]].any()
    _publish(url, tid, "l1", remote)
    assert _outcome(dec, "l1", 60) == "given back"
    assert dec.engine.kind == kind
    assert _same_as_source(pre, dec, local, remote)
    untouched = [b for b in range(BLOCKS) if b not in local]
    assert not any(dec.kv_caches[n][untouched].any() for n in dec.kv_caches)


def test_a_layer_wise_streamed_pull_through_decodes_landing_pool_copies_only_the_layers_it_read():
    """Decode with host staging: a READ of a layer range lands in landing slots, and only those layers are
    copied into the blocks (a landing slot's other layers hold nothing of this request: copied whole they
    would overwrite what the blocks hold)."""
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer
    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    pre = W.KVLinkWorker(ConnectorConfig(transport_backend="tcp", pull_timeout_s=60.0),
                         W.RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    dec = W.KVLinkWorker(ConnectorConfig(transport_backend="tcp", pull_timeout_s=60.0, staging="always",
                                         staging_pool_mb=1), W.RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        register_two_layers(pre, dec, srv.url, BLOCKS, HEADS, BLOCK, HEAD2)
        assert dec._landing is not None
        for t in dec.kv_caches.values():
            t.fill_(7)  # what decode's blocks held before: must survive where no layer was read yet
        url, local, remote = srv.url, list(range(3, 11)), [30, 12, 44, 7, 19, 25, 40, 2]
        tid = _stream(dec, url, "s1", local)
        _layer_piece(url, tid, "s1", remote[:2], remote[2:5], layers=1, index=1)
        deadline = time.monotonic() + 60
        while not (_layer_equal(pre, dec, 0, local[:5], remote[:5]) and _layer_equal(pre, dec, 1, local[:2], remote[:2])):
            assert time.monotonic() < deadline, "the layer-wise piece was never read"
            time.sleep(0.01)
        time.sleep(0.2)
        layer1 = dec.kv_caches["model.layers.1.self_attn.attn"][local[2:5]]
        assert bool((layer1 == 7).all()), "a layer that was not read was copied from the landing slot"
        _publish(url, tid, "s1", remote)
        assert _outcome(dec, "s1", 60) == "given back"
        assert _same_as_source(pre, dec, local, remote)
    finally:
        dec.shutdown()
        pre.shutdown()
        srv.stop()
