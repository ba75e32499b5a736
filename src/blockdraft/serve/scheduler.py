"""The request scheduler: a bounded queue in front of one background worker thread that owns the Engine.

Threads: any number of submitters (the HTTP event loop, test threads) call `submit` / `cancel`; ONE worker thread
moves queued requests into the engine while it has free rows, calls `engine.step()` and routes each row's text
deltas to its `RequestHandle`. A handle delivers events either through a thread-safe `queue.Queue` (blocking
iteration) or, when created with an asyncio loop, through an `asyncio.Queue` fed with `call_soon_threadsafe`
(so the event loop never blocks on the worker).

Capacity: at most `max_batch` requests decode at once and at most `max_queue` wait; `submit` beyond that raises
`QueueFullError` (the server answers 429 with Retry-After).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass

from ..config import GenerationConfig, SamplingParams
from ..decode.engine import Engine
from ..decode.stats import DecodeStats, GenerationResult

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The scheduler's queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SchedulerClosedError(RuntimeError):
    """The scheduler is shutting down (or its worker died) and accepts no requests."""


@dataclass
class Event:
    kind: str  # "delta" | "done" | "error"
    text: str = ""
    result: GenerationResult | None = None
    error: str | None = None


class RequestHandle:
    """One submitted request. Iterate it (blocking) for text deltas, or `async for` over `aiter()` in an event loop;
    `result` is set when it is done (finish_reason "stop", "length" or "cancelled"), `error` if it failed."""

    def __init__(self, prompt_ids, config: GenerationConfig, sampling: SamplingParams,
                 loop: asyncio.AbstractEventLoop | None = None, on_finish=None) -> None:
        self.id = uuid.uuid4().hex
        self.prompt_ids = list(prompt_ids)
        self.config = config
        self.sampling = sampling
        self.result: GenerationResult | None = None
        self.error: str | None = None
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._on_finish = on_finish
        self._loop = loop
        self._q: queue.Queue | None = None if loop else queue.Queue()
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop else None
        self._closed = False

    @property
    def done(self) -> bool:
        return self._closed

    def _push(self, ev: Event) -> None:
        if self._closed:
            return
        if ev.kind == "done":
            self.result = ev.result
        if ev.kind == "error":
            self.error = ev.error
        if ev.kind == "delta" and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if ev.kind in ("done", "error"):
            self.finished_at = time.perf_counter()
            self._closed = True
            if self._on_finish is not None:
                try:
                    self._on_finish(self)
                except Exception:  # noqa: BLE001 - a metrics hook must never fail a request or the worker
                    log.exception("on_finish hook failed")
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        else:
            self._q.put(ev)

    # ----------------------------------------------------------------------------------- consuming events
    def events(self, timeout: float | None = None):
        """Blocking iterator over events (handles made without a loop)."""
        assert self._q is not None, "this handle delivers to an asyncio loop: use aevents()"
        while True:
            ev = self._q.get(timeout=timeout)
            yield ev
            if ev.kind in ("done", "error"):
                return

    async def aevents(self):
        assert self._aq is not None, "this handle was made without a loop: use events()"
        while True:
            ev = await self._aq.get()
            yield ev
            if ev.kind in ("done", "error"):
                return

    def __iter__(self):
        """Text deltas; raises RuntimeError if the request failed."""
        for ev in self.events():
            if ev.kind == "error":
                raise RuntimeError(ev.error)
            if ev.text:
                yield ev.text

    def wait(self, timeout: float | None = None) -> GenerationResult:
        for _ in self.events(timeout):
            pass
        if self.error is not None:
            raise RuntimeError(self.error)
        assert self.result is not None
        return self.result


class Scheduler:
    """Owns `engine` (an Engine) through one worker thread. `step_delay` (seconds, testing aid) sleeps after
    every engine step so that tests can hold requests in flight. `on_finish(handle)` is called exactly once per
    submitted request when it ends (done, cancelled or failed), from whichever thread ended it."""

    def __init__(self, engine: Engine, max_queue: int = 16, step_delay: float = 0.0, on_finish=None) -> None:
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine = engine
        self.max_batch = engine.max_batch
        self.max_queue = max_queue
        self.step_delay = step_delay
        self.on_finish = on_finish
        self._cv = threading.Condition()
        self._inbox: collections.deque[RequestHandle] = collections.deque()
        self._running: dict[str, RequestHandle] = {}
        self._cancels: set[str] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._done = threading.Event()  # the worker loop has returned
        self._step_seconds = collections.deque(maxlen=50)
        self.counters = collections.Counter()

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> "Scheduler":
        """Run the worker in a thread of its own (nothing to do once `run` owns the calling thread)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="blockdraft-scheduler", daemon=True)
            self._thread.start()
        return self

    def claim(self) -> "Scheduler":
        """Reserve the calling thread for the worker (`run` follows): a `start` from elsewhere then does nothing."""
        if self._thread is not None and self._thread is not threading.current_thread():
            raise RuntimeError("the scheduler already runs in another thread")
        self._thread = threading.current_thread()
        return self

    def run(self) -> None:
        """Run the worker in the calling thread until `stop`. The server runs it in the main thread, where the model
        was loaded: on a 2-core machine the same decode step ran slower in another thread than in the one whose
        OpenMP pool did the loading (the two thread pools contend for the cores)."""
        self.claim()
        self._run()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._done.wait(timeout)
        with self._cv:
            left = list(self._inbox) + list(self._running.values())
            self._inbox.clear()
            self._running.clear()
        for h in left:
            h._push(Event("error", error="the server is shutting down"))

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._done.is_set()
                and not self._stopping)

    # ------------------------------------------------------------------------------------------ submitting
    def submit(self, prompt_ids, config: GenerationConfig, sampling: SamplingParams,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        handle = RequestHandle(prompt_ids, config, sampling, loop, self.on_finish)
        with self._cv:
            if not self.alive:
                raise SchedulerClosedError("the scheduler is not running")
            if len(self._running) + len(self._inbox) >= self.max_batch + self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFullError(f"the server is at capacity ({self.max_batch} decoding, {len(self._inbox)} "
                                     f"queued, queue limit {self.max_queue}); retry later",
                                     retry_after=self._retry_after())
            self._inbox.append(handle)
            self.counters["submitted"] += 1
            self._cv.notify_all()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a request (a disconnected client): a queued one is dropped now, a decoding one at the next step."""
        with self._cv:
            if handle._closed:
                return
            if handle in self._inbox:
                self._inbox.remove(handle)
                self.counters["cancelled"] += 1
                handle._push(Event("done", result=GenerationResult([], "", "cancelled", _empty_stats(handle))))
                return
            if handle.id in self._running:
                self._cancels.add(handle.id)
                self._cv.notify_all()

    def _retry_after(self) -> int:
        """A rough wait: the mean step time times the steps a slot takes to free up, at least one second."""
        if not self._step_seconds:
            return 1
        per_step = sum(self._step_seconds) / len(self._step_seconds)
        return max(1, math.ceil(per_step * 32))

    def queue_state(self) -> tuple[int, int]:
        """(requests decoding, requests waiting) now."""
        with self._cv:
            return len(self._running), len(self._inbox)

    def metrics(self) -> dict:
        with self._cv:
            eng = self.engine
            return {
                "active": len(self._running), "queued": len(self._inbox), "max_batch": self.max_batch,
                "max_queue": self.max_queue, "engine_rows": eng.num_active, "engine_pending": eng.num_pending,
                "cache_positions": eng.cache_positions, "steps": eng.steps,
                "batched_forwards": eng.batched_forwards, "plain_steps": eng.plain_steps,
                "method": eng.name, "draft_max_batch": eng.draft_max_batch or 0, "worker_alive": self.alive,
                **{k: self.counters[k] for k in ("submitted", "completed", "cancelled", "rejected", "errors",
                                                 "completion_tokens")},
            }

    # ------------------------------------------------------------------------------------------ the worker
    def _run(self) -> None:
        try:
            self._worker()
        finally:
            self._done.set()

    def _worker(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                while not self._stopping and not self._inbox and not self._cancels and not eng.has_work:
                    self._cv.wait()
                if self._stopping:
                    return
                admitted = []
                while self._inbox and eng.num_active + eng.num_pending < self.max_batch:
                    h = self._inbox.popleft()
                    self._running[h.id] = h
                    admitted.append(h)
                cancels, self._cancels = self._cancels, set()
            for h in admitted:
                try:
                    eng.add(h.prompt_ids, h.config, h.sampling, request_id=h.id, text=True)
                    h.started_at = time.perf_counter()
                except Exception as e:  # noqa: BLE001 - a bad request must not take the worker down
                    self._fail(h, f"{type(e).__name__}: {e}")
            for rid in cancels:
                eng.cancel(rid)
            if not eng.has_work:
                continue
            t0 = time.perf_counter()
            failed: Exception | None = None
            try:
                events = eng.step()
            except Exception as e:  # noqa: BLE001 - fail what is left of the batch, keep serving
                failed = e
                # what the step produced before it failed (rows that finished or streamed) still goes out first
                events = list(getattr(e, "events", []))
            else:
                self._step_seconds.append(time.perf_counter() - t0)
            self._deliver(events)
            if failed is not None:
                log.error("engine step failed (%s: %s); failing %d requests", type(failed).__name__, failed,
                          eng.num_active + eng.num_pending)
                eng.reset()
                # every handle still running was in the engine's batch (finished rows were delivered above): fail
                # them all, so that none is left waiting and none keeps counting against the queue
                for h in list(self._running.values()):
                    self._fail(h, f"internal error during decoding: {type(failed).__name__}: {failed}")
            if self.step_delay:
                time.sleep(self.step_delay)

    def _deliver(self, events) -> None:
        """Route one step's events to their handles; a row that failed alone ends with an error event."""
        for ev in events:
            h = self._running.get(ev.request_id)
            if h is None:
                continue
            if ev.finished and ev.result.finish_reason == "error":
                self._fail(h, f"internal error during decoding: {ev.result.error}")
            elif ev.finished:
                with self._cv:
                    self._running.pop(ev.request_id, None)
                    reason = ev.result.finish_reason
                    self.counters["cancelled" if reason == "cancelled" else "completed"] += 1
                    self.counters["completion_tokens"] += len(ev.result.token_ids)
                if ev.text:
                    h._push(Event("delta", text=ev.text))
                h._push(Event("done", result=ev.result))
            elif ev.text:
                h._push(Event("delta", text=ev.text))

    def _fail(self, h: RequestHandle, message: str) -> None:
        with self._cv:
            self._running.pop(h.id, None)
            self.counters["errors"] += 1
        h._push(Event("error", error=message))


def _empty_stats(handle: RequestHandle):
    return DecodeStats(prompt_tokens=len(handle.prompt_ids))


class LockedTokenizer:
    """A tokenizer proxy that serialises calls: HF fast tokenizers are not safe to use from two threads at once (the
    event loop encodes prompts while the worker decodes deltas)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._lock = threading.RLock()

    def __getattr__(self, name):
        attr = getattr(self._tok, name)
        if not callable(attr):
            return attr
        lock = self._lock

        def locked(*a, **kw):
            with lock:
                return attr(*a, **kw)

        return locked

    def __len__(self) -> int:
        return len(self._tok)
