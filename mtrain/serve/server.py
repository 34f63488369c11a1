"""The OpenAI front served by uvicorn in a thread of the engine leader (no second copy of the model).

The server's event loop lives in its own thread (`mtrain-openai-front`); it reaches the engine through the
`EngineClient`, whose `generate` may be awaited from any loop (`LocalClient` wraps the engine's thread-safe
`submit`). The trainer's thread keeps running; `start()` returns once the socket listens, `stop()` closes it and
joins the thread. The socket is bound before uvicorn starts (port 0 = an ephemeral port), so the URL is known
at once and no other process can take the port in between.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading

import uvicorn

from mtrain.serve.app import build_app
from mtrain.serve.front import OpenAIFront
from mtrain.serve.timeouts import timed_protocol

log = logging.getLogger(__name__)


class FrontServer:
    """host: 127.0.0.1 by default (only this machine's agents reach it). api_key: None = a fresh per-run key
    (`self.api_key`), "" = no key (loopback only: refused on any other host)."""

    def __init__(self, front: OpenAIFront, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_body_bytes: int = 4 << 20, max_concurrency: int = 256, shutdown_grace_s: float = 5.0,
                 read_timeout_s: float = 30.0):
        if api_key == "" and host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"an OpenAI front on {host} needs an API key (only loopback may run without one)")
        self.front = front
        self.api_key = secrets.token_urlsafe(24) if api_key is None else (api_key or None)
        self.host, self._port = host, port
        self._limits = dict(max_body_bytes=max_body_bytes, max_concurrency=max_concurrency,
                            read_timeout_s=read_timeout_s)
        self.read_timeout_s = float(read_timeout_s)
        self.shutdown_grace_s = float(shutdown_grace_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._app = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.url = ""

    def start(self, timeout_s: float = 30.0) -> str:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        sock.listen(1024)
        port = sock.getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        app = self._app = build_app(self.front, api_key=self.api_key, base_url=self.url, **self._limits)
        # stop() drains first (streams end with an error event), so uvicorn's own cut-off is only a backstop
        cfg = uvicorn.Config(app, log_level=os.environ.get("MTRAIN_FRONT_LOG", "warning"), access_log=False,
                             lifespan="off", timeout_graceful_shutdown=2, http=timed_protocol(self.read_timeout_s),
                             timeout_keep_alive=min(5, max(1, int(self.read_timeout_s))))
        self._server = uvicorn.Server(cfg)
        self._server.install_signal_handlers = lambda: None  # signals belong to the trainer's main thread

        async def run():
            self._loop = asyncio.get_running_loop()
            await self._server.serve(sockets=[sock])

        def serve():
            try:
                asyncio.run(run())
            except BaseException as e:  # noqa: BLE001 - reported by start()/stop()
                self._error = e
                log.exception("OpenAI front stopped with an error")
            finally:
                sock.close()

        self._thread = threading.Thread(target=serve, name="mtrain-openai-front", daemon=True)
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the OpenAI front did not start: {self._error!r}")
            if waited > timeout_s:
                raise RuntimeError(f"the OpenAI front did not start within {timeout_s} s")
            threading.Event().wait(0.01)
            waited += 0.01
        return self.url

    @property
    def base_url(self) -> str:
        """What `openai.AsyncOpenAI(base_url=...)` takes for unrecorded calls."""
        return f"{self.url}/v1"

    def stop(self) -> int:
        """Stop: new requests get 503, running ones get `shutdown_grace_s` to finish, every stream still open then
        ends with an error event; then the socket closes. Returns how many streams were cut."""
        cut = 0
        if self._server is not None and self._loop is not None and self._thread is not None \
                and self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self._app.state.drain(self.shutdown_grace_s), self._loop)
            try:
                cut = fut.result(timeout=self.shutdown_grace_s + 10)
            except Exception as e:  # noqa: BLE001 - still stop the server
                log.warning("OpenAI front: draining before the stop failed: %s", e)
            if cut:
                log.warning("OpenAI front: %d streams were still running after the %g s grace period and ended "
                            "with an error event", cut, self.shutdown_grace_s)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
            if self._thread.is_alive():
                raise RuntimeError("the OpenAI front did not stop within 15 s")
        self._thread = None
        return cut

    def __enter__(self) -> "FrontServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
