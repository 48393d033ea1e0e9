"""Every model call of a draft/target service runs on the process's one model thread.

Why it matters (replica/model_thread.py): PyTorch's CPU kernels run on an OpenMP team owned by the
calling thread; passes spread over a thread pool gave the target service one team per pool thread
and made a SmolLM2 Verify 1.5-2.5x slower on the 2-core machine.
"""

import asyncio
import threading

from coordinator.peers import GrpcDraft, GrpcTarget
from replica.draft import DraftServicer
from replica.model_thread import on_model_thread
from replica.target import TargetServicer
from specdec.engine.commits import Commit
from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.exact.sampling import SamplingParams
from specdec.runtime import grpc_server as srv
from specdec.v1 import draft_pb2_grpc, target_pb2_grpc


class ThreadLog:
    """Wraps an engine; records the thread every method call runs on (a work's: where it runs,
    not where the servicer builds it)."""

    def __init__(self, engine, names):
        self._engine = engine
        self.threads: list[tuple[str, int]] = []
        self.calls: list[tuple[str, tuple]] = []
        for name in names:
            setattr(self, name, self._recorded(name, getattr(engine, name)))

    def _recorded(self, name, method):
        def call(*args, **kwargs):
            if name.endswith("_work"):
                return self._run_recorded(name, args, method(*args, **kwargs))
            self._record(name, args)
            return method(*args, **kwargs)

        return call

    def _record(self, name, args):
        self.threads.append((name, threading.get_ident()))
        self.calls.append((name, args))

    def _run_recorded(self, name, args, work):
        self._record(name, args)  # when the work starts
        return (yield from work)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_on_model_thread_uses_one_thread_and_keeps_the_context():
    import contextvars

    var = contextvars.ContextVar("var", default="unset")

    async def main():
        loop_thread = threading.get_ident()

        async def one(i):
            var.set(f"caller {i}")
            return await on_model_thread(lambda: (threading.get_ident(), var.get()))

        results = await asyncio.gather(*(one(i) for i in range(8)))
        return loop_thread, results

    loop_thread, results = asyncio.run(main())
    threads = {t for t, _ in results}
    assert len(threads) == 1 and loop_thread not in threads
    assert [value for _, value in results] == [f"caller {i}" for i in range(8)]


