"""Tensor-parallel target: N ranks, one logical target service, whose passes batch.

``specdec target --model M --tp N`` runs a small supervisor that starts N rank processes
(torch.distributed; NCCL when CUDA is available, one GPU per rank; gloo on CPU). Every rank holds
its shard of the model and of every session's KV cache: the lean pass's own sharding
(``specdec.modeling.sharding``) where it covers the model, else transformers' tensor parallelism
(``tp_plan="auto"``). Rank 0 serves gRPC and runs the batch runner; the other ranks replay what
it does, step for step (:func:`worker_loop`), so their passes' collectives line up and their
caches describe the same sessions.

What rank 0 sends (docs/batching.md, "Tensor-parallel targets"): the *journal* of the steps that
change the sessions' state, in the order it takes them -- a work started (the engine call and its
arguments), a batched pass (which works' requests, how many tokens of each), a work closed, a
session released, a direct engine call -- one broadcast per pass or call, just before it. Works are
deterministic functions of the state and their arguments, so a rank that starts the same works
and feeds them the same passes computes what rank 0 computes; its results are dropped.

A pass that fails on any rank may leave that rank's caches unlike the others': the group goes down
(rank 0 signals itself SIGUSR1: NOT_SERVING, deregister, exit; a rank > 0 exits non-zero) and the
supervisor (``replica.supervisor``) kills the rest; the coordinator's failover takes over.
Collectives time out after ``SPECDEC_TP_TIMEOUT_SECONDS``; an idle rank 0 sends a heartbeat at a
quarter of that, so an idle group stays up and a silent one is found.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Generator, Iterator
from datetime import timedelta
from typing import Any

from specdec.engine.sessions import PassRequest, RowsRequest, Session, SessionStore, run_alone, run_rows
from specdec.errors import InvalidArgumentError, SpecdecError
from specdec.modeling.loading import device_identity

log = logging.getLogger("specdec.tp")

TIMEOUT_ENV = "SPECDEC_TP_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_SECONDS = 120.0  # a collective not answered in this long takes the group down
STATS_SECONDS = 2.0  # how stale the ranks' own figures in Info may be


def collective_timeout() -> float:
    """Seconds a collective may wait (``SPECDEC_TP_TIMEOUT_SECONDS``; a bad value is refused clearly)."""
    text = os.environ.get(TIMEOUT_ENV, "")
    if not text.strip():
        return DEFAULT_TIMEOUT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise InvalidArgumentError(TIMEOUT_ENV, f"must be a positive number of seconds, got {text!r}")
    return seconds


def check_divisible(config, tp: int) -> None:
    """A clear error when the model cannot be split ``tp`` ways."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    inter = int(getattr(config, "intermediate_size", 0) or 0)
    problems = [
        f"{name}={value}"
        for name, value in (
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("intermediate_size", inter),
        )
        if value and value % tp
    ]
    if problems:
        raise InvalidArgumentError(
            "tp", f"this model cannot be split {tp} ways: {', '.join(problems)} must be divisible by {tp}"
        )


