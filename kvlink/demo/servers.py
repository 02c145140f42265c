"""Start and stop local vLLM OpenAI servers and the kvlink proxy (demo and benchmark helper).

Every process runs in its own process group and is killed with it; ``Stack`` stops everything it
started on exit, including on Ctrl-C and on failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvlink.demo.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def kvlink_config(role: str, engine_id: str | None = None, **extra) -> dict:
    cfg = {"kv_connector": "KVLinkConnector", "kv_connector_module_path": "kvlink.vllm", "kv_role": role,
           "kv_connector_extra_config": extra}
    if engine_id:
        cfg["engine_id"] = engine_id
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


class Proc:
    def __init__(self, name: str, args: list[str], log: Path, env: dict | None = None):
        self.name, self.log = name, log
        e = dict(os.environ, **ENV)
        e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
        e.update(env or {})
        self._logf = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self._logf, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._logf.close()


class VLLMServer(Proc):
    def __init__(self, name: str, model: str, log_dir: Path, kv: dict | None = None, cpu: int | None = None,
                 block_size: int = 32, max_model_len: int = 4096, kv_bytes: int = 512 << 20,
                 env: dict | None = None, extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "bfloat16", "--enforce-eager", "--kv-cache-memory-bytes", str(kv_bytes),
                "--block-size", str(block_size), "--max-model-len", str(max_model_len), "--seed", "0",
                "--disable-uvicorn-access-log", *extra_args]
        if kv is not None:
            args += ["--kv-transfer-config", json.dumps(kv)]
        e = dict(env or {})
        if cpu is not None:
            e["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
        super().__init__(name, args, log_dir / f"{name}.log", e)

    def wait_ready(self, timeout: float = 600.0) -> None:
        wait_http(self.url + "/health", timeout, self)

    def metrics(self, prefixes: tuple[str, ...] = ("kvlink_", "nixl", "vllm:nixl")) -> dict[str, float]:
        """The server's /metrics lines whose names start with one of ``prefixes``, summed over labels."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(prefixes):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


class ProxyProc(Proc):
    def __init__(self, prefill: str, decode: str, log_dir: Path, mode: str = "sequential",
                 bootstrap: str | None = None, env: dict | None = None, name: str = "proxy"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "kvlink.proxy", "--prefill", prefill, "--decode", decode,
                "--port", str(self.port), "--mode", mode]
        if bootstrap:
            args += ["--prefill-bootstrap", bootstrap]
        super().__init__(name, args, log_dir / f"{name}.log", env)

    def wait_ready(self, timeout: float = 30.0) -> None:
        wait_http(self.url + "/health", timeout, self)


def wait_http(url: str, timeout: float, proc: Proc) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not proc.alive():
            tail = proc.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}; log {proc.log}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{proc.name} not ready after {timeout:.0f} s; log {proc.log}")


class Stack:
    """Context manager owning processes: stops all of them on exit, whatever happened."""

    def __init__(self):
        self.procs: list[Proc] = []

    def add(self, p: Proc) -> Proc:
        self.procs.append(p)
        return p

    def stop(self, p: Proc) -> None:
        p.stop()
        if p in self.procs:
            self.procs.remove(p)

    def __enter__(self) -> "Stack":
        self._old = signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        return self

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()
        signal.signal(signal.SIGTERM, self._old)


def post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
