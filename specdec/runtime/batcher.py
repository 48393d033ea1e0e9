"""The event-loop side of continuous batching: engine calls from many RPCs become works of one
:class:`~specdec.engine.batching.BatchRunner`, whose iterations run back to back on the model
thread while any work is in flight (docs/batching.md).

An RPC awaits its work's result; nothing waits for a batch to fill: the first work to arrive
starts an iteration at once, and whatever arrives while a pass runs joins the next one. A
cancelled RPC (client gone) marks its work, which the next iteration closes (a prefill then
releases its half-started session).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from specdec.engine.batching import BatchRunner, Job, PassLoad
from specdec.engine.sessions import Work
from specdec.runtime.model_thread import on_model_thread
from specdec.telemetry import metrics

ADMISSION_POLL_SECONDS = 0.02


class IterationLoop:
    """``gather_seconds``: before a pass, wait up to this long for the sessions stepping now (those
    that sent a work lately) to come back with their next request (0: never wait; docs/batching.md)."""

    def __init__(self, runner: BatchRunner, gather_seconds: float = 0.0):
        self.runner = runner
        self.gather_seconds = gather_seconds
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        metrics.RUNNING_WORKS.set_function(runner.running)
        metrics.WAITING_WORKS.set_function(runner.waiting)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def run(self, work: Work, session_id: str, admit_tokens: int | None = None) -> Any:
        """The work's result (or its exception), its passes batched with everyone else's.
        ``admit_tokens``: the work starts a session of that many prompt tokens, which waits for
        room in the KV pool (see BatchRunner)."""
        return (await self.run_with_load(work, session_id, admit_tokens))[0]

    async def run_with_load(
        self, work: Work, session_id: str, admit_tokens: int | None = None
    ) -> tuple[Any, PassLoad | None]:
        """:meth:`run`, and the last pass the work took part in."""
        self.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        submitted = time.perf_counter()

        def started() -> None:
            metrics.QUEUE_WAIT.observe(time.perf_counter() - submitted)

        def settle(job: Job) -> None:  # on the event loop
            if not future.done():
                if job.error is not None:
                    future.set_exception(job.error)
                elif job.cancelled:
                    future.cancel()
                else:
                    future.set_result((job.result, job.last_pass))

        def done(job: Job) -> None:  # on the model thread
            loop.call_soon_threadsafe(settle, job)

        def on_start() -> None:  # on the model thread
            loop.call_soon_threadsafe(started)

        job = self.runner.add(work, session_id, done, on_start, admit_tokens)
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            job.cancelled = True
            self._wake.set()
            raise

    async def _gather(self, expected: int) -> None:
        """Wait (at most ``gather_seconds``) until ``expected`` works are ready."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.gather_seconds
        while self.runner.ready() < expected and (left := deadline - loop.time()) > 0:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.runner.busy:
                # Wait for every session stepping now, not only as many as the last pass carried:
                # two streams that fell out of phase (one verifying while the other proposes) would
                # otherwise run one-session passes for good, each waiting for nobody.
                if self.gather_seconds and (expected := self.runner.stepping()) > 1:
                    await self._gather(expected)
                iteration = await on_model_thread(self.runner.iterate)
                metrics.record_iteration(iteration.sessions, iteration.rows, iteration.prefill_rows)
                if not iteration.sessions and not iteration.finished:
                    # only session starts waiting for KV room: look again once sessions may have left
                    await asyncio.sleep(ADMISSION_POLL_SECONDS)
