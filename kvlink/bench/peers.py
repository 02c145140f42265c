"""Peers measured by `kvlink bench --compare`: Mooncake's transfer engine (TCP)
and NIXL (UCX over TCP, and UCX defaults: same-host process_vm_readv).

Each runs the same workloads over the same random-slot layout as
``Initiator.run_kvlink`` and verifies the data the same way. The peers run at
their default settings, used as their users do, and are given every
preparation outside the timed region that their APIs allow: Mooncake's
address lists are built once per workload, NIXL's descriptor lists are
prepared once (``prep_xfer_dlist``) and each run is ``make_prepped_xfer`` +
``transfer`` + polling. Raw addresses are exchanged in the target's info:
that is how these APIs are used, and it is a benchmark.

Their packages live in ``bench/.peers/`` (``bash bench/install_peers.sh``),
outside the project's environment; ``KVLINK_BENCH_PEERS`` points elsewhere.
Mooncake's address and per-peer queue limit come from the environment as for
kvlink's Mooncake backend (:meth:`kvlink.backends.MooncakeConfig.from_env`:
``KVLINK_MOONCAKE_HOST``, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``), read once
per side; the comparison runs over TCP whatever protocol they name.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlink.backends import MooncakeConfig
from kvlink.bench.runner import Runner
from kvlink.bench.workloads import Workload

if TYPE_CHECKING:
    from kvlink.bench.initiator import Initiator

PEER_SYSTEMS = ("mooncake", "nixl-tcp", "nixl")
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
NIXL_TARGET_AGENT = "kvlink-bench-target"


class PeerMissing(RuntimeError):
    pass


def peers_dir() -> Path:
    env = os.environ.get("KVLINK_BENCH_PEERS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "bench" / ".peers"


def _import_mooncake() -> Any:
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError:
        sys.path.append(str(peers_dir() / "mooncake"))
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise PeerMissing(f"mooncake: {e} (run: bash bench/install_peers.sh)") from None
    return TransferEngine


def _import_nixl() -> tuple[Any, Any]:
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")  # NIXL logs INFO to stdout otherwise
    path = str(peers_dir() / "nixl")
    if path not in sys.path:
        sys.path.append(path)
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise PeerMissing(f"nixl: {e} (run: bash bench/install_peers.sh)") from None
    return nixl_agent, nixl_agent_config


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- target side ---------------------------------------------------------------------------------
class PeerTargets:
    """A Mooncake engine and a NIXL agent serving the target's patterned buffer."""

    def __init__(self, systems: list[str], host: str, buf: np.ndarray):
        self.info: dict[str, Any] = {"buffer_addr": buf.ctypes.data}
        self._mc = self._nixl = self._nixl_reg = None
        if "mooncake" in systems:
            mc = MooncakeConfig.from_env()
            self._mc = _import_mooncake()()
            mc_host = mc.host or (host if host not in ("0.0.0.0", "::") else "127.0.0.1")
            if self._mc.initialize(mc_host, "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("mooncake: initialize failed")
            if self._mc.register_memory(buf.ctypes.data, buf.nbytes) != 0:
                raise RuntimeError("mooncake: register_memory failed")
            self.info["mooncake_session"] = f"{mc_host}:{self._mc.get_rpc_port()}"
        if any(s.startswith("nixl") for s in systems):
            agent, config = _import_nixl()
            port = free_port(host)
            self._nixl = agent(NIXL_TARGET_AGENT, config(enable_listen_thread=True, listen_port=port))
            self._nixl_reg = self._nixl.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            self.info.update(nixl_agent=NIXL_TARGET_AGENT, nixl_port=port)

    def close(self) -> None:
        if self._nixl is not None:
            self._nixl.deregister_memory(self._nixl_reg)
            self._nixl = None
        if self._mc is not None:
            self._mc = None


# -- initiator side ------------------------------------------------------------------------------
class PeerClients:
    """The initiator's Mooncake engine and NIXL agents, created on first use."""

    def __init__(self, ini: Initiator):
        self.ini, self.info = ini, ini.info.peers
        self._mc = None
        self._agents: dict[str, tuple[Any, Any]] = {}

    def mooncake(self) -> Any:
        if self._mc is None:
            if "mooncake_session" not in self.info:
                raise PeerMissing("the target hosts no Mooncake engine (start it with --peers mooncake)")
            eng = _import_mooncake()()
            if eng.initialize(self.mooncake_config.host or "127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("mooncake: initialize failed")
            dst = self.ini.dst
            if eng.register_memory(dst.ctypes.data, dst.nbytes) != 0:
                raise RuntimeError("mooncake: register_memory failed")
            session = self.info["mooncake_session"]
            if eng.transfer_sync_read(session, dst.ctypes.data, self.info["buffer_addr"], 4096) != 0:
                raise RuntimeError(f"mooncake: first read from {session} failed")
            self._mc = eng
        return self._mc

    @cached_property
    def mooncake_config(self) -> MooncakeConfig:
        """The initiator's Mooncake settings, read from the environment once."""
        return MooncakeConfig.from_env()

    def nixl(self, system: str) -> tuple[Any, Any]:
        """(agent, registration) for 'nixl' (UCX defaults) or 'nixl-tcp' (UCX_TLS=tcp on lo)."""
        if system not in self._agents:
            if "nixl_port" not in self.info:
                raise PeerMissing("the target hosts no NIXL agent (start it with --peers nixl)")
            agent_cls, config = _import_nixl()
            saved = {k: os.environ.get(k) for k in UCX_TCP}
            for k in UCX_TCP:  # UCX reads these when the agent's context is created
                os.environ.pop(k, None)
                if system == "nixl-tcp":
                    os.environ[k] = UCX_TCP[k]
            try:
                agent = agent_cls(f"kvlink-bench-{system}",
                                  config(enable_listen_thread=True, listen_port=free_port(self.ini.host)))
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            dst = self.ini.dst
            reg = agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
            name = self.info["nixl_agent"]
            agent.fetch_remote_metadata(name, self.ini.host, self.info["nixl_port"])
            deadline = time.monotonic() + 20
            while not agent.check_remote_metadata(name):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nixl: no metadata from {name} at {self.ini.host}:{self.info['nixl_port']}")
                time.sleep(0.01)
            self._agents[system] = (agent, reg)
        return self._agents[system]

    def close(self) -> None:
        # Explicit, ordered teardown: NIXL agents left to interpreter shutdown can crash the process.
        for agent, reg in self._agents.values():
            agent.deregister_memory(reg)
        self._agents.clear()
        self._mc = None


def _descs(base: int, offs: np.ndarray, size: int) -> np.ndarray:
    n = len(offs)
    return np.stack([offs + np.uint64(base), np.full(n, size, dtype=np.uint64), np.zeros(n, dtype=np.uint64)], 1)


def peer_runner(ini: Initiator, system: str, w: Workload, r_offs: np.ndarray, l_offs: np.ndarray) -> Runner:
    """One peer system ready for one workload (see Initiator.run)."""
    if ini.peer_clients is None:
        ini.peer_clients = PeerClients(ini)
    pc = ini.peer_clients
    bs = w.block_size
    close = lambda: None  # noqa: E731
    if system == "mooncake":
        eng, session = pc.mooncake(), pc.info["mooncake_session"]
        la = (l_offs + np.uint64(ini.dst.ctypes.data)).tolist()
        ra = (r_offs + np.uint64(pc.info["buffer_addr"])).tolist()
        lens = [bs] * len(la)
        c = pc.mooncake_config.max_queued  # one batch per Mooncake's per-peer queue limit

        def op() -> None:
            for k in range(0, len(la), c):
                if eng.batch_transfer_sync_read(session, la[k:k + c], ra[k:k + c], lens[k:k + c]) != 0:
                    raise RuntimeError(f"mooncake: batch read from {session} failed")
    else:
        agent, _ = pc.nixl(system)
        remote = pc.info["nixl_agent"]
        local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(ini.dst.ctypes.data, l_offs, bs), "DRAM")
        remote_side = agent.prep_xfer_dlist(remote, _descs(pc.info["buffer_addr"], r_offs, bs), "DRAM")
        idx = np.arange(len(l_offs))

        def op() -> None:
            h = agent.make_prepped_xfer("READ", local_side, idx, remote_side, idx)
            try:
                state = agent.transfer(h)
                while state != "DONE":
                    if state == "ERR":
                        raise RuntimeError(f"nixl: transfer from {remote} failed")
                    state = agent.check_xfer_state(h)
            finally:
                agent.release_xfer_handle(h)

        def close() -> None:
            agent.release_dlist_handle(local_side)
            agent.release_dlist_handle(remote_side)

    return Runner(system, op, ini._checked(op, l_offs, r_offs, w), close=close, descriptors=lambda: len(l_offs))
