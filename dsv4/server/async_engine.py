"""The engine behind the HTTP server: one thread owns the (not thread-safe) ``LLMEngine``.

The event loop never touches the engine. It sends commands through a thread-safe queue:

* ``add(request_id, prompt, params, arrival, queue, tag)`` -> an awaitable that resolves once the
  engine accepted the request (or raises the engine's ``RequestRejected`` / ``ValueError``);
* ``abort(request_id)`` (a client went away): the engine frees the request's cache blocks.

The engine thread loops: take commands (blocking while there is nothing to run), ``step()``,
and push each ``RequestOutput`` to its request's ``asyncio.Queue`` as ``(tag, output)`` through
``loop.call_soon_threadsafe``. Outputs are cumulative, so a consumer may skip to the newest.
If a step raises, every request in flight gets ``(tag, EngineError)`` and is aborted; a second
failure in a row marks the engine dead (``/health`` then answers 503).

After every batch of commands and every step the thread publishes a snapshot (running / waiting
requests, KV usage and used / cached / free blocks) that ``/metrics``, ``/health`` and the bounded waiting queue read without
touching the engine, and feeds the per-request latency histograms.
"""
from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from .metrics import ServerMetrics


class EngineError(RuntimeError):
    """A request failed because the engine step raised, or the engine is dead."""


@dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: Any
    arrival: float
    prompt_tokens: int = 0
    n: int = 1
    first_token: float | None = None
    last_token: float | None = None
    last_count: int = 0


@dataclass
class Snapshot:
    running: int = 0          # requests with a running sequence
    waiting: int = 0          # requests with no running sequence yet
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    steps: int = 0
    blocks: dict = field(default_factory=dict)   # {"used" | "cached" | "free": KV blocks}
    extra: dict = field(default_factory=dict)


def _phases(route: _Route, scheduled: float | None) -> dict:
    """vLLM's per-request intervals (s) that a finished request has: queue (arrival -> first
    scheduled), prefill (-> first token), decode (first -> last token), inference (first scheduled
    -> last token)."""
    out = {}
    if scheduled is not None:
        out["queue"] = scheduled - route.arrival
        if route.first_token is not None:
            out["prefill"] = route.first_token - scheduled
            out["inference"] = route.last_token - scheduled
    if route.first_token is not None:
        out["decode"] = route.last_token - route.first_token
    return out


