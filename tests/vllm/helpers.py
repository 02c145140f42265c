"""Shared helpers for the real-vLLM tests: engine settings, prompts, server processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.ports import free_port  # noqa: F401 - the tests import it from here

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
BASE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": "WARNING"}


def kv_config(role: str, **extra) -> dict:
    """The production connector, as a user configures it (server processes: they read /metrics)."""
    return {"kv_connector": "KVLinkConnector", "kv_connector_module_path": "kvlink.vllm", "kv_role": role,
            "kv_connector_extra_config": extra}


def recording_kv_config(role: str, **extra) -> dict:
    """The connector as a RecordingConnector, which keeps its stats since start for the test to read
    (``recorded_now()``, tests/fakes_connector.py): the in-process engines (Engines)."""
    return dict(kv_config(role, **extra), kv_connector="RecordingConnector",
                kv_connector_module_path="tests.fakes_connector")


def corrupting_kv_config(**extra) -> dict:
    """A decode engine whose connector corrupts every block it pulled (negative controls, tests/fakes_connector.py).

    Server processes import it too: Server puts the repository root on their PYTHONPATH."""
    return dict(recording_kv_config("kv_consumer", **extra), kv_connector="CorruptingConnector",
                kv_load_failure_policy="recompute")


def held_requests(sched) -> dict[str, int]:
    """Request id -> blocks, of the requests a prefill KVLinkScheduler holds for decode now: its held table,
    read under its lock (the release watcher thread changes it)."""
    with sched._held_lock:
        return sched._held.blocks_by_request()


def engine_kwargs(model: str, **kw) -> dict:
    base = dict(model=model, dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                block_size=BLOCK, max_model_len=2048, seed=0, max_num_seqs=64)
    base.update(kw)
    return base


def without_digest(params: dict) -> dict:
    """Prefill's answer without its prompt digest (a router that drops it): decode then checks prefill's
    record (lease.RecordCheck) and reads nothing of another prompt's KV."""
    return {k: v for k, v in params.items() if k != "remote_prompt_sha"}


def assert_refused_and_computed(engines: Engines, dec: str, base: str, other_base: str,
                                prompts: list[list[int]], reason: str) -> None:
    """Decode engine ``dec`` differs from prefill ("pre") in a way that changes the answer (``base`` and
    ``other_base`` are single engines of each side's setup and answer otherwise): every pull is refused at
    first contact with ``reason``, nothing is pulled, and decode answers as its own single engine."""
    want = [[list(o.outputs[0].token_ids) for o in engines.generate(b, prompts, greedy())] for b in (base, other_base)]
    assert want[0] != want[1]  # the difference matters for these prompts
    params = prefill(engines, [list(p) for p in prompts])  # (a Mamba prefill shortens its request's prompt)
    before = engines.agents[dec].recorded_now()
    got = decode(engines, dec, prompts, params)
    after = engines.agents[dec].recorded_now()
    key = f"compat_refused.{reason}"
    assert after.get(key, 0) - before.get(key, 0) == len(prompts)
    assert after.get("pulls_ok", 0) == before.get("pulls_ok", 0)
    assert got == want[1]  # its own setup, its own compute


