"""AsyncLLMEngine: the engine stepped by one background thread, requests as asyncio streams.

`LLMEngine` is not thread-safe, so exactly one thread, the engine thread, ever calls its
add_request / abort / step. Everyone else talks to that thread through an inbox guarded by a
`threading.Condition`:

    event loop thread                         engine thread
    -----------------                         -------------
    add_requests() -> inbox.adds, notify -->  wait until there is work
    abort()       -> inbox.aborts, notify     admit adds, apply aborts (between steps)
                                              step() while any request is live
    RequestStream <-- call_soon_threadsafe <--   outputs of the step

`add_requests` queues a group (the prompts of one HTTP request) as one inbox entry: the engine
thread admits every request of the group before its next step, or, if one is bad, none.

While no request is live the engine thread sleeps on the condition; it never polls. Outputs
go back to the event loop in one callback per step, so a stream is only ever touched by the
loop that reads it. An abort frees the request's pages at the next step boundary, whichever
thread asked for it.

The engine thread's own work per step does not grow with the number of running requests
beyond the outputs of the step: the stats snapshot reads the scheduler's request counters.
A stream holds at most one unread output: one that arrives before the reader took the previous
one is merged into it (`merge_outputs`), so a reader that lags behind gets one output covering
all the steps it missed, rather than a queue of them to work through.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from orca_jax.engine.engine import LLMEngine
from orca_jax.errors import RequestError
from orca_jax.engine.outputs import RequestOutput, merge_outputs
from orca_jax.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# After an error the engine thread could not attribute to one request (or a step that could do
# nothing), wait this long before the next try, so that a persistent fault is not a hot loop.
_FAULT_BACKOFF_S = 0.05


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the request was not queued (retry later)."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class RequestFailedError(RuntimeError):
    """The request failed inside a step (or the engine failed under it)."""


@dataclass(frozen=True)
class EngineStats:
    """A consistent picture of the engine, published by the engine thread after every change."""

    num_running: int = 0  # requests with a sequence in the running batch
    num_waiting: int = 0  # requests queued for admission (including preempted ones)
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    num_preemptions: int = 0  # since start
    num_steps: int = 0  # model steps since start
    kv_pages_cached: int = 0  # pages published in the prefix cache, held or not
    prefix_cache_queries: int = 0  # tokens looked up at admission, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # Speculative decoding, since start: rows that verified drafts, draft tokens verified, and
    # of those accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0


class RequestStream:
    """The outputs of one request, in order, as an async iterator that ends after the output
    marked finished. An output carrying an error raises RequestFailedError instead.

    It collects rather than queues (vLLM's output collector): outputs that arrive while the
    reader is busy are merged into the one unread output, as `output_kind` says ("delta"
    outputs are concatenated, the others replaced by the newer one, their deltas kept), so
    what a reader takes covers every step since its previous read. An error put after
    outputs is raised once they have been read."""

    def __init__(self, request_id: str, on_abort: Callable[[str], None], output_kind: str = "cumulative"):
        self.request_id = request_id
        self.replica = 0  # the data-parallel replica that runs it (orca_jax.engine.data_parallel)
        self.finished = False
        self._on_abort = on_abort
        self._merge_deltas = output_kind == "delta"
        self._unread: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()  # set when there is something to read

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        elif self._unread is None:
            self._unread = item
        else:
            self._unread = merge_outputs(self._unread, item, self._merge_deltas)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._unread is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._unread = self._unread, None
        if item is None:
            self.finished = True
            raise self._error
        if item.finished:
            self.finished = True
            if item.error:
                raise RequestFailedError(item.error)
        return item

    def abort(self) -> None:
        """Stop the request if it is still live (safe to call more than once)."""
        if not self.finished:
            self.finished = True
            self._on_abort(self.request_id)


NewRequest = tuple[str, "str | list[int]", SamplingParams]  # (request id, prompt, params)


@dataclass
class _PendingAdd:
    """A group of requests admitted together, all or none."""

    requests: list[NewRequest]
    admitted: asyncio.Future  # resolved by the engine thread: None, or the first add_request error


@dataclass
class _Inbox:
    adds: list[_PendingAdd] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    abort_everything: bool = False
    stop: bool = False


class AsyncLLMEngine:
    """Runs an LLMEngine on a background thread for an asyncio server.

    max_waiting_requests bounds the requests queued for admission (inbox plus the scheduler's
    waiting queue); past it, add_request raises QueueFullError instead of queueing, so a burst
    turns into fast 503s rather than unbounded memory. on_output, if given, sees every output
    on the engine thread (for metrics); it must be thread-safe and quick.
    """

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None):
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._on_output = on_output
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._accepting = True
        self._stats = self._snapshot()
        self._streams: dict[str, RequestStream] = {}  # event loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_wakeups = 0  # engine-thread loop iterations: flat while idle (no polling)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running one)."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="orca-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._accepting

    def begin_shutdown(self) -> None:
        """Take no new requests and abort every live one. Safe from any thread, but not from a
        signal handler (it takes a lock): schedule it on the loop from there."""
        with self._cond:
            self._accepting = False
            self._inbox.abort_everything = True
            self._cond.notify()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort everything, stop the engine thread and wait for it."""
        with self._cond:
            self._accepting = False
            self._inbox.abort_everything = True
            self._inbox.stop = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- requests (event loop thread) --------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Queue one request; see add_requests."""
        (stream,) = await self.add_requests([(request_id, prompt, params)])
        return stream

    async def add_requests(self, requests: list[NewRequest]) -> list[RequestStream]:
        """Queue requests as one group and wait until the engine has accepted all of them
        (it admits them together, before its next step) or none. Raises what
        LLMEngine.add_request raises for the first bad one (RequestError, TypeError), a
        RequestError if the group alone is larger than the queue, QueueFullError or
        EngineStoppedError; returns the streams of their outputs, in order."""
        if self._loop is None:
            raise RuntimeError("call start() first")
        ids = [request_id for request_id, _, _ in requests]
        duplicate = _first_in_use(ids, self._streams)
        if duplicate is not None:
            raise RequestError(f"request id {duplicate!r} is already in use", None, "duplicate_request_id")
        if self.max_waiting_requests is not None and len(requests) > self.max_waiting_requests:
            raise RequestError(f"{len(requests)} prompts in one request, but this server queues at most "
                               f"{self.max_waiting_requests} (max_waiting_requests); split the request",
                               "prompt", "too_many_prompts")
        admitted = self._loop.create_future()
        with self._cond:
            if not self._accepting:
                raise EngineStoppedError("the server is shutting down")
            if self._queue_is_full(len(requests)):
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
            self._inbox.adds.append(_PendingAdd(list(requests), admitted))
            self._cond.notify()
        streams = [RequestStream(request_id, self.abort, getattr(params, "output_kind", "cumulative"))
                   for request_id, _, params in requests]
        self._streams.update(zip(ids, streams))
        try:
            await admitted
        except BaseException:  # rejected, or the caller went away while it was queued
            for request_id in ids:
                self._streams.pop(request_id, None)
            if not admitted.done() or admitted.cancelled():
                for request_id in ids:
                    self.abort(request_id)
            raise
        return streams

    def _queue_is_full(self, arriving: int) -> bool:
        if self.max_waiting_requests is None:
            return False
        # The stats are republished under the lock whenever adds leave the inbox, so a request
        # is counted in exactly one of the two places.
        queued = self._stats.num_waiting + sum(len(pending.requests) for pending in self._inbox.adds)
        return queued + arriving > self.max_waiting_requests

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its pages are freed at the next step boundary."""
        with self._cond:
            self._inbox.aborts.append(request_id)
            self._cond.notify()

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_live_requests(self) -> int:
        """Requests handed to this engine and not finished (queued, waiting or running), counted
        from the moment add_requests takes them: a data-parallel router's load (event loop thread)."""
        return len(self._streams)

    def has_live_request(self, request_id: str) -> bool:
        return request_id in self._streams

    # ---- delivery (event loop thread) --------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # its reader already went away
            stream._put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all_streams(self, message: str) -> None:
        for stream in self._streams.values():
            stream._put(RequestFailedError(message))
        self._streams.clear()

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to read
            pass

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if self._apply_inbox():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
            except Exception as exc:  # noqa: BLE001 - a bug here must not silently stop serving
                logger.exception("engine thread error; failing all live requests")
                self._abort_all_after_fault(f"{type(exc).__name__}: {exc}")
        self._drain_aborted()
        logger.info("engine thread stopped")

    def _apply_inbox(self) -> bool:
        """Sleep until there is work, then apply adds and aborts. Returns True to stop. The lock
        is held while adds move into the engine so the queue limit never misses a request."""
        with self._cond:
            while not self._has_work():
                self._cond.wait()
            self.num_wakeups += 1
            inbox, self._inbox = self._inbox, _Inbox()
            # A stop request stays in force: later adds keep being rejected.
            self._inbox.stop = inbox.stop
            for pending in inbox.adds:  # before aborts: an abort may be for one of these
                self._admit(pending, reject=inbox.stop or inbox.abort_everything)
            for request_id in inbox.aborts:
                self.engine.abort(request_id)
            if inbox.abort_everything:
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
            self._stats = self._snapshot()
            return inbox.stop

    def _has_work(self) -> bool:
        inbox = self._inbox
        return bool(inbox.adds or inbox.aborts or inbox.abort_everything or inbox.stop
                    or self.engine.has_unfinished_requests())

    def _admit(self, pending: _PendingAdd, reject: bool) -> None:
        error: BaseException | None = EngineStoppedError("the server is shutting down") if reject else None
        if error is None:
            try:
                self.engine.add_requests(pending.requests)  # all or none
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                error = exc
        self._call_in_loop(_resolve, pending.admitted, error)

    def _step(self) -> None:
        steps_before = (self.engine.num_steps, self.engine.num_dispatched)
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine thread must survive
            # LLMEngine.step already turns a failed model call into errors for the requests of
            # that step; reaching here means the host bookkeeping itself failed, so no request
            # can be trusted: fail them all and start clean.
            logger.exception("engine step failed outside the model call; failing all live requests")
            self._abort_all_after_fault(f"{type(exc).__name__}: {exc}")
            return
        with self._cond:
            self._stats = self._snapshot()
        self._observe(outputs)
        if outputs:
            self._call_in_loop(self._deliver, outputs)
        elif (self.engine.num_steps, self.engine.num_dispatched) == steps_before:
            # Live requests, yet nothing could be scheduled, completed or reported (an
            # overlapped step() that only dispatched is progress). The scheduler should never
            # leave it so; if it does, wait rather than spin.
            with self._cond:
                self._cond.wait(_FAULT_BACKOFF_S)

    def _abort_all_after_fault(self, message: str) -> None:
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - best effort: the state is already suspect
                logger.exception("abort of %s failed", request_id)
        self._call_in_loop(self._fail_all_streams, message)
        with self._cond:
            self._cond.wait(_FAULT_BACKOFF_S)

    def _drain_aborted(self) -> None:
        """At stop: report the aborts, so every reader sees its stream end."""
        for _ in range(3):  # one step reports all aborts; a spare try covers a fault
            if not self.engine.has_unfinished_requests():
                break
            self._step()
        self._call_in_loop(self._fail_all_streams, "the server shut down")

    def _observe(self, outputs: list[RequestOutput]) -> None:
        if self._on_output is None:
            return
        for output in outputs:
            try:
                self._on_output(output)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                logger.exception("on_output callback failed")

    def _snapshot(self) -> EngineStats:
        """O(1): the scheduler counts its running and waiting requests as they move."""
        scheduler, allocator = self.engine.scheduler, self.engine.allocator
        num_running = getattr(scheduler, "num_running_requests", None)
        num_waiting = getattr(scheduler, "num_waiting_requests", None)
        if num_running is None or num_waiting is None:  # a scheduler without the counters
            num_running = len({seq.request_id for seq in scheduler.running})
            num_waiting = len({seq.request_id for seq in scheduler.waiting})
        return EngineStats(
            num_running=num_running,
            num_waiting=num_waiting,
            kv_pages_used=allocator.num_used,
            kv_pages_total=allocator.num_usable,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.engine.num_steps,
            kv_pages_cached=allocator.num_cached,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            spec_decode_num_drafts=scheduler.num_spec_rows,
            spec_decode_num_draft_tokens=scheduler.num_draft_tokens,
            spec_decode_num_accepted_tokens=scheduler.num_accepted_tokens,
        )


def _first_in_use(ids: list[str], live: dict[str, RequestStream]) -> str | None:
    """The first id that is live already or comes twice in `ids`."""
    seen: set[str] = set()
    for request_id in ids:
        if request_id in live or request_id in seen:
            return request_id
        seen.add(request_id)
    return None


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the waiter was cancelled; add_request already queued its abort
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
