"""Micro-batching: requests that arrive together share one call on the model thread.

The event loop never runs model or scan work. :class:`MicroBatcher` keeps a bounded queue of
pending requests; one task takes them in batches — everything already waiting (requests that
queued while the model was busy), plus what keeps arriving less than ``window_s`` apart — and
hands each batch to ``process`` on a one-thread executor. One thread, because the model's
gradient hooks and the tokenizer are not safe to use from two threads at once; other index work
(:meth:`MicroBatcher.call`) runs on the same thread for the same reason.

A lone request waits at most ``window_s`` (a few milliseconds) for company.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional, Sequence

log = logging.getLogger("eogp.serve")


class QueueFull(Exception):
    """The queue holds ``queue_size`` requests already: the caller answers 503 with Retry-After."""


@dataclass
class _Pending:
    payload: Any
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    abandoned: bool = False  # its request timed out: not worth computing any more


class MicroBatcher:
    """Batches payloads for ``process(payloads) -> results`` run on one worker thread.

    Args:
        process: takes a list of payloads and returns one result per payload, in order; a result
            that is an exception is raised to that payload's caller alone.
        window_s: how long the oldest waiting payload may wait for others to join its batch.
        max_batch: most payloads per call of ``process``.
        queue_size: most payloads and calls waiting; :meth:`submit` raises :class:`QueueFull` beyond.
    """

    def __init__(
        self, process: Callable[[List[Any]], Sequence[Any]], *, window_s: float, max_batch: int, queue_size: int
    ):
        self._process = process
        self.window_s = window_s
        self.max_batch = max_batch
        self.queue_size = queue_size
        self._waiting: Deque[_Pending] = collections.deque()
        self._calls = 0  # single calls (explain, lookups) queued on the executor
        self._arrived: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._executor: Optional[ThreadPoolExecutor] = None

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eogp-model")
        self._arrived = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="eogp-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for pending in self._waiting:
            if not pending.future.done():
                pending.future.set_exception(asyncio.CancelledError())
        self._waiting.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @property
    def depth(self) -> int:
        """Requests waiting (batched payloads and single calls)."""
        return len(self._waiting) + self._calls

    # -- callers ----------------------------------------------------------------------------------
    async def submit(self, payload: Any, *, timeout: float) -> Any:
        """``payload``'s result once its batch has run. Raises :class:`QueueFull` or
        ``TimeoutError`` (after ``timeout`` seconds; the payload is then dropped if not started)."""
        if self._arrived is None:
            raise RuntimeError("MicroBatcher.start() has not run (the app's lifespan did not start)")
        if self.depth >= self.queue_size:
            raise QueueFull()
        pending = _Pending(payload, asyncio.get_running_loop().create_future())
        self._waiting.append(pending)
        self._arrived.set()
        try:
            return await asyncio.wait_for(asyncio.shield(pending.future), timeout)
        except asyncio.TimeoutError:
            pending.abandoned = True
            raise TimeoutError() from None

    async def call(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """``fn(*args)`` on the model thread, not batched, under the same queue bound."""
        if self._executor is None:
            raise RuntimeError("MicroBatcher.start() has not run (the app's lifespan did not start)")
        if self.depth >= self.queue_size:
            raise QueueFull()
        self._calls += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        future.add_done_callback(self._done_call)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError() from None

    def _done_call(self, future: asyncio.Future) -> None:
        self._calls -= 1
        if not future.cancelled():
            future.exception()  # retrieved, so a timed-out call's error is not reported as unhandled

    # -- the batching task ------------------------------------------------------------------------
    async def _next_batch(self) -> List[_Pending]:
        """Wait for a payload, then for company: the batch closes when it is full, or when no
        payload has arrived for ``window_s`` — but at the latest ``10 × window_s`` after the oldest
        arrived. A lone request thus waits ``window_s``; a burst (the clients of the batch that
        just finished, sending their next queries) is gathered whole instead of split in two."""
        assert self._arrived is not None
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        while len(self._waiting) < self.max_batch:
            quiet_until = self._waiting[-1].enqueued + self.window_s
            remaining = min(quiet_until, self._waiting[0].enqueued + 10 * self.window_s) - time.monotonic()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                break
        batch = []
        while self._waiting and len(batch) < self.max_batch:
            batch.append(self._waiting.popleft())
        return [p for p in batch if not p.abandoned and not p.future.done()]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self._executor, self._process, [p.payload for p in batch])
            except Exception as exc:  # the whole batch failed: each caller hears why (logged by the app)
                results = [exc] * len(batch)
            for pending, result in zip(batch, results):
                if pending.future.done() or pending.abandoned:
                    continue
                if isinstance(result, BaseException):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)
