"""HTTP server of the kit's embedded CPU reference target (FastAPI + uvicorn).

It speaks SGLang's native API (``/generate``, ``/health``, ``/health_generate``,
``/flush_cache``, ``/server_info``, ``/metrics``, ``/open_session``, ``/close_session``,
``/abort_request``) and OpenAI's ``/v1/completions`` over the kit's own engine
(``engine.py``); it is not SGLang.  Start: ``python -m conformance.reference.server
--model tiny-qwen3-next --strategy extra_buffer_lazy --port 0`` (prints
``ready: http://127.0.0.1:PORT`` once listening).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
import time

from conformance.errors import KitError
from conformance.reference.engine import STRATEGIES, Engine, EngineConfig, validate_config
from conformance.reference.faults import FaultSwitch
from conformance.reference.routes import create_app
from conformance.reference.loader import known_models, load_model

log = logging.getLogger("sglang.srt.entrypoints.http_server")
REQUEST_TIMEOUT_S = 600.0


class EngineRunner:
    """Runs ``engine.step()`` in one background thread; requests wait on asyncio futures."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Condition(engine.lock)
        #: The engine's stats as of its last step or call, read by /metrics without the engine
        #: lock (SGLang's metrics never wait for a scheduler iteration either).
        self.stats: dict = engine.stats()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._wake:
                if self._stop:
                    return
                try:
                    busy = self.engine.step()
                except Exception as exc:  # a crashed scheduler is a dead server, like SGLang's
                    log.exception("scheduler crashed")
                    self.engine.dead = f"scheduler exception: {exc}"
                    self._fail_all(str(exc))
                    busy = False
                self.stats = self.engine.stats()
                if not busy:
                    self._wake.wait(timeout=0.05)
            if busy:
                # Let /metrics, /flush_cache and session calls take the (unfair) lock between
                # steps, as SGLang answers them between scheduler iterations.
                time.sleep(0.0005)

    def _fail_all(self, msg: str) -> None:
        for req in [*self.engine.waiting, *self.engine.running]:
            req.error = msg
            if req.on_done:
                req.on_done(req)
        self.engine.waiting.clear()
        self.engine.running.clear()

    def call(self, fn, *args):
        """Run ``fn(*args)`` under the engine lock (sessions, flush, abort, stats)."""
        with self._wake:
            out = fn(*args)
            self.stats = self.engine.stats()
            self._wake.notify_all()
            return out

    async def run(self, reqs, timeout: float = REQUEST_TIMEOUT_S):
        """Submit ``reqs`` and wait for all of them; aborts them on timeout."""
        loop = asyncio.get_running_loop()
        futures = []
        for req in reqs:
            fut = loop.create_future()
            req.on_done = lambda r, f=fut: loop.call_soon_threadsafe(lambda: f.done() or f.set_result(r))
            futures.append(fut)
        with self._wake:
            for req in reqs:
                self.engine.submit(req)
            self._wake.notify_all()
        try:
            return await asyncio.wait_for(asyncio.gather(*futures), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            for req in reqs:
                self.call(self.engine.abort, req.rid)
            raise


    async def stream(self, req, timeout: float = REQUEST_TIMEOUT_S):
        """Submit ``req``; yield it after each new output token and once more when it finished.
        Aborts it when the consumer goes away (client disconnect) or on timeout."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req.on_token = lambda r: loop.call_soon_threadsafe(events.put_nowait, False)
        req.on_done = lambda r: loop.call_soon_threadsafe(events.put_nowait, True)
        with self._wake:
            self.engine.submit(req)
            self._wake.notify_all()
        finished = False
        try:
            deadline = loop.time() + timeout
            while not finished:
                finished = await asyncio.wait_for(events.get(), max(deadline - loop.time(), 0.001))
                if finished or events.empty():  # coalesce tokens that arrived together
                    yield req
        finally:
            if not finished:
                self.call(self.engine.abort, req.rid)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="hybrid-conformance serve", description="Serve a tiny twin with SGLang's HTTP API.")
    p.add_argument("--model", required=True, help="twin name (tiny-qwen3-next, ..., or toy)")
    p.add_argument("--strategy", default="no_buffer", help=f"one of {', '.join(STRATEGIES)}")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--track-interval", type=int, default=256)
    p.add_argument("--max-mamba-slots", type=int, default=64)
    p.add_argument("--max-running-requests", type=int, default=48)
    p.add_argument("--kv-tokens", type=int, default=262144)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (see the ready line)")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_engine(args: argparse.Namespace, faults: FaultSwitch) -> Engine:
    if args.strategy not in STRATEGIES:
        raise KitError(f"unknown strategy {args.strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if args.model not in known_models():
        raise KitError(f"unknown model {args.model!r}; known: {', '.join(known_models())}")
    cfg = EngineConfig(
        strategy=args.strategy, page_size=args.page_size, track_interval=args.track_interval,
        max_mamba_slots=args.max_mamba_slots, max_running_requests=args.max_running_requests,
        kv_tokens=args.kv_tokens, disable_radix_cache=args.disable_radix_cache,
    )
    validate_config(cfg, cfg.page_size)  # flag errors before the model load; the chunk rule after
    return Engine(load_model(args.model), cfg, faults)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()), stream=sys.stderr,
        format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
    )
    for noisy in ("uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


async def _serve(app, host: str, port: int, log_level: str) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve())
    for _ in range(600):
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()[1]
        print(f"ready: http://{host}:{bound}", flush=True)
        log.info("The server is fired up and ready to roll!")
    await task
    if not server.started:
        raise KitError(f"could not listen on {host}:{port}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level)
    try:
        import torch

        torch.set_num_threads(1)
        faults = FaultSwitch.from_env()
        engine = build_engine(args, faults)
    except KitError as exc:
        print(f"hybrid-conformance serve: error: {exc}", file=sys.stderr)
        return 2
    if faults.name or faults.lazy_alloc_fail:
        log.warning("seeded fault active: %r", faults)
    return run_app(engine, lambda runner: create_app(runner, args, faults), args, prog="hybrid-conformance serve")


def run_app(engine: Engine, make_app, args: argparse.Namespace, *, prog: str) -> int:
    """Run the engine's scheduler thread and serve ``make_app(runner)`` until shutdown."""
    runner = EngineRunner(engine)
    runner.start()
    app = make_app(runner)
    try:
        asyncio.run(_serve(app, args.host, args.port, args.log_level))
    except KitError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
