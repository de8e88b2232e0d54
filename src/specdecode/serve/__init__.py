"""`specdecode serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine
loop that runs all active requests as ONE batch, admitting and retiring rows between rounds.

    from specdecode.serve import Server
    server = Server.start(gen, model_id="smollm2-135m")   # a background thread, a free port
    print(server.url)                                     # http://127.0.0.1:PORT
    server.stop()
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

from ..engine import SpeculativeGenerator
from ..errors import SpecDecodeError
from .app import create_app
from .loop import EngineLoop
from .metrics import Metrics

__all__ = ["Server", "batch_sizes", "context_length"]


def batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes the load-aware policy's costs are measured at: powers of two, and max_batch."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def context_length(gen: SpeculativeGenerator, default: int = 2048) -> int:
    """The target's context (config.json's max_position_embeddings), else `default`."""
    limit = getattr(gen.target, "max_positions", None)
    if limit:
        return int(limit)
    try:
        cfg = json.loads((Path(gen.target.path) / "config.json").read_text())
        return int(cfg.get("max_position_embeddings") or default)
    except (OSError, ValueError, TypeError):
        return default


class Server:
    """The app, its engine loop, and (after start()) a uvicorn server in a background thread."""

    def __init__(
        self,
        gen: SpeculativeGenerator,
        model_id: str,
        max_batch: int = 32,
        max_queue: int = 256,
        max_model_len: int | None = None,
        default_max_tokens: int = 256,
        sampling_rule: str = "auto",
        max_num_batched_tokens: int | None = None,
        carry_prefill: bool = True,
    ) -> None:
        """sampling_rule: the rule of requests that name none: standard, invariant, or auto
        (invariant for seeded requests, standard otherwise). max_num_batched_tokens: the tokens
        one engine iteration feeds at most, decoding rows and prefill chunks together (None:
        admissions are prefilled whole). carry_prefill: a prompt chunk rides the running rows'
        round (one pass over the weights for both) where the forward is batch-invariant. Prefix
        caching is the generator's (SpeculativeGenerator.enable_prefix_cache)."""
        self.gen = gen
        self.metrics = Metrics()
        self.engine = EngineLoop(
            gen, self.metrics, max_batch, max_queue, max_num_batched_tokens, carry=carry_prefill
        )
        self.max_model_len = max_model_len or context_length(gen)
        self.app = create_app(self.engine, model_id, self.max_model_len, default_max_tokens, sampling_rule)
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self.url = ""

    @classmethod
    def start(
        cls, gen: SpeculativeGenerator, model_id: str, host: str = "127.0.0.1", port: int = 0, **kw
    ) -> Server:
        server = cls(gen, model_id, **kw)
        server.serve_in_background(host, port)
        return server

    def serve_in_background(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """HTTP and the engine loop each in a background thread (tests, notebooks)."""
        self._serve_http(host, port)
        self.engine.start()

    def _serve_http(self, host: str, port: int, log_level: str = "warning") -> None:
        import uvicorn

        # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on sockets whose proto says
        # TCP, and with it on every response waited ~40 ms for the client's delayed ACK between
        # its headers and its body (benchmarks/NOTES.md)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise SpecDecodeError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=2)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        while not self._uvicorn.started and self._thread.is_alive():
            threading.Event().wait(0.02)

    def run(self, host: str, port: int) -> None:
        """Serve until interrupted (Ctrl-C or SIGTERM): HTTP in a background thread, the engine
        loop in this one. The engine must run on the thread that loaded the model: torch's
        OpenMP team belongs to the thread that first used it, and a second thread's team
        competes with the first's spinning workers (measured: 1.7x slower decoding on 2 cores;
        benchmarks/NOTES.md)."""
        import signal

        def terminate(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, terminate)
        self._serve_http(host, port, log_level="info")
        try:
            self.engine.run_here()
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10)
        self.engine.stop()
