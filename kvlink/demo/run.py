"""``make demo``: prefill + decode vLLM with KVLinkConnector behind the kvlink proxy, on loopback.

Builds the tiny model if missing, gets reference answers from a single server without the connector,
then starts the PD pair and the proxy, sends the same prompts through it and prints each answer with
the KV bytes moved and the transfer time. Exits non-zero if any answer differs. Every process it starts
is stopped on exit, Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvlink.demo.servers import ProxyProc, Stack, VLLMServer, kvlink_config, post_json
from kvlink.demo.tiny_model import ensure_model

PROMPTS = [
    "The kv cache moves from prefill to decode because",
    "Write one line about the sea:",
    "A block of tokens is " + "transferred and then decoded, " * 20,
    "Count: one two three four five six seven eight nine ten eleven twelve " * 6,
]


def say(msg: str) -> None:
    print(msg, flush=True)


def ask(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return post_json(url + "/v1/completions", body)["choices"][0]["text"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--mode", choices=["sequential", "concurrent"], default="sequential")
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="kvlink-demo-"))
    t_start = time.monotonic()
    say(f"[1/5] model: {ensure_model(args.preset)} (logs in {logs})")
    model = str(ensure_model(args.preset))
    try:
        with Stack() as stack:
            say("[2/5] reference: single vLLM server without the connector ...")
            ref = stack.add(VLLMServer("reference", model, logs, cpu=0))
            ref.wait_ready()
            want = [ask(ref.url, p, args.max_tokens) for p in PROMPTS]
            stack.stop(ref)
            say("[3/5] starting prefill (kv_producer) and decode (kv_consumer) servers ...")
            from kvlink.demo.servers import free_port

            bport = free_port()
            pre = stack.add(VLLMServer("prefill", model, logs, cpu=0,
                                       kv=kvlink_config("kv_producer", "prefill-0", bootstrap_port=bport)))
            dec = stack.add(VLLMServer("decode", model, logs, cpu=1, kv=kvlink_config("kv_consumer")))
            pre.wait_ready()
            dec.wait_ready()
            say(f"      prefill {pre.url}  decode {dec.url}  bootstrap http://127.0.0.1:{bport}")
            proxy = stack.add(ProxyProc(pre.url, dec.url, logs, mode=args.mode,
                                        bootstrap=f"http://127.0.0.1:{bport}"))
            proxy.wait_ready()
            say(f"[4/5] proxy {proxy.url} ({args.mode}); sending {len(PROMPTS)} prompts")
            bad = 0
            for i, (p, w) in enumerate(zip(PROMPTS, want), 1):
                m0 = dec.metrics()
                t0 = time.monotonic()
                got = ask(proxy.url, p, args.max_tokens)
                wall = time.monotonic() - t0
                time.sleep(0.3)  # let the step's stats reach /metrics
                m1 = dec.metrics()
                nbytes = m1.get("kvlink_bytes_pulled_total", 0) - m0.get("kvlink_bytes_pulled_total", 0)
                xfer = m1.get("kvlink_transfer_seconds_sum", 0) - m0.get("kvlink_transfer_seconds_sum", 0)
                ok = got == w
                bad += not ok
                say(f"  [{i}] {'OK  ' if ok else 'DIFF'} {p[:40]!r}... -> {got[:50]!r}")
                say(f"      KV moved {nbytes / 1024:.1f} KiB in {xfer * 1e3:.2f} ms; request {wall * 1e3:.0f} ms")
                if not ok:
                    say(f"      expected {w[:60]!r}")
            say(f"[5/5] {len(PROMPTS) - bad}/{len(PROMPTS)} answers equal the single server "
                f"({time.monotonic() - t_start:.0f} s); stopping everything")
            return 0 if bad == 0 else 1
    except KeyboardInterrupt:
        say("interrupted; all processes stopped")
        return 130
    except Exception as e:  # noqa: BLE001 - a demo: say what failed, processes are stopped by Stack
        say(f"demo failed: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