def _put(q: asyncio.Queue, item) -> None:
    q.put_nowait(item)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _copy_stats(st: dict) -> dict:
    """The engine's counters as they are now (its per-position list copied too)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in st.items()}


class AsyncEngine:
    def __init__(self, engine, metrics: ServerMetrics | None = None, log: bool = True):
        self.engine = engine
        self.metrics = metrics
        self.log = log
        self._cmds: queue.Queue = queue.Queue()
        self._routes: dict[str, _Route] = {}       # engine thread only
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending_adds = 0                    # add commands not yet taken by the engine thread
        self.snapshot = Snapshot()
        self.dead: str | None = None              # reason, once the engine cannot run any more
        self._stats0 = _copy_stats(getattr(engine, "stats", {}) or {})
        self._preempt0 = getattr(getattr(engine, "scheduler", None), "num_preemptions", 0)
        self._publish()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._cmds.put(("stop",))
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self.dead is None and (self._thread is None or self._thread.is_alive())

    # ------------------------------------------------------------------ event-loop side
    def num_waiting(self) -> int:
        """Requests not yet running: waiting in the engine, plus adds still in the command queue."""
        with self._lock:
            pending = self._pending_adds
        return self.snapshot.waiting + pending

    async def add(self, request_id: str, prompt, params, arrival: float, out_queue: asyncio.Queue,
                  tag: Any = None, prompt_tokens: int = 0) -> None:
        """Queue a request; returns once the engine accepted it. Outputs go to ``out_queue``."""
        if not self.alive:
            raise EngineError(f"the engine is not running ({self.dead or 'stopped'})")
        self.start()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._pending_adds += 1
        self._cmds.put(("add", request_id, prompt, params, arrival, _Route(loop, out_queue, tag, arrival,
                                                                           prompt_tokens, params.n), fut))
        await fut

    def abort(self, request_id: str) -> None:
        """Abort (idempotent; a finished or unknown request is ignored). Callable from any thread."""
        self._cmds.put(("abort", request_id))

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        eng = self.engine
        import torch
        torch.set_num_threads(getattr(eng, "num_threads", torch.get_num_threads()))    # the engine's rule, on its thread
        flush = False
        while True:
            idle = self.dead is not None or (not flush and not eng.has_unfinished_requests())
            cmds = []
            try:
                cmds.append(self._cmds.get() if idle else self._cmds.get_nowait())
                while True:
                    cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                pass
            for c in cmds:
                if c[0] == "stop":
                    self._fail_all(EngineError("the server is shutting down"))
                    return
                if c[0] == "add":
                    flush |= self._do_add(*c[1:])
                elif c[0] == "abort":
                    rid = c[1]
                    if self._routes.pop(rid, None) is not None:
                        try:
                            eng.abort_request(rid)
                        except Exception:   # noqa: BLE001 - never let one request kill the loop
                            traceback.print_exc()
                        flush = True
            if cmds:
                self._publish()
            if self.dead is not None:
                continue
            if flush or eng.has_unfinished_requests():
                flush = False
                st = eng.stats
                before = st.get("prompt_tokens", 0) + st.get("generation_tokens", 0)
                try:
                    outs = eng.step()
                except Exception as e:  # noqa: BLE001
                    self._step_failed(e)
                    continue
                done = st.get("prompt_tokens", 0) + st.get("generation_tokens", 0) - before
                if self.metrics is not None and done > 0:
                    self.metrics.iteration(done)
                self._dispatch(outs)

    def _do_add(self, rid, prompt, params, arrival, route: _Route, fut) -> bool:
        with self._lock:
            self._pending_adds -= 1
        exc = None
        if self.dead is not None:
            exc = EngineError(f"the engine is dead ({self.dead})")
        else:
            try:
                self.engine.add_request(rid, prompt, params, arrival=arrival)
                self._routes[rid] = route
            except Exception as e:  # noqa: BLE001 - RequestRejected, ValueError, or a bug: to the client
                exc = e
        try:
            route.loop.call_soon_threadsafe(_resolve, fut, exc)
        except RuntimeError:        # the loop is closed
            self._routes.pop(rid, None)
            if exc is None:
                self.engine.abort_request(rid)
                return True
        return False

    def _dispatch(self, outs) -> None:
        """Record metrics and publish the snapshot first, then deliver: a client that has its
        result also sees it in /metrics."""
        now = time.monotonic()
        m = self.metrics
        deliver = []
        for out in outs:
            route = self._routes.get(out.request_id)
            ntok = sum(len(o.token_ids) for o in out.outputs)
            if route is not None:
                if ntok > route.last_count:
                    if route.first_token is None:
                        route.first_token = now
                        if m:
                            m.first_token(now - route.arrival)
                    elif m:
                        m.inter_token(now - route.last_token)
                    route.last_token, route.last_count = now, ntok
                deliver.append((route, out))
            if out.finished:
                self._routes.pop(out.request_id, None)
                if m:
                    reasons = [o.finish_reason for o in out.outputs]
                    reason = "error" if "error" in reasons else (reasons[0] if reasons else None)
                    if route is None:
                        reason = "abort"
                    om = out.metrics or {}
                    arrival = om.get("arrival")
                    e2e = now - (route.arrival if route else (arrival or now))
                    ttft = (route.first_token - route.arrival) if route and route.first_token else None
                    m.finished(reason, e2e, len(out.prompt_token_ids), ntok, ttft,
                               _phases(route, om.get("first_scheduled_time")) if route else None,
                               route.n if route else None, om.get("max_tokens"))
        self._publish()
        for route, out in deliver:
            try:
                route.loop.call_soon_threadsafe(_put, route.queue, (route.tag, out))
            except RuntimeError:
                pass

    def _step_failed(self, e: Exception) -> None:
        print("dsv4 serve: engine step failed:", file=sys.stderr)
        traceback.print_exception(e)
        err = EngineError(f"engine step failed: {type(e).__name__}: {e}")
        rids = list(self._routes)
        self._fail_all(err)
        try:
            for rid in rids:
                self.engine.abort_request(rid)
            self.engine.step()
        except Exception as e2:  # noqa: BLE001
            self.dead = f"{type(e2).__name__}: {e2}"
            print(f"dsv4 serve: the engine cannot recover ({self.dead}); /health now answers 503",
                  file=sys.stderr)
        self._publish()

    def _fail_all(self, err: Exception) -> None:
        for rid, route in list(self._routes.items()):
            try:
                route.loop.call_soon_threadsafe(_put, route.queue, (route.tag, err))
            except RuntimeError:
                pass
        self._routes.clear()
        # adds still queued behind: reject them
        try:
            while True:
                c = self._cmds.get_nowait()
                if c[0] == "add":
                    with self._lock:
                        self._pending_adds -= 1
                    try:
                        c[5].loop.call_soon_threadsafe(_resolve, c[6], err)
                    except RuntimeError:
                        pass
        except queue.Empty:
            pass

    def _publish(self) -> None:
        eng = self.engine
        try:
            sched = eng.scheduler
            running = len({s.request_id for s in sched.running})
            waiting = len({s.request_id for s in sched.waiting} - {s.request_id for s in sched.running})
            cache = eng.cache
            free, cached = int(cache.num_free_blocks), int(getattr(cache, "num_cached_free_blocks", 0))
            used = int(cache.num_blocks) - int(getattr(cache, "reserved_blocks", 0)) - free
            snap = Snapshot(running, waiting, float(cache.usage()), free, int(cache.num_blocks),
                            int(eng.stats.get("steps", 0)), {"used": used, "cached": cached, "free": free - cached})
        except Exception:  # noqa: BLE001 - a snapshot must never kill the engine thread
            return
        self.snapshot = snap
        if self.metrics is not None:
            st = eng.stats
            s0 = self._stats0
            pre = getattr(eng.scheduler, "num_preemptions", 0)
            self.metrics.tokens(st.get("prompt_tokens", 0) - s0.get("prompt_tokens", 0),
                                st.get("generation_tokens", 0) - s0.get("generation_tokens", 0),
                                pre - self._preempt0)
            pos, pos0 = st.get("spec_accepted_per_pos", []), s0.get("spec_accepted_per_pos", [])
            self.metrics.spec_decode(*(st.get(k, 0) - s0.get(k, 0) for k in
                                       ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")),
                                     [a - (pos0[i] if i < len(pos0) else 0) for i, a in enumerate(pos)])
            self.metrics.prefix_cache(st.get("prefix_cache_queries", 0) - s0.get("prefix_cache_queries", 0),
                                      st.get("prefix_cache_hits", 0) - s0.get("prefix_cache_hits", 0))
            self._stats0 = _copy_stats(st)
            self._preempt0 = pre
