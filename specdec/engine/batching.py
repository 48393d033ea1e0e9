"""Iteration-level (continuous) batching: the work of every live session advances together, one
forward pass per iteration over the ragged concatenation of their rows (docs/batching.md).

An engine call that needs forward passes (a verify, a prefill, a proposal) is written once, as a
*work*: a generator that yields a :class:`PassRequest` for each pass it needs and receives that
pass's result, so the same code runs alone (``sessions.run_alone``: one pass per request) and inside a
batch (:class:`BatchRunner`, whose iteration gathers one request from each work in flight). What a
session computes does not depend on which of the two ran it, nor on what shared its passes: the
passes go through :meth:`SessionStore.forward_batch`, whose rows are batch-invariant.

Scheduling, per iteration (vLLM's order, in miniature): requests that cannot be split (verify
blocks, target-only steps, proposal positions) in arrival order of their works, then prefill
chunks with the token budget left. A request never waits for a batch to fill; a work that cannot
get its rows this iteration keeps its place for the next.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdec.engine.sessions import PassRequest, RowsRequest, SessionStore, Work, run_rows
from specdec.errors import ReplicaFaultError, ResourceExhaustedError

log = logging.getLogger("specdec.batching")
STEPPING_SECONDS = 0.5  # a session that sent a work this recently is expected to send the next soon
# Admission (issue 42, item 5): a session start that does not fit yet lets smaller ones that do
# start before it -- for BYPASS_SECONDS; after that nothing passes it and it takes the next room
# running sessions free (they always end) -- and any start that waited MAX_WAIT_SECONDS is refused.
BYPASS_SECONDS = 2.0
MAX_WAIT_SECONDS = 60.0
# While prefills wait, whole requests (verify blocks, steps) take at most this share less of a
# pass's rows: a prompt beside many long verify blocks is not fed a row at a time.
PREFILL_SHARE = 0.25


@dataclass(frozen=True)
class PassLoad:
    """One batched pass as a replica reports it with an answer (what a load-aware policy reads):
    ``size`` (a target: rows; a draft: sessions advancing a position), the ``sessions`` sharing
    it, its ``seconds``, and the replica's ``live_sessions``."""

    size: int
    sessions: int
    seconds: float
    live_sessions: int


@dataclass
class Job:
    """A work in flight in a :class:`BatchRunner`."""

    work: Work
    session_id: str
    order: int  # arrival: earlier works are served first
    on_done: Callable[[Job], None] | None = None
    on_start: Callable[[], None] | None = None
    admit_tokens: int | None = None  # a session start: the prompt's tokens (waits for KV room)
    queued: float = 0.0  # when it began waiting for KV room (time.monotonic)
    request: PassRequest | RowsRequest | None = None  # a RowsRequest only between a pass and its rows' math
    finished: bool = False
    result: Any = None
    error: BaseException | None = None
    cancelled: bool = False
    last_pass: PassLoad | None = None  # the latest pass it took part in

    @property
    def pending(self) -> PassRequest:
        """The pass the work waits on (only asked of a work that waits on one)."""
        assert isinstance(self.request, PassRequest)
        return self.request

    def _advance(self, first: bool = False, value: Any = None) -> None:
        """Run the work to its next request: start it (``first``), or hand it its pass's result
        ``value`` (an exception is thrown into it)."""
        try:
            if first:
                self.request = next(self.work)
            elif isinstance(value, BaseException):
                self.request = self.work.throw(value)
            else:
                self.request = self.work.send(value)
        except StopIteration as done:
            self.finished, self.result, self.request = True, done.value, None
        except Exception as exc:  # noqa: BLE001 - a work's failure is its caller's error, not the batch's
            self.finished, self.error, self.request = True, exc, None


@dataclass(frozen=True)
class Iteration:
    """What one iteration ran (for metrics): sessions and rows in its pass, prefill rows among
    them, and the works it finished."""

    sessions: int
    rows: int
    prefill_rows: int
    finished: list[Job]