def local_param_bytes(model) -> int:
    """Bytes of the parameters this rank actually holds (DTensor shards count locally)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def load_shard(spec: str, device: str, dtype, rank: int, world: int):
    """This rank's (model, lean pass) of ``spec`` split ``world`` ways: the lean pass's own shard
    (its passes batch) where it covers the model, else transformers' ``tp_plan="auto"`` shard and
    None (one transformers pass per session, in the same iterations). Every rank takes the same
    branch: it depends on the model alone. The lean shard is cut from the whole checkpoint read on
    the host, so the host holds one whole model per rank while the group loads."""
    from specdec.modeling.lean_llama import LeanLlama, why_not_lean
    from specdec.modeling.loading import load_model
    from specdec.modeling.sharding import Shard, shard_in_place, why_not_shardable

    model = load_model(spec, "cpu", dtype, quiet=rank != 0)
    why = why_not_lean(model) or why_not_shardable(model, world)
    if why is None:
        shard = Shard(rank, world)
        shard_in_place(model, shard)
        model.to(device)  # transformers' wrapped to() hides its signature
        return model, LeanLlama(model, shard=shard)
    del model
    if rank == 0:
        log.warning("tensor parallel through transformers' forward, one pass per session: %s", why)
    return load_model(spec, device, dtype, quiet=rank != 0, tp_plan="auto"), None


# -- rank 0 ------------------------------------------------------------------------------------


class MirroredWork(Generator[PassRequest, Any, Any]):
    """A work of the inner engine (a generator), whose start and close are journaled so that the
    other ranks run the same work; the passes it asks for are journaled by :class:`MirroredStore`."""

    def __init__(self, mirror: DistributedTargetEngine, name: str, args: tuple):
        self.mirror, self.name, self.args = mirror, name, args
        self.job: int | None = None
        self.inner: Any = None

    def send(self, value: Any) -> PassRequest:
        if self.inner is None:
            self.job = self.mirror.journal_start(self.name, self.args)
            self.inner = getattr(self.mirror.engine, self.name)(*self.args)
            return self._track(lambda: next(self.inner))
        return self._track(lambda: self.inner.send(value))

    def throw(self, *exc: Any) -> PassRequest:
        return self._track(lambda: self.inner.throw(*exc))

    def close(self) -> None:
        if self.inner is not None and self.job in self.mirror.requests:  # (a finished work has nothing to close)
            self.mirror.journal(("close", self.job))
            self.inner.close()
            self.mirror.forget(self.job)

    def _track(self, advance) -> PassRequest:
        assert self.job is not None
        try:
            request = advance()
        except BaseException:
            self.mirror.forget(self.job)  # finished (StopIteration) or failed: no more passes
            raise
        self.mirror.requests[self.job] = request
        return request


class MirroredStore:
    """Rank 0's view of its store for the batch runner, the profile and the servicer: what they
    read is the store's; what changes the sessions (a batched pass, a release, scratch sessions)
    is journaled first, so every rank does it."""

    def __init__(self, store: SessionStore, mirror: DistributedTargetEngine):
        self._store = store
        self._mirror = mirror

    # -- reads ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._store)

    def __iter__(self) -> Iterator[str]:
        return iter(self._store)

    @property
    def name(self) -> str:
        return self._store.name

    @property
    def model(self) -> Any:
        return self._store.model

    @property
    def device(self) -> Any:
        return self._store.device

    @property
    def vocab_size(self) -> int:
        return self._store.vocab_size

    @property
    def batches(self) -> bool:
        return self._store.batches

    @property
    def batch_invariant(self) -> bool:
        return self._store.batch_invariant

    @property
    def pass_backend(self) -> str:
        return self._store.pass_backend

    @property
    def total_kv_bytes(self) -> int:
        return self._store.total_kv_bytes

    def get(self, session_id: str) -> Session:
        return self._store.get(session_id)

    def feed_length(self, request: PassRequest) -> int:
        return self._store.feed_length(request)

    def has_room(self, prompt_tokens: int) -> bool:
        return self._store.has_room(prompt_tokens)

    def could_ever_fit(self, prompt_tokens: int) -> bool:
        return self._store.could_ever_fit(prompt_tokens)

    def stale_sessions(self, ttl_seconds: float) -> list[str]:
        return self._store.stale_sessions(ttl_seconds)

    def copied_positions(self, session_id: str) -> int:
        return self._store.copied_positions(session_id)

    # -- what changes the sessions: journaled ------------------------------------------------------

    def run_requests(self, requests: list[tuple[PassRequest, int | None]]) -> list[Any]:
        mirror = self._mirror
        with mirror.lock:
            plan = [(mirror.job_of(request), chunk) for request, chunk in requests]
            mirror.flush(("pass", plan))
            try:
                return self._store.run_requests(requests)
            except BaseException as exc:
                mirror.broken(f"a batched pass failed: {exc!r}")
                raise

    def release(self, session_id: str) -> bool:
        return self._mirror.call("release", session_id)

    @contextlib.contextmanager
    def scratch_sessions(self) -> Iterator[None]:
        with self._store.scratch_sessions():
            self._mirror.journal(("scratch", True))
            try:
                yield
            finally:
                self._mirror.journal(("scratch", False))


class DistributedTargetEngine:
    """Rank 0's engine: every call and work runs here and, through the journal, on every rank."""

    def __init__(self, engine, tp: int, timeout: float | None = None, heartbeat: bool = True):
        """``heartbeat``: keep an idle group up and the ranks' figures fresh (a thread)."""
        self.engine = engine
        self.tp = tp
        self.store = MirroredStore(engine.store, self)
        self.lock = threading.RLock()  # one broadcast + collectives at a time, in one order
        self.requests: dict[int, PassRequest] = {}  # job -> the request its work waits on
        self._journal: list[tuple] = []
        self._jobs = itertools.count()
        self._last_flush = time.monotonic()
        self._timeout = timeout if timeout is not None else collective_timeout()
        self._stopping = threading.Event()
        self._rank_stats: list[dict] = []
        self._stats_at = 0.0
        self._is_broken = False
        self.rank_stats(refresh=True)
        if heartbeat:
            threading.Thread(target=self._beat, name="specdec-tp-heartbeat", daemon=True).start()

    # -- what the servicer, the batch runner and the profile call -------------------------------
    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def feature_size(self) -> int:
        return self.engine.feature_size

    def stats(self) -> dict:
        return self.engine.stats()

    def devices(self) -> list[str]:
        """Every rank's device, as the ranks report them."""
        return [rank.get("device", "") for rank in self.rank_stats()]

    def prefill_work(self, *args) -> MirroredWork:
        return MirroredWork(self, "prefill_work", args)

    def verify_work(self, *args) -> MirroredWork:
        return MirroredWork(self, "verify_work", args)

    def step_work(self, *args) -> MirroredWork:
        return MirroredWork(self, "step_work", args)

    @property
    def batch_store(self) -> MirroredStore:
        """Its works batch: each pass is one batched pass on every rank."""
        return self.store

    def prefill(self, *args):
        return run_alone(self.store, self.prefill_work(*args))

    def verify(self, *args):
        return run_alone(self.store, self.verify_work(*args))

    def commit(self, *args) -> None:
        return self.call("commit", *args)

    def release(self, session_id: str) -> bool:
        return self.call("release", session_id)

    def target_probs(self, *args):
        return self.call("target_probs", *args)

    def expire_idle(self, ttl: float) -> list[str]:
        # Expiry is decided once, on rank 0, and applied everywhere as releases.
        return [sid for sid in self.engine.store.stale_sessions(ttl) if self.release(sid)]

    def rank_stats(self, refresh: bool = False) -> list[dict]:
        """Every rank's own parameter and KV bytes, at most STATS_SECONDS old (gathered by the
        heartbeat: the health probe's Info must not wait behind passes)."""
        if refresh:
            with self.lock:
                self.flush(("stats",))
                self._rank_stats, self._stats_at = _gather_rank_stats(self.engine), time.monotonic()
        return self._rank_stats

    def shutdown(self) -> None:
        self._stopping.set()
        with self.lock:
            self.flush(("shutdown",))

    # -- the journal ----------------------------------------------------------------------------
    def journal(self, step: tuple) -> None:
        with self.lock:
            self._journal.append(step)

    def journal_start(self, name: str, args: tuple) -> int:
        job = next(self._jobs)
        self.journal(("start", job, name, args))
        return job

    def job_of(self, request: PassRequest) -> int:
        for job, pending in self.requests.items():
            if pending is request:
                return job
        raise RuntimeError("a pass for a request no mirrored work made (every rank must run it)")

    def forget(self, job: int) -> None:
        self.requests.pop(job, None)

    def call(self, name: str, *args):
        """An engine call, on every rank."""
        with self.lock:
            self.flush(("call", name, args))
            return getattr(self.engine, name)(*args)

    def flush(self, step: tuple) -> None:
        """Send the journal and ``step`` to the other ranks (the caller holds the lock)."""
        import torch.distributed as dist

        steps, self._journal = [*self._journal, step], []
        dist.broadcast_object_list([steps], src=0)
        self._last_flush = time.monotonic()

    def broken(self, why: str) -> None:
        """The group can no longer be trusted to compute alike: take it down (see the module doc)."""
        if not self._is_broken:
            self._is_broken = True
            log.error("tensor-parallel group: %s; taking the group down", why)
            os.kill(os.getpid(), signal.SIGUSR1)

    def _beat(self) -> None:
        interval = self._timeout / 4
        while not self._stopping.wait(min(interval, STATS_SECONDS)):
            try:
                with self.lock:
                    if self._stopping.is_set():
                        return
                    if time.monotonic() - self._stats_at >= STATS_SECONDS:
                        self.rank_stats(refresh=True)
                    elif time.monotonic() - self._last_flush >= interval:
                        self.flush(("noop",))
            except Exception as exc:  # noqa: BLE001 - a collective failed: the group is gone
                self.broken(f"the heartbeat failed: {exc!r}")
                return