def position_sensitive_model(src: str, dst, factor: float = 30.0) -> str:
    """A copy of model ``src`` at ``dst`` with its query and key projections scaled by ``factor``. The tiny
    preset's attention is nearly uniform: its greedy answer depends on which tokens the prompt holds, hardly
    on their order (reversing the first 100 of 192 tokens leaves it unchanged), so keys rotated otherwise
    (other rotary settings) would not show in its output. Scaled up, attention peaks and each key's rotation
    counts."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(f"{dst}/model.safetensors")
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] = weights[name] * factor
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def token_prompts(n_tokens: list[int], seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in n_tokens]


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


class Server:
    """A vLLM OpenAI server (python -m vllm.entrypoints.openai.api_server) in its own process group.

    Started with tools/nospin on its path: vLLM's queue loops nap 0.5 ms between polls instead of spinning
    for a second after each message. Several servers' spinners on this machine's 2 cores starved the
    rest (a streamed piece once took 387 ms to reach prefill's bootstrap server, longer than the slowed
    forward it was meant to overlap)."""

    def __init__(self, model: str, kv: dict | None, cpu: int, log: Path, extra_args=(), env=None, eager: bool = True):
        """``eager``: pass ``--enforce-eager`` (False: vLLM CPU compiles the model, as pipeline parallelism
        needs: with eager mode it never sizes the buffer a later stage receives its input in)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
                *(["--enforce-eager"] if eager else []), "--kv-cache-memory-bytes", str(128 << 20),
                "--block-size", str(BLOCK), "--max-model-len", "2048", "--seed", "0", "--served-model-name", "tiny",
                "--disable-uvicorn-access-log", *extra_args]
        if kv is not None:
            args += ["--kv-transfer-config", json.dumps(kv)]
        e = dict(os.environ, **BASE_ENV, VLLM_CPU_OMP_THREADS_BIND=str(cpu),
                 PYTHONPATH=os.pathsep.join((str(ROOT / "tools" / "nospin"), str(ROOT),
                                             os.environ.get("PYTHONPATH", ""))))
        e.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        e.update(env or {})
        self.log = log
        self._logf = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self._logf, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 600.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log {self.log}:\n"
                                   + self.log.read_text(errors="replace")[-4000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready in {timeout} s; log {self.log}")

    def pause(self) -> None:
        """SIGSTOP every process of the server (an embedded bootstrap server too): it stops answering, its
        connections stay open."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
                os.killpg(self.proc.pid, signal.SIGCONT)  # a paused server handles SIGTERM once it runs
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._logf.close()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def metric(self, name: str) -> float | None:
        return scrape(self.url, name)


# The duty cycle of SlowMotion, in a process of its own: its timing does not wait for the test's GIL (the
# in-process proxy, the test's polling), and it runs real-time where it may. Stops the pids, lets them run
# ``run`` s of every ``run + stop``, until its stdin closes; it leaves them stopped.
_DUTY = """
import os, select, signal, sys, time
run, stop, pids = float(sys.argv[1]), float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
except (OSError, AttributeError):
    pass
def send(sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
while True:
    send(signal.SIGSTOP)
    if select.select([sys.stdin], [], [], stop)[0]:
        break
    send(signal.SIGCONT)
    time.sleep(run)
send(signal.SIGSTOP)
"""


class SlowMotion:
    """A server whose forward runs as on a slow device, for tests that act while prefill still streams a
    request. While the ``with`` block lasts its worker processes (``VLLM::Worker``: the forward, and the
    transport that serves READs) are stopped (SIGSTOP) until ``hold_until()`` holds (say, decode waits for
    the request's pull), then let run ``run_ms`` of every ``run_ms + stop_ms`` (a helper process keeps
    the time); the API server and the engine core (the embedded bootstrap server) run on. Warm, the tiny
    model computes a 1,900-token prompt in 64-token chunks in a few ms of the worker's time, before decode
    has even admitted the request; held, then slowed, prefill is a few steps in when decode reads its
    first piece. With ``run_ms=None`` the workers run at full speed once the hold ends (a forward slowed by
    other means, such as tests.fakes_connector.SlowLayersConnector). On leaving, the workers run again, or
    stay stopped with ``stopped_after=True``."""

    def __init__(self, server: Server, hold_until=None, run_ms: float | None = 2.0, stop_ms: float = 98.0,
                 stopped_after: bool = False):
        import threading

        self.workers = self._workers(server.proc.pid)
        assert self.workers, f"no VLLM::Worker process under server {server.proc.pid}"
        self.hold_until, self.stopped_after = hold_until, stopped_after
        self.run_s, self.stop_s = (None if run_ms is None else run_ms / 1e3), stop_ms / 1e3
        self._done = threading.Event()
        self._duty: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._hold, name="slow-motion", daemon=True)

    @staticmethod
    def _workers(pgid: int) -> list[int]:
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.getpgid(int(entry)) == pgid and Path(f"/proc/{entry}/comm").read_text().startswith(
                            "VLLM::Worker"):
                        out.append(int(entry))
                except (OSError, ProcessLookupError):
                    continue
        return out

    def __enter__(self) -> SlowMotion:
        self._signal(signal.SIGSTOP)
        self._thread.start()
        return self

    def _holds(self) -> bool:
        try:
            return bool(self.hold_until())
        except OSError:  # a scrape that failed: ask again
            return False

    def _hold(self) -> None:
        deadline = time.monotonic() + 60.0  # then on, slowed: the test's own wait reports what never came
        while self.hold_until is not None and not self._holds() and time.monotonic() < deadline:
            if self._done.wait(0.02):
                return
        if self.run_s is None:
            self._signal(signal.SIGCONT)
            return
        self._duty = subprocess.Popen([sys.executable, "-c", _DUTY, str(self.run_s), str(self.stop_s),
                                       *map(str, self.workers)], stdin=subprocess.PIPE)

    def _signal(self, sig: int) -> None:
        for pid in self.workers:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # the test killed the server
                pass

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        if self._duty is not None:
            self._duty.stdin.close()  # it ends with the workers stopped
            self._duty.wait(10)
        self._signal(signal.SIGSTOP if self.stopped_after else signal.SIGCONT)

    def window(self) -> None:
        """After a block left them stopped: let the workers alone run ``run_ms`` (a READ on the wire gets
        its answer; the forward gets at most the step it was sent), then stop them again."""
        self._signal(signal.SIGCONT)
        time.sleep(self.run_s or 0.002)
        self._signal(signal.SIGSTOP)


def held_until_decode_waits(prefill: Server, decode: Server, stopped_after: bool = False,
                            slowed: bool = True) -> SlowMotion:
    """Prefill's forward held until ``decode`` waits for the request's KV, then slowed (SlowMotion; at full
    speed with ``slowed=False``): decode reads the first pieces while prefill still has most of the prompt
    to compute."""
    waiting0 = metric(decode, "kvlink_pulls_in_progress")
    return SlowMotion(prefill, hold_until=lambda: metric(decode, "kvlink_pulls_in_progress") > waiting0,
                      run_ms=2.0 if slowed else None, stopped_after=stopped_after)


def metric(server, name: str) -> float:
    """A server's series on /metrics, 0 when it has none yet."""
    return server.metric(name) or 0.0


def wait_for(cond, timeout: float = 60.0) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def scrape(url: str, name: str) -> float | None:
    """The sum of a Prometheus series over its labels on ``url``/metrics (a server, a bootstrap server)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


# ----- several LLMs in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0: test_inprocess.py, test_sliding_window.py)


class Engines:
    """Named in-process LLMs. vLLM keeps the worker-side connector in a process global (first engine wins), so
    each engine's connector is captured at creation and put back before that engine runs (``generate``).

    Made with recording_kv_config, an engine's connectors keep their stats: ``agents[name].recorded_now()``
    (worker side: pulls) and ``scheduler_connector(name).recorded_now()`` (scheduler side)."""

    def __init__(self, model: str):
        import vllm.distributed.kv_transfer.kv_transfer_state as kts

        self.kts, self.model, self.llms, self.agents = kts, model, {}, {}

    def make(self, name: str, kv: dict | None, **engine) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.kts._KV_CONNECTOR_AGENT = None
        extra = {"kv_transfer_config": KVTransferConfig(**kv)} if kv else {}
        self.llms[name] = LLM(**engine_kwargs(self.model, **extra, **engine))
        self.agents[name] = self.kts._KV_CONNECTOR_AGENT
        self.kts._KV_CONNECTOR_AGENT = None

    def generate(self, name: str, prompts: list[list[int]], params) -> list:
        self.kts._KV_CONNECTOR_AGENT = self.agents[name]
        try:
            return self.llms[name].generate([{"prompt_token_ids": p} for p in prompts], params,
                                            use_tqdm=False)
        finally:
            self.kts._KV_CONNECTOR_AGENT = None

    def scheduler_connector(self, name: str):
        """The engine's scheduler-role connector (a RecordingConnector with recording_kv_config)."""
        return self.llms[name].llm_engine.engine_core.engine_core.scheduler.connector

    def scheduler_side(self, name: str):
        return self.scheduler_connector(name)._sched

    def close(self) -> None:
        import gc

        for name in list(self.llms):
            self.kts._KV_CONNECTOR_AGENT = self.agents[name]
            try:
                self.llms[name].llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001
                pass
        self.kts._KV_CONNECTOR_AGENT = None
        self.llms.clear()
        gc.collect()


def greedy(n: int = 12, params: dict | None = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, extra_args=extra)


def outputs(engines: Engines, name: str, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    """Greedy output tokens of each prompt, all in one batch, no transfer params."""
    return [list(o.outputs[0].token_ids) for o in engines.generate(name, prompts, greedy(n))]


def prefill(engines: Engines, prompts: list[list[int]], name: str = "pre") -> list[dict]:
    """Run the prompts on a prefill engine (one token each); their kv_transfer_params for decode."""
    outs = engines.generate(name, prompts, greedy(1, {"do_remote_decode": True}))
    return [o.kv_transfer_params for o in outs]


def decode(engines: Engines, name: str, prompts: list[list[int]], params: list[dict], n: int = 12):
    """Decode each prompt on its own (one pull per generate call); the output tokens per prompt."""
    return [list(engines.generate(name, [p], greedy(n, kp))[0].outputs[0].token_ids)
            for p, kp in zip(prompts, params)]


def complete(url, prompt, params=None, max_tokens=10, timeout=60.0, stream=False):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if params is not None:
        body["kv_transfer_params"] = params
    if stream:
        import json

        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            chunks = [ln[6:] for ln in r.read().decode().split("\n") if ln.startswith("data: ")]
        return "".join(json.loads(c)["choices"][0]["text"] for c in chunks if c != "[DONE]")
    status, out = http_json(url + "/v1/completions", body, timeout=timeout)
    assert status == 200, out
    return out


def text(out):
    return out["choices"][0]["text"]


def open_completion(url, prompt, params=None, max_tokens=10):
    """Send a completion request and leave its answer unread: ``close()`` the connection to hang up
    (vLLM aborts the request)."""
    import http.client

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def assert_each_streamed(url: str, prefill: Server, decode: Server, sizes, prompts, want) -> None:
    """Each prompt through the PD endpoint ``url`` equals ``want``, and for each prompt of 2 tokens or more
    (decode loads all but the last: a block, partial or full, to read) prefill sent pieces and decode read
    blocks before prefill published it; no pull failed. One prompt at a time, so the counters' moves are
    that prompt's.

    Prefill's connector must slow its streaming forward (tests.fakes_connector.SlowLayersConnector); its
    workers are also held until decode waits for the prompt's KV: on a fast host the tiny model's forward
    and its 150 ms a layer could end before a busy decode had admitted the request (CI saw it)."""
    for n, prompt, expected in zip(sizes, prompts, want):
        streamed0 = metric(decode, "kvlink_blocks_streamed_total")
        sent0 = metric(prefill, "kvlink_pieces_sent_total")
        if n >= 2:
            with held_until_decode_waits(prefill, decode, slowed=False):
                got = text(complete(url, prompt, timeout=120))
        else:  # decode loads nothing: nothing to wait for, nothing streams
            got = text(complete(url, prompt, timeout=120))
        assert got == expected, f"{n} tokens"
        if n >= 2:
            assert metric(decode, "kvlink_blocks_streamed_total") > streamed0, f"{n} tokens: decode read none early"
            assert metric(prefill, "kvlink_pieces_sent_total") > sent0, f"{n} tokens: prefill sent no piece"
    assert metric(decode, "kvlink_pulls_failed_total") == 0


def concurrent_legs(bootstrap: str, engine_id: str, transfer_id: str) -> tuple[dict, dict]:
    """The kv_transfer_params of a concurrent pair, as the proxy builds them: (prefill's, decode's)."""
    from kvlink.vllm.params import PrefillRequest, RemoteSource

    return (PrefillRequest(transfer_id).to_params(),
            RemoteSource(bootstrap_url=bootstrap, engine_id=engine_id, transfer_id=transfer_id).to_params())


# ----- driving a KVLinkWorker directly (tests/vllm/test_worker.py, test_tp.py) -----------------------------


def submit_pull(worker, url: str, rid: str, pairs: list[tuple[int, int]], engine_id: str = "pre") -> None:
    """Hand a decode worker the sequential params of prefill request ``p-<rid>``: (local, remote) blocks."""
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    src = RemoteSource(bootstrap_url=url, engine_id=engine_id, request_id="p-" + rid,
                       block_ids=tuple(r for _, r in pairs), lease_s=30.0)
    worker._submit(PullSpec(request_id=rid, local_block_ids=tuple(lb for lb, _ in pairs), first_block=0,
                            source=src))


def register_two_layers(pre, dec, url: str, blocks: int, heads: int, block: int, head2: int) -> None:
    """Two attention layers on each worker, each side's layers views of one allocation (as vLLM lays
    them out): prefill's random, decode's zeroed; prefill registered with the bootstrap server ``url``."""
    import torch

    src = torch.randint(-100, 100, (2, blocks, heads, block, head2)).to(torch.bfloat16)
    pre.register_kv_caches({f"model.layers.{i}.self_attn.attn": src[i] for i in range(2)})
    dst = torch.zeros_like(src)
    dec.register_kv_caches({f"model.layers.{i}.self_attn.attn": dst[i] for i in range(2)})
    pre._ensure_registered(url)


def pull_outcome(worker, rid: str, wait_s: float = 20.0) -> str:
    """'ok' or 'failed' once the worker reports the request, else 'still waiting' after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        _, recving, failed = worker.transfer_results()
        if rid in failed:
            return "failed"
        if rid in recving:
            return "ok"
        time.sleep(0.01)
    return "still waiting"


def concurrent_proxy(prefill_url: str, decode_url: str, bootstrap_port: int, engine_id: str | None = None,
                     mode: str = "concurrent"):
    """kvlink's proxy in this process (an AppThread: ``.url``, ``.stop()``), in front of one prefill (its
    embedded bootstrap server on ``bootstrap_port``, engine ``engine_id``; None: decode finds the engine by
    the transfer id) and one decode; ``mode`` "sequential": the whole request published, nothing streamed."""
    from kvlink.proxy.config import ProxyConfig
    from kvlink.proxy.router import build_app
    from tests.fakes_vllm_server import AppThread

    pairing = dict(prefill_bootstrap=(f"http://127.0.0.1:{bootstrap_port}",),
                   prefill_engine_ids=(engine_id,) if engine_id else ()) if mode == "concurrent" else {}
    return AppThread(build_app(ProxyConfig(prefill=(prefill_url,), decode=(decode_url,), mode=mode, timeout_s=120,
                                           **pairing)))


STREAM_CHUNK_ARGS = ("--max-num-batched-tokens", "64", "--max-num-seqs", "16")  # a 500-token prompt: 8 steps


@contextlib.contextmanager
def streamed_stack(model: str, logs: Path, engine_id: str, args=(), **backend):
    """Three servers of ``model`` (``args`` added to each): a prefill streaming every layer of every 64-token
    chunk, a decode, and a decode whose connector corrupts what it pulled (the negative control; without
    params, a single server). Both decodes compute in prefill's chunks too, so as the single server they
    round a prompt's KV as prefill did. ``backend``: more connector settings of all three (a transport).
    Yields the servers and proxies: "conc" and "conc_bad" (concurrent pairing), "seq" (sequential)."""
    bport = free_port()
    pre = Server(model, dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=20.0, stream_kv=True, **backend),
                             engine_id=engine_id), cpu=0, log=logs / "prefill.log",
                 extra_args=STREAM_CHUNK_ARGS + tuple(args))
    dec = Server(model, dict(kv_config("kv_consumer", lookup_wait_s=10.0, transfer_timeout_s=10.0,
                                       pull_timeout_s=20.0, **backend), kv_load_failure_policy="recompute"),
                 cpu=1, log=logs / "decode.log", extra_args=STREAM_CHUNK_ARGS + tuple(args))
    bad = Server(model, corrupting_kv_config(lookup_wait_s=10.0, **backend), cpu=1, log=logs / "corrupt.log",
                 extra_args=STREAM_CHUNK_ARGS + tuple(args))
    with proxied(pre, (dec, bad), ((dec, "concurrent"), (bad, "concurrent"), (dec, "sequential")), bport,
                 engine_id) as (conc, conc_bad, seq):
        yield {"pre": pre, "dec": dec, "bad": bad, "conc": conc, "conc_bad": conc_bad, "seq": seq}


@contextlib.contextmanager
def proxied(pre: Server, others, routes, bport: int, engine_id: str):
    """Once ``pre`` and ``others`` are ready, kvlink's proxy for each (decode server, mode) of ``routes`` in
    front of ``pre`` (its embedded bootstrap server on ``bport``); yields their URLs in that order. Stops the
    proxies and every server at the end."""
    servers, proxies = (pre, *others), []
    try:
        for s in servers:
            s.wait_ready()
        for decode, mode in routes:
            proxies.append(concurrent_proxy(pre.url, decode.url, bport, engine_id, mode))
        yield tuple(p.url for p in proxies)
    finally:
        for p in proxies:
            p.stop()
        for s in servers:
            s.stop()


# Every server chunks alike (the same KV, bit for bit) and computes in float32, so that TP=2 sums what TP=1
# does and every server's own answers are the same (in bf16 a TP=2 server answers some prompts otherwise).
PP_ARGS = ("--no-enable-prefix-caching", "--dtype", "float32", *STREAM_CHUNK_ARGS)


def pp_server(model, tmp_path, name: str, pp: int, cpu, bport: int, role: str = "kv_both", tp: int = 1,
              **extra) -> Server:
    """A compiled vLLM server at ``--pipeline-parallel-size pp`` (vLLM CPU runs PP only compiled: test_pp.py)
    whose connector writes noise over what it pulled while ``srv.flag`` exists (the negative controls)."""
    kv = kv_config(role, transport_backend="tcp", engine_lease_s=120.0, bootstrap_host="127.0.0.1",
                   bootstrap_port=bport, stream_kv=role == "kv_both", lookup_wait_s=10.0, pull_timeout_s=60.0,
                   **extra)
    kv.update(kv_connector="SwitchedCorruptingConnector", kv_connector_module_path="tests.fakes_connector",
              kv_load_failure_policy="recompute")
    flag = tmp_path / f"{name}.corrupt"
    srv = Server(model, kv, cpu=cpu, log=tmp_path / f"{name}.log", eager=False,
                 extra_args=(*PP_ARGS, "--pipeline-parallel-size", str(pp), "--tensor-parallel-size", str(tp),
                             "--distributed-executor-backend", "mp"),
                 env={"KVLINK_TEST_CORRUPT_WHILE": str(flag)})
    srv.flag = flag
    return srv


def handed(pre: Server, dec: Server, prompt: list[int]) -> str:
    """``prompt`` prefilled on ``pre`` and decoded on ``dec`` (sequential pairing): decode's answer."""
    params = complete(pre.url, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
    return text(complete(dec.url, prompt, params, timeout=120))


def assert_noise_changes_both_ways(a: Server, b: Server, prompts: list[list[int]]) -> None:
    """Negative control of two pp_server()s: with both flags set, what each pulls from the other is noise, and
    every answer differs from ``b``'s own."""
    own = [text(complete(b.url, p)) for p in prompts]
    a.flag.touch()
    b.flag.touch()
    try:
        assert all(handed(a, b, p) != w for p, w in zip(prompts, own))
        assert all(handed(b, a, p) != w for p, w in zip(prompts, own))
    finally:
        a.flag.unlink()
        b.flag.unlink()