class BatchRunner:
    """Works in flight over one :class:`SessionStore`, advanced an iteration at a time.

    ``add`` may be called from any thread; ``iterate`` runs on the model thread, one call at a
    time. ``max_batch_tokens``: rows one pass may carry (a request bigger than that still runs,
    alone); ``max_batch_sessions``: sessions one pass may carry.

    Admission: a session start (a work added with ``admit_tokens``) waits until the store has
    room for it (sessions and KV pool), oldest first; a smaller start that fits may go before an
    older one that does not, while that one has waited less than ``bypass_seconds``; a start that
    waited ``max_wait_seconds`` is refused, as is one more than ``max_waiting`` waiting (both
    RESOURCE_EXHAUSTED). A start that could not fit even an empty pool is let through at once, to
    fail with the store's own message. Running sessions are never preempted."""

    def __init__(
        self,
        store: SessionStore,
        max_batch_tokens: int = 512,
        max_batch_sessions: int = 64,
        max_waiting: int = 64,
        bypass_seconds: float = BYPASS_SECONDS,
        max_wait_seconds: float = MAX_WAIT_SECONDS,
    ):
        if max_batch_tokens < 1 or max_batch_sessions < 1 or max_waiting < 0:
            raise ValueError("max_batch_tokens and max_batch_sessions must be >= 1, max_waiting >= 0")
        if not 0 <= bypass_seconds <= max_wait_seconds:
            raise ValueError("need 0 <= bypass_seconds <= max_wait_seconds")
        self.store = store
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sessions = max_batch_sessions
        self.max_waiting = max_waiting
        self.bypass_seconds = bypass_seconds
        self.max_wait_seconds = max_wait_seconds
        self.prefill_reserve = max(1, int(PREFILL_SHARE * max_batch_tokens))
        self._new: list[Job] = []
        self._admitting: list[Job] = []  # session starts waiting for room
        self._jobs: list[Job] = []
        self._lock = threading.Lock()
        self._orders = itertools.count()
        self._last_work: dict[str, float] = {}  # session -> when its latest work arrived

    def add(
        self,
        work: Work,
        session_id: str,
        on_done: Callable[[Job], None] | None = None,
        on_start: Callable[[], None] | None = None,
        admit_tokens: int | None = None,
    ) -> Job:
        """Queue ``work`` (for ``session_id``); ``on_start`` / ``on_done`` are called on the model
        thread when the work starts and when it finishes (with its result or error).
        ``admit_tokens``: the work starts a session of that many prompt tokens (admission)."""
        job = Job(work, session_id, next(self._orders), on_done, on_start, admit_tokens)
        with self._lock:
            self._new.append(job)
            self._last_work[session_id] = time.monotonic()
        return job

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._new or self._jobs or self._admitting)

    def running(self) -> int:
        """Works in flight (started, not finished)."""
        return len(self._jobs)

    def ready(self) -> int:
        """Works that would take part in the next pass if it ran now (new ones included)."""
        with self._lock:
            return len(self._new) + sum(1 for j in self._jobs if j.request is not None and not j.cancelled)

    def stepping(self, within: float = STEPPING_SECONDS) -> int:
        """Live sessions whose latest work arrived in the last ``within`` (<= STEPPING_SECONDS)
        seconds: the sessions stepping now, whose next request a pass may wait a moment for (one
        idle, abandoned or released is not)."""
        self._forget_quiet()
        now = time.monotonic()
        with self._lock:
            return sum(1 for t in self._last_work.values() if now - t <= within)

    def _forget_quiet(self) -> None:
        """Drop the sessions released or quiet for longer than STEPPING_SECONDS: the table holds
        only the sessions stepping now."""
        now = time.monotonic()
        live = set(self.store)
        with self._lock:
            for sid in [s for s, t in self._last_work.items() if now - t > STEPPING_SECONDS or s not in live]:
                del self._last_work[sid]

    def waiting(self) -> int:
        """Session starts waiting for room in the KV pool."""
        return len(self._admitting)

    def _start(self, job: Job, finished: list[Job]) -> None:
        if job.on_start is not None:
            _quietly(job.on_start, "a work's start callback")
        if not job.cancelled:
            job._advance(first=True)
            self._run_rows([job])
        self._settle(job, finished)

    def _fail(self, job: Job, stage: str, exc: BaseException, finished: list[Job]) -> None:
        """The replica failed at ``stage`` while ``job`` was in it: the job ends with an error
        that says so (UNAVAILABLE: the caller retries elsewhere) and its session, whose state
        that stage may have left half-written, is released."""
        if job.finished:
            return
        log.error("%s: %s failed for session %s: %r", self.store.name, stage, job.session_id, exc)
        job.finished, job.request = True, None
        job.error = ReplicaFaultError(
            f"{self.store.name}: {stage} failed ({type(exc).__name__}); the session was released, retry"
        )
        _quietly(job.work.close, "closing a failed work")
        _quietly(lambda: self.store.release(job.session_id), "releasing a failed work's session")
        self._settle(job, finished)

    def fail_all(self, stage: str, exc: BaseException) -> list[Job]:
        """Every work in flight or queued ends with a ReplicaFaultError (the loop could not run
        an iteration at all); returns them."""
        with self._lock:
            new, self._new = self._new, []
        finished: list[Job] = []
        for job in [*new, *self._admitting, *self._jobs]:
            self._fail(job, stage, exc, finished)
        self._admitting.clear()
        self._jobs.clear()
        return finished

    def _admit(self, new: list[Job], finished: list[Job]) -> None:
        """Start every new work that starts no session, and the session starts the store has
        room for, oldest first, each before the next is judged (a younger one passing an older
        one that does not fit only within the bypass window); the rest wait, or are refused past
        the queue's length or its longest wait."""
        now = time.monotonic()
        for job in new:
            if job.admit_tokens is None:
                self._start(job, finished)
            else:
                job.queued = now
                self._admitting.append(job)
        for job in [j for j in self._admitting if j.cancelled]:
            self._admitting.remove(job)
            self._settle(job, finished)
        for job in [j for j in self._admitting if now - j.queued >= self.max_wait_seconds]:
            self._admitting.remove(job)
            self._refuse(job, f"waited {now - job.queued:.0f} s for KV room", finished)
        blocked_since: float | None = None  # when the oldest start that does not fit began waiting
        for job in list(self._admitting):
            if blocked_since is not None and now - blocked_since >= self.bypass_seconds:
                break  # an older start has waited long enough: the next room is its
            tokens = job.admit_tokens or 0
            try:
                fits = self.store.has_room(tokens) or not self.store.could_ever_fit(tokens)
            except Exception as exc:  # noqa: BLE001 - the pool's accounting failed: this start fails
                self._admitting.remove(job)
                self._fail(job, "admission", exc, finished)
                continue
            if fits:
                self._admitting.remove(job)
                self._start(job, finished)
            elif blocked_since is None:
                blocked_since = job.queued
        while len(self._admitting) > self.max_waiting:
            self._refuse(self._admitting.pop(), f"{self.max_waiting} already wait for it", finished)

    def _refuse(self, job: Job, why: str, finished: list[Job]) -> None:
        job.finished = True
        job.error = ResourceExhaustedError(
            f"{self.store.name}: no KV room for a new session and {why} "
            f"({len(self.store)} live sessions, {self.store.total_kv_bytes} KV bytes allocated)"
        )
        _quietly(job.work.close, "closing a refused work")
        self._settle(job, finished)

    def iterate(self) -> Iteration:
        """Start the works added since the last iteration, run one batched pass over the
        requests the schedule picks, and hand each its result."""
        with self._lock:
            new, self._new = self._new, []
        finished: list[Job] = []
        self._admit(new, finished)
        chosen = self.schedule()
        sizes = [chunk if chunk is not None else self.store.feed_length(job.pending) for job, chunk in chosen]
        rows = sum(sizes)
        prefill_rows = sum(size for (job, _), size in zip(chosen, sizes, strict=True) if job.pending.prefill)
        started = time.perf_counter()
        try:
            results = self.store.run_requests([(job.pending, chunk) for job, chunk in chosen]) if chosen else []
        except Exception as exc:  # noqa: BLE001 - the pass failed (e.g. an allocation): its works fail, the loop goes on
            for job, _ in chosen:
                self._fail(job, "the batched pass", exc, finished)
            chosen, results = [], []
        for (job, _), result in zip(chosen, results, strict=True):
            job._advance(value=result)
        self._run_rows([job for job, _ in chosen])
        # the iteration's cost: its pass and what the works computed from it (sampling math)
        load = PassLoad(rows, len(chosen), time.perf_counter() - started, len(self.store))
        for job, _ in chosen:
            job.last_pass = load
        for job, _ in chosen:
            self._settle(job, finished)
        for job in list(self._jobs):
            if job.cancelled:
                self._settle(job, finished)
        self._forget_quiet()
        return Iteration(len(chosen), rows, prefill_rows, finished)

    @staticmethod
    def _run_rows(jobs: list[Job]) -> None:
        """The rows' math the works ask for after the pass (verdicts, draws), all of it at once
        (``RowsRequest``), until each waits on its next pass or is done."""
        while asking := [(job, job.request) for job in jobs if isinstance(job.request, RowsRequest)]:
            for (job, _), result in zip(asking, run_rows([request for _, request in asking]), strict=True):
                job._advance(value=result)

    def _settle(self, job: Job, finished: list[Job]) -> None:
        if job.cancelled and not job.finished:
            job.finished = True
            # A cancelled prefill releases its session here (copying it into the prefix cache):
            # whatever that raises is the replica's to log, never the loop's end.
            _quietly(job.work.close, "closing a cancelled work")
        if job.finished:
            if job in self._jobs:
                self._jobs.remove(job)
            finished.append(job)
            if job.on_done is not None:
                on_done = job.on_done
                _quietly(lambda: on_done(job), "a work's completion callback")
        elif job not in self._jobs:
            self._jobs.append(job)

    def schedule(self) -> list[tuple[Job, int | None]]:
        """(job, chunk) pairs for this iteration's pass: whole requests first in arrival order,
        then prefill chunks (``chunk``: how many of its tokens to feed; None: the whole request)
        with the budget left; one request per session."""
        budget = self.max_batch_tokens
        chosen: list[tuple[Job, int | None]] = []
        sessions: set[str] = set()
        waiting = sorted((j for j in self._jobs if j.request is not None and not j.cancelled), key=lambda j: j.order)
        # whole requests leave prefills their share of the pass while any prefill waits
        prefilling = any(j.pending.prefill for j in waiting)
        whole_budget = budget - (self.prefill_reserve if prefilling and self.store.batches else 0)
        for job in waiting:
            request = job.pending
            if request.prefill or job.session_id in sessions or len(chosen) >= self.max_batch_sessions:
                continue
            size = self.store.feed_length(request)
            if size > whole_budget and chosen:
                continue  # too big for what is left: first in the next iteration's pass
            chosen.append((job, None))
            sessions.add(job.session_id)
            budget -= size
            whole_budget -= size
        splits = self.store.batch_invariant  # else a split prefill would change its bits
        for job in waiting:
            request = job.pending
            if not request.prefill or job.session_id in sessions or len(chosen) >= self.max_batch_sessions:
                continue
            size = self.store.feed_length(request)
            if splits:
                if budget <= 0:
                    break
                chunk = min(size, budget)
            elif size <= budget or not chosen:
                chunk = size
            else:
                continue
            chosen.append((job, chunk))
            sessions.add(job.session_id)
            budget -= chunk
        return chosen


def _quietly(action: Callable[[], Any], what: str) -> None:
    """Run ``action``; log what it raises (bookkeeping around a work must not end the loop)."""
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - logged; the caller carries on
        log.error("%s raised %r", what, exc)
