"""AsyncEngine: the synchronous `Engine` driven from one background thread, consumed from asyncio.

The thread is the only one that touches the engine (and so JAX). Requests and aborts reach it
through a command queue; each `step()`'s outputs go back to the event loop in one
`call_soon_threadsafe` and are routed to per-request asyncio queues. Cancelling a `generate()`
iterator (a client disconnect) aborts the request, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine failed to load; the server reports 500s and /health goes red."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (finish reason "error", or a step that raised); the engine goes on."""


class AsyncEngine:
    def __init__(self, engine: Any):
        """`engine` is an Engine, or a factory `factory(on_progress)` that builds one; the factory then runs in the
        engine thread, so loading and compiling happen on the same thread as stepping, and reports its progress
        (`Engine`'s `on_progress`) into `status`."""
        self._factory = None if hasattr(engine, "step") else engine
        self.engine = None if self._factory else engine
        self.tokenizer = None
        self.max_model_len = 0
        self.loaded = threading.Event()
        self.status: dict[str, Any] = {"stage": "starting", "progress": 0.0, "detail": ""}
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.dead: BaseException | None = None
        self.stats_snapshot: Any = None
        self.last_step_s = 0.0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def report(self, stage: str, done: int, total: int, detail: str = "") -> None:
        """Where loading stands (the server's /health shows it): one dict replaced at once, so readers on other
        threads always see a consistent one."""
        self.status = {"stage": stage, "progress": round(done / max(total, 1), 4), "detail": detail}

    async def wait_loaded(self) -> None:
        """Return once the engine exists; raise what building it raised."""
        await asyncio.to_thread(self.loaded.wait)
        if self.engine is None:
            raise EngineDeadError(f"engine failed to load: {type(self.dead).__name__}: {self.dead}")

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- engine thread -------------------------------------------------------------------------
    def _refresh_stats(self) -> None:
        try:
            self.stats_snapshot = self.engine.stats()
        except Exception:  # stats are best effort
            log.exception("engine.stats() failed")

    def _run(self) -> None:
        try:
            if self._factory is not None:
                self.engine = self._factory(self.report)
            self.tokenizer = getattr(self.engine, "tokenizer", None)
            self.max_model_len = int(self.engine.max_model_len)
            self._refresh_stats()
        except BaseException as e:  # noqa: BLE001 - reported by wait_loaded()
            log.exception("engine failed to load")
            self.dead = e
            self.engine = None
            return
        finally:
            self.loaded.set()
        while not self._stop:
            self._wake.clear()
            did = self._drain_commands()
            try:
                busy = self.engine.has_unfinished_requests()
                if busy:
                    t0 = time.perf_counter()
                    outs = self.engine.step()
                    self.last_step_s = time.perf_counter() - t0
                    self._refresh_stats()
                    if outs:
                        self._deliver(outs)
                elif did:
                    self._refresh_stats()
            except Exception as e:  # noqa: BLE001 - not attributable to one request: fail those in flight, go on
                log.exception("engine step failed")
                self._fail_all(RequestFailedError(f"the engine step failed: {type(e).__name__}: {e}"))
                busy = False
            if not busy:
                self._wake.wait(0.5)

    def _drain_commands(self) -> bool:
        did = False
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return did
            did = True
            kind = cmd[0]
            if kind == "add":  # all of one API request's choices, or none
                _, requests, fut = cmd
                added = []
                try:
                    for rid, ids, params in requests:
                        self.engine.add_request(rid, ids, params)
                        added.append(rid)
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    for rid in added:
                        self.engine.abort_request(rid)
                    fut.set_exception(e)
                else:
                    fut.set_result(None)
            elif kind == "fail_all":
                self._fail_all(cmd[1])
            elif kind == "abort":
                try:
                    self.engine.abort_request(cmd[1])
                except Exception:  # already finished or unknown: nothing to free
                    log.debug("abort of %s ignored", cmd[1], exc_info=True)

    def _deliver(self, outs: list) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for o in outs:
            entry = self._streams.get(o.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append(o)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._route, batch)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _route(self, batch: list) -> None:
        for o in batch:
            entry = self._streams.get(o.request_id)
            if entry is not None:
                entry[1].put_nowait(o)

    def _fail_all(self, err: BaseException) -> None:
        """Fail every listening request and drop it from the engine (its pages are freed)."""
        for rid, (loop, q) in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # already gone
                log.debug("abort of %s ignored", rid, exc_info=True)
            try:
                loop.call_soon_threadsafe(q.put_nowait, err)
            except RuntimeError:
                pass

    # ---- asyncio side --------------------------------------------------------------------------
    def _submit(self, cmd) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def fail_all(self, err: BaseException) -> None:
        """End every running request with `err` (raised by its stream); the engine stays up (the drain timeout of a
        shutdown)."""
        self._submit(("fail_all", err))

    async def add(self, request_id: str, prompt_ids: list[int], params: Any) -> "RequestStream":
        """Submit a request; returns once the engine accepted it (its `ValueError` otherwise).
        Iterate the returned stream for `StepOutput`s; `close()` it early to abort the request."""
        return (await self.add_many([(request_id, prompt_ids, params)]))[0]

    async def add_many(self, requests: list[tuple[str, list[int], Any]]) -> list["RequestStream"]:
        """Submit several requests (one API request's choices) in one engine command: all are accepted or none
        (the first `ValueError` is raised and the others are not left running)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine failed: {self.dead}")
        ids = [r[0] for r in requests]
        if len(set(ids)) != len(ids) or any(rid in self._streams for rid in ids):
            raise ValueError(f"duplicate request id among {ids}")
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, rid) for rid in ids]
        for s in streams:
            self._streams[s.request_id] = (loop, s.queue)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", [(rid, list(ids_), p) for rid, ids_, p in requests], fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            for s in streams:
                s.close()  # the add may still land: the aborts queued after it remove it
            raise
        except BaseException:
            for s in streams:
                s.finished = True
                s.close()
            raise
        return streams

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any) -> AsyncIterator[Any]:
        """Yield the request's `StepOutput`s until one is finished; cancelling or closing the
        iterator early aborts the request (its KV pages are freed)."""
        stream = await self.add(request_id, prompt_ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def warmup(self, prompts: list[list[int]], params_list: list[Any]) -> float:
        """Run a few short requests through the whole path (compiles the engine's steps)."""
        t0 = time.perf_counter()

        async def one(i, ids, p):
            async for _ in self.generate(f"warmup-{i}", ids, p):
                pass

        await asyncio.gather(*(one(i, ids, p) for i, (ids, p) in enumerate(zip(prompts, params_list))))
        return time.perf_counter() - t0


def stats_dict(stats: Any) -> dict:
    """EngineStats (a dataclass or any object) as a plain dict of numbers."""
    if stats is None:
        return {}
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    if isinstance(stats, dict):
        return dict(stats)
    return {
        k: getattr(stats, k)
        for k in dir(stats)
        if not k.startswith("_") and isinstance(getattr(stats, k, None), (int, float))
    }


class RequestStream:
    """The outputs of one request, in order; ends after the finished output."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished or self.closed:
            raise StopAsyncIteration
        out = await self.queue.get()
        if isinstance(out, BaseException):
            self.finished = True  # the engine dropped it; nothing to abort
            raise out
        if out.finished:
            self.finished = True
            if out.finish_reason == "error":
                raise RequestFailedError(getattr(out, "error", None) or "the request failed in the engine")
        return out

    def close(self) -> None:
        """Stop listening; aborts the request in the engine unless it already finished."""
        if self.closed:
            return
        self.closed = True
        self.engine._streams.pop(self.request_id, None)
        if not self.finished:
            self.engine.abort(self.request_id)
