"""Drive one :class:`~server.engine_api.EngineCore` from its engine thread (:mod:`server.engine_thread`) and expose
per-request async streams. Streams, admission control (bounded queue) and metrics live on the asyncio side, so no
locks guard them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

from server.engine_api import NONFINITE_ERROR, EngineCore, KVTransferParams, RequestDelta, SamplingParams, StepStats
from server.engine_thread import Abort, Add, EngineDeadError, EngineThread
from server.metrics import Metrics

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "RequestHandle"]


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting (the bounded queue is full); retry later (HTTP 503 + Retry-After)."""


@dataclasses.dataclass
class RequestHandle:
    """An added request: its id and the queue its deltas arrive on (read it through :meth:`AsyncEngine.stream`)."""

    request_id: str
    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float = 0.0


class AsyncEngine:
    """Continuous batching over an :class:`EngineCore`, for asyncio callers.

    Arguments:
        engine: the started engine; owned from here on (``shutdown()`` shuts it down).
        capacity: requests the engine runs at once (``max_num_seqs`` x DP ranks); admission allows
            ``capacity + max_queue_len`` unfinished requests and refuses more with :class:`EngineOverloadedError`.
        metrics: updated from the asyncio thread, or None.
    """

    def __init__(self, engine: EngineCore, *, capacity: int, max_queue_len: int, metrics: Metrics | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        self.engine = engine
        self.capacity = capacity
        self.max_queue_len = max_queue_len
        self.metrics = metrics
        self._requests: dict[str, RequestHandle] = {}
        self._thread: EngineThread | None = None

    # ---- lifecycle (asyncio side) ----
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._thread = EngineThread(self.engine, asyncio.get_running_loop(), self._deliver, self._fail_all)

    async def shutdown(self) -> None:
        """Stop the engine thread, fail the open streams and shut the engine down (idempotent)."""
        if self._thread is not None:
            await asyncio.to_thread(self._thread.stop)
        self._fail_all(EngineDeadError("the engine was shut down"))
        await asyncio.to_thread(self.engine.shutdown)

    def is_healthy(self) -> bool:
        """True while the engine thread runs and the engine reported every worker alive at its last check."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # ---- requests (asyncio side) ----
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float | None = None,
        transfer: KVTransferParams | None = None,
    ) -> RequestHandle:
        """Hand a request to the engine; returns its handle for :meth:`stream` once the engine accepted it.

        ``arrival`` is the ``time.monotonic()`` at which the request arrived (TTFT and queue time count from it);
        ``transfer`` its bootstrap room (disaggregation).
        Raises ``ValueError`` if the engine rejects the input, :class:`EngineOverloadedError` when the queue is
        full, :class:`EngineDeadError` when the engine is down.
        """
        if self._thread is None or not self._thread.is_alive():
            why = self._thread.why_down() if self._thread is not None else "not started"
            raise EngineDeadError(f"the engine is not running ({why})")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if len(self._requests) >= self.capacity + self.max_queue_len:
            raise EngineOverloadedError(
                f"{len(self._requests)} requests are unfinished (capacity {self.capacity} + queue "
                f"{self.max_queue_len}); retry later"
            )
        req = RequestHandle(request_id, asyncio.Queue(), arrival or time.monotonic(), len(prompt_token_ids))
        self._requests[request_id] = req
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._thread.submit(Add(request_id, prompt_token_ids, params, accepted, transfer))
        try:
            await accepted
        except BaseException:
            self._requests.pop(request_id, None)
            self._thread.submit(Abort(request_id))  # no-op if the engine never took it
            self._update_gauges()
            raise
        if self.metrics is not None:
            self.metrics.on_request_added(len(prompt_token_ids))
        self._update_gauges()
        return req

    def abort(self, request_id: str) -> None:
        """Cancel a request: its stream ends now and the engine frees its slot at the next step (no-op if the
        request is unknown or finished)."""
        if self._requests.pop(request_id, None) is not None and self._thread is not None:
            self._thread.submit(Abort(request_id))
            self._update_gauges()

    async def stream(self, handle: RequestHandle) -> AsyncIterator[list[RequestDelta]]:
        """Yield an added request's deltas as they come, batched: each item is every delta delivered since the
        last one (a slow consumer gets several steps at once). The last delta has a ``finish_reason``. Closing or
        cancelling the iterator before that aborts the request in the engine (frees its slot).
        Raises :class:`EngineDeadError` if the engine fails meanwhile."""
        queue = handle.queue
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                finished = items[-1].finish_reason is not None
                yield items
        finally:
            if not finished:
                self.abort(handle.request_id)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: float | None = None
    ) -> AsyncIterator[list[RequestDelta]]:
        """:meth:`add_request` then :meth:`stream`."""
        handle = await self.add_request(request_id, prompt_token_ids, params, arrival)
        async for items in self.stream(handle):
            yield items

    # ---- asyncio side: results ----
    def _deliver(self, deltas: list[RequestDelta], start: float, end: float, stats: StepStats) -> None:
        m = self.metrics
        num_tokens = 0
        for delta in deltas:
            num_tokens += len(delta.new_token_ids)
            req = self._requests.get(delta.request_id)
            if req is None:  # aborted by us, or not ours
                continue
            if delta.new_token_ids:
                if req.first_token_time is None:
                    req.first_token_time = end
                    if m is not None:
                        m.time_to_first_token.observe(end - req.arrival)
                        m.request_queue_time.observe(max(0.0, start - req.arrival))
                elif m is not None:
                    m.inter_token_latency.observe(end - req.last_token_time)
                req.last_token_time = end
            if delta.finish_reason is not None:
                del self._requests[delta.request_id]
                if m is not None:
                    m.on_finished(delta.finish_reason, delta.num_output_tokens, end - req.arrival)
                    if delta.error == NONFINITE_ERROR:
                        m.nonfinite_logits.inc()
            req.queue.put_nowait(delta)
        if m is not None:
            m.on_step(end - start, num_tokens, stats.num_batched_tokens, stats.dispatch_times, stats.combine_times)
            m.on_kv_transfers(stats.kv_transfers)
            m.ep_ranks_lost.set(stats.num_lost_ranks)
            m.on_expert_load(stats.expert_loads, stats.num_lost_experts)
            m.on_cache_stats(
                stats.kv_cache_usage, stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits
            )
        self._update_gauges()

    def _fail_all(self, error: BaseException) -> None:
        requests, self._requests = self._requests, {}
        for req in requests.values():
            req.queue.put_nowait(error)
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        running = sum(1 for r in self._requests.values() if r.first_token_time is not None)
        self.metrics.set_queue_sizes(running, len(self._requests) - running)
