"""DataParallelAsyncEngine: several AsyncLLMEngine replicas behind the interface of one.

The server talks to it as to one AsyncLLMEngine (add_requests, abort, stats, start, shutdown).
Each replica keeps its own engine thread, inbox, scheduler and KV cache; this front only picks
the replica of each request group, on the event loop thread:

    add_requests(group) --route--> replica r's add_requests   (the group stays together: all or none)
    abort(id)           ---------> every replica (an id unknown to one is a no-op there)
    begin_shutdown / shutdown ---> every replica, together

Load is each replica's live streams (requests routed there and not yet finished, waiting or
running), which the replica counts as soon as a request is handed to it, so the requests of one
burst spread before any step has run. A replica whose queue is full passes the group to the
next lightest; only when every one is full does the caller get QueueFullError.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

from orca_jax.engine.async_engine import AsyncLLMEngine, EngineStats, NewRequest, QueueFullError, RequestStream
from orca_jax.engine.router import PrefixAffinityRouter
from orca_jax.errors import RequestError


class DataParallelAsyncEngine:
    def __init__(self, replicas: list[AsyncLLMEngine], router: PrefixAffinityRouter):
        if len(replicas) != router.num_replicas:
            raise ValueError(f"{len(replicas)} replicas for a router of {router.num_replicas}")
        self.replicas = replicas
        self.router = router
        self.routed: Counter[tuple[int, str]] = Counter()  # (replica, reason) -> requests routed

    @property
    def engine(self):
        """Replica 0's LLMEngine, for what every replica has alike: tokenizer, configs, defaults."""
        return self.replicas[0].engine

    @property
    def replica_indices(self) -> list[int]:
        return [getattr(r.engine, "replica_index", i) for i, r in enumerate(self.replicas)]

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        for replica in self.replicas:
            replica.start(loop)

    @property
    def is_running(self) -> bool:
        return all(replica.is_running for replica in self.replicas)

    def begin_shutdown(self) -> None:
        for replica in self.replicas:
            replica.begin_shutdown()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Every replica's engine thread stopped, together (each waits for its own step)."""
        with ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="replica-stop") as pool:
            list(pool.map(lambda replica: replica.shutdown(timeout), self.replicas))

    # ---- requests (event loop thread) --------------------------------------------------------
    def loads(self) -> list[int]:
        return [replica.num_live_requests for replica in self.replicas]

    async def add_request(self, request_id: str, prompt, params) -> RequestStream:
        (stream,) = await self.add_requests([(request_id, prompt, params)])
        return stream

    async def add_requests(self, requests: list[NewRequest]) -> list[RequestStream]:
        """AsyncLLMEngine.add_requests on the replica the router picks for the group's first
        prompt (a group's prompts share their request's prefix, as n > 1 or a list prompt)."""
        for request_id, _, _ in requests:
            if any(replica.has_live_request(request_id) for replica in self.replicas):
                raise RequestError(f"request id {request_id!r} is already in use", None, "duplicate_request_id")
        loads = self.loads()
        route = self.router.route(requests[0][1] if requests else [], loads)
        # The chosen one first, then the others lightest first, for a full queue.
        order = [route.replica] + sorted((r for r in range(len(self.replicas)) if r != route.replica),
                                         key=lambda r: loads[r])
        for attempt, r in enumerate(order):
            try:
                streams = await self.replicas[r].add_requests(requests)
            except QueueFullError:
                if attempt == len(order) - 1:
                    raise
                continue
            self.router.record(route, r)
            self.routed[(self.replica_indices[r], route.reason if r == route.replica else "queue_full")] += len(requests)
            for stream in streams:
                stream.replica = self.replica_indices[r]
            return streams
        raise AssertionError("unreachable")

    def abort(self, request_id: str) -> None:
        """From any thread, like AsyncLLMEngine.abort: told to every replica, since which one
        holds the id is the event loop's to know; the others find nothing to abort."""
        for replica in self.replicas:
            replica.abort(request_id)

    # ---- observation -----------------------------------------------------------------------------
    def replica_stats(self) -> list[EngineStats]:
        return [replica.stats() for replica in self.replicas]

    def stats(self) -> EngineStats:
        """The replicas' stats summed (every field is a count)."""
        per_replica = self.replica_stats()
        return EngineStats(**{f.name: sum(getattr(s, f.name) for s in per_replica) for f in fields(EngineStats)})
