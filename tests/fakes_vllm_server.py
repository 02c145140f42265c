"""Fake vLLM OpenAI servers, the backends of the PD proxy (kvlink proxy): ``FakeVLLMServer`` scripted per
behavior (ok, hang, errors, broken streams, malformed or refused pairing parameters) and ``RawVLLMServer``
on raw sockets (connection reuse, dropped requests). ``AppThread`` serves an aiohttp app on a thread, as
``kvlink proxy`` serves it (the proxy tests run the proxy itself with it too)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

from aiohttp import web

from kvlink.proxy.router import SERVE_OPTIONS
from kvlink.vllm.params import RemoteSource, refusal


class AppThread:
    """Run an aiohttp app on 127.0.0.1:<ephemeral> in a background thread, served as
    ``kvlink proxy`` serves it (a client that goes away cancels its handler)."""

    def __init__(self, app: web.Application):
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._app = app
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        self._ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _main(self):
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self._app, shutdown_timeout=0.5, **SERVE_OPTIONS)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FakeVLLMServer:
    """A fake vLLM OpenAI server (aiohttp). ``behavior``: ok, no_params, bad_params (prefill answers a malformed
    remote_block_ids), refuse (prefill kept no KV), error500, bad_request, hang, stream_break, slow_stream (six
    events 0.3 s apart), unhealthy, huge (an answer of 6 MiB, as prompt logprobs of a long prompt would be).
    ``cancelled`` counts requests whose client (the proxy) went away while they were being served."""

    def __init__(self, name: str, behavior: str = "ok", bootstrap_url: str = "http://127.0.0.1:1",
                 publish: bool = False, token: str | None = None):
        """``bootstrap_url``: the bootstrap server its prefill answers name; ``publish``: as prefill, it also
        publishes each request there, as engine ``name`` (register it first), under the transfer id if any."""
        self.name, self.behavior, self.bodies, self.cancelled = name, behavior, [], 0
        self.models_auth: list[str | None] = []  # each /v1/models ask's Authorization header
        self.bootstrap_url, self.publish, self.token, self.published = bootstrap_url, publish, token, []
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self.server = AppThread(app)
        self.url = self.server.url

    async def health(self, request):
        return web.Response(status=200 if self.behavior != "unhealthy" else 500)

    async def models(self, request):
        self.models_auth.append(request.headers.get("Authorization"))
        return web.json_response({"data": [{"id": "tiny"}]})

    async def complete(self, request):
        body = await request.json()
        self.bodies.append((request.path, body))
        if self.behavior == "hang":
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if self.behavior == "error500":
            return web.json_response({"error": "boom"}, status=500)
        if self.behavior == "bad_request":
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        if self.behavior == "huge":
            return web.json_response({"choices": [{"text": "x", "logprobs": ["-1.0"] * (1 << 20)}]})
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode") and self.behavior == "refuse":
            out_params = refusal("publish failed: bootstrap unreachable")
        elif params.get("do_remote_decode") and self.behavior != "no_params":
            rid = f"req-{len(self.bodies)}"
            if self.publish:
                await asyncio.to_thread(self._publish, rid, params.get("transfer_id"))
            out_params = RemoteSource(bootstrap_url=self.bootstrap_url, engine_id=self.name, request_id=rid,
                                      block_ids=(1, 2), num_tokens=32, lease_s=30.0).to_params()
            if self.behavior == "bad_params":
                out_params["remote_block_ids"] = [1, -2]
        else:
            out_params = None
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(6 if self.behavior == "slow_stream" else 3):
                if self.behavior == "slow_stream":
                    await asyncio.sleep(0.3)
                await resp.write(f"data: {json.dumps({'i': i, 'from': self.name})}\n\n".encode())
                if self.behavior == "stream_break" and i == 1:
                    request.transport.close()
                    return resp
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"from": self.name, "choices": [{"text": "hi"}],
                                  "kv_transfer_params": out_params, "got": params})

    def _publish(self, rid: str, transfer_id: str | None) -> None:
        from kvlink.bootstrap import BootstrapClient

        with BootstrapClient(self.bootstrap_url, token=self.token) as cli:
            cli.publish(self.name, rid, [[1, 2]], num_tokens=32, lease_s=30.0, transfer_id=transfer_id)
        self.published.append(rid)

    def stop(self):
        self.server.stop()


class RawVLLMServer:
    """A fake vLLM server answering as prefill, keep-alive HTTP/1.1 on raw sockets, for what an HTTP
    framework will not do.
    ``behavior``: "answer" replies to every request with a prefill-style JSON answer and keeps the
    connection; "drop" reads the request and closes without answering. ``connections`` counts the
    connections accepted, ``requests`` the requests read."""

    def __init__(self, behavior: str = "answer"):
        self.behavior, self.connections, self.requests = behavior, 0, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    if not (chunk := conn.recv(65536)):
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                                  if ln.lower().startswith(b"content-length:")))
                while len(buf) < length:
                    if not (chunk := conn.recv(65536)):
                        return
                    buf += chunk
                buf = buf[length:]
                self.requests += 1
                if self.behavior == "drop":
                    return
                params = RemoteSource(bootstrap_url="http://127.0.0.1:1", engine_id="raw", request_id="raw-1",
                                      block_ids=(1,)).to_params()
                out = json.dumps({"choices": [{"text": "hi"}], "kv_transfer_params": params}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(out), out))

    def stop(self):
        self.sock.close()


class ScriptedVLLMServer(FakeVLLMServer):
    """A fake vLLM server whose completions answer comes from ``handler(server, request, body)``, an async
    function the test writes (a backend that misbehaves in one particular way)."""

    def __init__(self, name: str, handler, **kw):
        self.handler = handler
        super().__init__(name, **kw)

    async def complete(self, request):
        body = await request.json()
        self.bodies.append((request.path, body))
        return await self.handler(self, request, body)