def _gather_rank_stats(engine) -> list[dict]:
    import torch.distributed as dist

    mine = {
        "rank": dist.get_rank(),
        "param_bytes": local_param_bytes(engine.store.model),
        "kv_bytes": engine.store.total_kv_bytes,
        "device": device_identity(engine.store.device),
    }
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


# -- ranks > 0 ---------------------------------------------------------------------------------


class _Replay:
    """A rank's copy of rank 0's works in flight: job -> (work, the request it waits on)."""

    def __init__(self, engine):
        self.engine = engine
        self.works: dict[int, tuple[Any, PassRequest]] = {}
        self.scratch: list[contextlib.AbstractContextManager] = []

    def advance(self, job: int, work, action) -> None:
        try:
            request = action()
            while isinstance(request, RowsRequest):  # rank 0 ran it right after the pass too
                result = run_rows([request])[0]
                request = work.throw(result) if isinstance(result, BaseException) else work.send(result)
            self.works[job] = (work, request)
        except StopIteration:
            self.works.pop(job, None)
        except Exception as exc:  # noqa: BLE001 - rank 0's copy raised the same: its caller was told
            log.debug("a replayed work ended with %r, as on rank 0", exc)
            self.works.pop(job, None)

    def step(self, step: tuple) -> bool:
        """Take one journaled step; False once told to shut down."""
        kind = step[0]
        if kind == "start":
            _, job, name, args = step
            work = getattr(self.engine, name)(*args)
            self.advance(job, work, lambda: next(work))
        elif kind == "pass":
            plan = [(job, chunk) for job, chunk in step[1]]
            requests = [(self.works[job][1], chunk) for job, chunk in plan]
            results = self.engine.store.run_requests(requests)  # raising here fails the rank: see worker_loop
            for (job, _), result in zip(plan, results, strict=True):
                work = self.works[job][0]
                if isinstance(result, BaseException):
                    self.advance(job, work, lambda w=work, r=result: w.throw(r))
                else:
                    self.advance(job, work, lambda w=work, r=result: w.send(r))
        elif kind == "close":
            entry = self.works.pop(step[1], None)
            if entry is not None:
                entry[0].close()
        elif kind == "call":
            _, name, args = step
            try:
                getattr(self.engine, name)(*args)
            except SpecdecError as exc:
                log.debug("%s refused (%s), as on rank 0", name, exc)
        elif kind == "scratch":
            if step[1]:
                scratch = self.engine.store.scratch_sessions()
                scratch.__enter__()
                self.scratch.append(scratch)
            else:
                self.scratch.pop().__exit__(None, None, None)
        elif kind == "stats":
            _gather_rank_stats(self.engine)
        elif kind == "shutdown":
            return False
        return True


def worker_loop(engine) -> int:
    """Ranks > 0: replay rank 0's journal until it says shutdown; returns the exit code.

    A work that raises a request error here raised it on rank 0 too, from the same state, and
    rank 0 told its caller; the group goes on. Any other failure (a pass, a collective, a direct
    call with another error than a ``SpecdecError``) means this rank's shard of the sessions may no
    longer match the others': it is logged with its traceback and the rank exits non-zero, and the
    supervisor takes the whole group down (a target that might compute wrong logits must not serve)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    replay = _Replay(engine)
    while True:
        box: list = [None]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception:
            log.exception("rank %d: no word from rank 0 within the collective timeout; failing the group", rank)
            return 1
        try:
            for step in box[0]:
                if not replay.step(step):
                    return 0
        except Exception:
            log.exception("rank %d: a replayed step failed; this rank may now differ from rank 0", rank)
            return 1


def init_rank(device_arg: str | None):
    """Join the process group from the environment; return (rank, world, device)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and (device_arg is None or device_arg.startswith("cuda"))
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        device = "cpu"
    dist.init_process_group(
        "nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=collective_timeout())
    )
    return rank, world, device
