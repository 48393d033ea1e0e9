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
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from replica.model_thread import on_model_thread
from specdec.engine.batching import BatchRunner, Job, PassLoad
from specdec.engine.sessions import Work
from specdec.telemetry import metrics

ADMISSION_POLL_SECONDS = 0.02
# An iteration that fails as a whole (not one work's pass: the runner's own bookkeeping) fails
# the works in flight and the loop goes on; this many in a row and the replica says NOT_SERVING
# (until one succeeds), so the registry and health probes stop sending it sessions.
UNHEALTHY_AFTER_FAILURES = 3
FAILED_ITERATION_BACKOFF_SECONDS = 0.1

log = logging.getLogger("specdec.batcher")


class IterationLoop:
    """``gather_seconds``: before a pass, wait up to this long for the sessions stepping now (those
    that sent a work lately) to come back with their next request (0: never wait; docs/batching.md).
    ``on_health``: an async callback(serving: bool, reason: str) told when the loop stops being
    able to run iterations, and when it can again."""

    def __init__(
        self,
        runner: BatchRunner,
        gather_seconds: float = 0.0,
        on_health: Callable[[bool, str], Awaitable[None]] | None = None,
    ):
        self.runner = runner
        self.gather_seconds = gather_seconds
        self.on_health = on_health
        self.failures = 0  # iterations in a row that failed as a whole
        self.serving = True
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
                try:
                    iteration = await on_model_thread(self.runner.iterate)
                except Exception as exc:  # noqa: BLE001 - the loop must outlive any one iteration
                    await self._failed(exc)
                    continue
                await self._succeeded()
                metrics.record_iteration(iteration.sessions, iteration.rows, iteration.prefill_rows)
                if not iteration.sessions and not iteration.finished:
                    # only session starts waiting for KV room: look again once sessions may have left
                    await asyncio.sleep(ADMISSION_POLL_SECONDS)

    async def _failed(self, exc: Exception) -> None:
        """An iteration raised: every work in flight fails with a status (their callers retry
        elsewhere), and past UNHEALTHY_AFTER_FAILURES in a row the replica says NOT_SERVING."""
        self.failures += 1
        log.error("iteration failed (%d in a row): %r", self.failures, exc)
        try:
            failed = await on_model_thread(self.runner.fail_all, "an iteration", exc)
            log.error("failed %d work(s) in flight", len(failed))
        except Exception as again:  # noqa: BLE001 - then the works stay queued for the next try
            log.error("failing the works in flight raised too: %r", again)
        if self.failures >= UNHEALTHY_AFTER_FAILURES and self.serving:
            await self._set_health(False, f"{self.failures} iterations in a row failed, the last with {exc!r}")
        await asyncio.sleep(FAILED_ITERATION_BACKOFF_SECONDS)

    async def _succeeded(self) -> None:
        self.failures = 0
        if not self.serving:
            await self._set_health(True, "iterations run again")

    async def _set_health(self, serving: bool, reason: str) -> None:
        self.serving = serving
        log.warning("%s: %s", "SERVING" if serving else "NOT_SERVING", reason)
        if self.on_health is not None:
            try:
                await self.on_health(serving, reason)
            except Exception as exc:  # noqa: BLE001 - reporting health must not end the loop
                log.error("the health callback raised %r", exc)