def test_concurrent_sessions_run_every_engine_call_on_the_model_thread(target_model, draft_model):
    target = ThreadLog(TargetEngine(target_model), ["prefill_work", "verify_work", "commit", "release"])
    draft = ThreadLog(DraftEngine(draft_model), ["prefill_work", "propose_work", "commit", "release"])

    async def main():
        server = srv.create_server()
        target_pb2_grpc.add_TargetServicer_to_server(TargetServicer(target, "tiny-target"), server)
        draft_pb2_grpc.add_DraftServicer_to_server(DraftServicer(draft, "tiny-draft"), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        t_peer, d_peer = GrpcTarget(address), GrpcDraft(address)
        try:

            async def session(i):
                sid, prompt = f"s{i}", [1, 2, 3 + i]
                params = SamplingParams(temperature=1.0, seed=i + 1)
                await asyncio.gather(t_peer.start(sid, prompt, params), d_peer.start(sid, prompt, params))
                commit, length = None, len(prompt)
                for step in (1, 2, 3):
                    proposal = await d_peer.propose(sid, step, 3, commit)
                    verdict = await t_peer.verify(sid, step, proposal, commit)
                    emitted = (verdict.recovered[0],) if proposal.tokens else (verdict.bonus,)
                    commit, length = Commit(step, length, emitted), length + 1
                await asyncio.gather(t_peer.release(sid), d_peer.release(sid))

            await asyncio.gather(*(session(i) for i in range(4)))
        finally:
            await t_peer.close()
            await d_peer.close()
            await server.stop(None)
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    calls = target.threads + draft.threads
    assert {name for name, _ in calls} >= {"prefill_work", "verify_work", "propose_work", "release"}
    # a step's commit rides on the next Propose/Verify and is applied in that same model-thread hop
    for log, method in ((draft, "propose_work"), (target, "verify_work")):
        carried = [args for name, args in log.calls if name == method and any(isinstance(a, Commit) for a in args)]
        assert len(carried) == 4 * 2, f"{method} calls carrying the previous step's commit: {len(carried)}"
    assert len({thread for _, thread in calls}) == 1, "engine calls ran on several threads"
    assert calls[0][1] != loop_thread, "engine calls must not block the event loop"


def test_a_release_queued_behind_a_busy_model_thread_runs_after_its_deadline(target_model):
    """Issue 24, item 11: a Release whose caller gave up while a long pass held the model thread
    must still free the session (before: the queued call was cancelled with the RPC, and the
    session held its KV until the TTL)."""
    import grpc
    import pytest

    from replica.model_thread import model_executor
    from specdec.v1 import engine_pb2

    engine = TargetEngine(target_model)

    async def main():
        server = srv.create_server()
        target_pb2_grpc.add_TargetServicer_to_server(TargetServicer(engine, "tiny-target"), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        peer = GrpcTarget(f"127.0.0.1:{port}")
        try:
            await peer.start("s", [1, 2, 3], SamplingParams(temperature=1.0, seed=1))
            assert engine.stats()["live_sessions"] == 1
            busy = threading.Event()
            model_executor().submit(busy.wait, 5.0)  # a long pass holds the model thread
            with pytest.raises(grpc.aio.AioRpcError) as info:  # a raw stub: no client retry
                await peer.stub.Release(engine_pb2.ReleaseRequest(session_id="s"), timeout=0.3)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            busy.set()
            await on_model_thread(lambda: None)  # what was queued before this has run
            return engine.stats()["live_sessions"]
        finally:
            await peer.close()
            await server.stop(None)

    assert asyncio.run(main()) == 0


def test_a_failed_release_is_retried_in_the_background_and_close_waits_for_it(monkeypatch):
    """The coordinator's side: a Release refused for want of time is tried again, and closing
    the peer waits for it instead of cutting it off (the shutdown race of issue 24, item 16)."""
    import grpc
    import pytest

    from coordinator import peers
    from specdec.errors import PeerError

    monkeypatch.setattr(peers, "RELEASE_RETRY_DELAYS_S", (0.05, 0.05, 0.05))

    class Refusal(grpc.aio.AioRpcError):
        def __init__(self, code):
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "busy")

    class FlakyStub:
        def __init__(self, failures):
            self.failures, self.calls = failures, []

        async def Release(self, request, timeout):
            self.calls.append(request.session_id)
            if len(self.calls) <= self.failures:
                raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED)
            await asyncio.sleep(0.05)

    async def main():
        peer = GrpcTarget("127.0.0.1:1")
        peer.stub = FlakyStub(failures=2)
        with pytest.raises(PeerError, match="DEADLINE_EXCEEDED"):
            await peer.release("s")
        await peer.close()  # waits for the retries
        flaky_then_fine = list(peer.stub.calls)
        peer = GrpcTarget("127.0.0.1:1")
        peer.stub = FlakyStub(failures=99)
        with pytest.raises(PeerError):
            await peer.release("t")
        await peer.close()
        return flaky_then_fine, len(peer.stub.calls)

    flaky_then_fine, hopeless_calls = asyncio.run(main())
    assert flaky_then_fine == ["s", "s", "s"]  # one try, two retries, the second of them succeeds
    assert hopeless_calls == 1 + 3  # bounded: the TTL frees what the retries could not


def test_the_model_threads_busy_seconds_count_what_it_runs():
    """specdec_model_busy_seconds is the autoscaling signal (docs/autoscaling.md): it grows by
    the time engine calls take on the model thread."""
    import time

    from specdec.telemetry import metrics

    before = metrics.MODEL_BUSY._value.get()
    asyncio.run(on_model_thread(time.sleep, 0.2))
    assert metrics.MODEL_BUSY._value.get() - before >= 0.2
