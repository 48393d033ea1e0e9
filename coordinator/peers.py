"""gRPC clients for the draft and target services, shaped as the loop's DraftPeer / TargetPeer.

Every RPC has a deadline. gRPC errors become PeerError carrying the status name, except a target
refusing a proposal block (INVALID_ARGUMENT on Verify), which becomes MalformedProposalError so the
loop drops the draft instead of failing the request.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import Any

import grpc

from specdec.engine.batching import PassLoad
from specdec.engine.commits import Commit
from specdec.errors import MalformedProposalError, PeerError
from specdec.exact.proposal import DraftProposal
from specdec.exact.sampling import SamplingParams
from specdec.exact.verify import TargetVerdict
from specdec.loop.generate import DraftPeer, TargetPeer
from specdec.loop.load_aware_k import CostCurve, SpeculationRegime
from specdec.runtime import wire
from specdec.runtime.grpc_server import client_channel
from specdec.v1 import draft_pb2, draft_pb2_grpc, engine_pb2, target_pb2, target_pb2_grpc

# What gRPC's core says when the connection died under a call (a replica killed mid-RPC): the
# replica is gone, not broken -- UNAVAILABLE, so the loop fails over as for any lost replica.
TRANSPORT_FAILURE = "Internal error from Core"
# A Release that failed for want of time or of the replica (queued behind a busy model thread, a
# replica restarting) is tried again in the background at these delays; then the replica's session
# TTL frees it. Bounded: past MAX_PENDING_RELEASES retries in flight, the TTL alone.
RELEASE_RETRY_DELAYS_S = (0.5, 2.0, 8.0)
RETRYABLE_RELEASE = frozenset({"DEADLINE_EXCEEDED", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED"})
MAX_PENDING_RELEASES = 1024
CLOSE_GRACE_S = 3.0  # how long close() waits for releases in flight before closing the channel

log = logging.getLogger("specdec.coordinator.peers")


# The statuses gRPC's own transport gives a call to a replica that is gone, slow or restarting.
# Their details are the transport's (peer addresses in any spelling, socket paths, DNS names,
# errno text), so the client is told a fixed line instead; the log has the details.
TRANSPORT_STATUSES = {
    "UNAVAILABLE": "unreachable, restarting or shutting down; retry",
    "DEADLINE_EXCEEDED": "did not answer in time",
    "CANCELLED": "the call was cancelled",
    "UNKNOWN": "failed; the coordinator's log has the details",
}


def _peer_error(kind: str, address: str, exc: grpc.aio.AioRpcError) -> PeerError:
    """A replica's failure as the coordinator passes it on: its kind and status, never its
    address (clients must not learn the internal topology; the log line here has it)."""
    code = exc.code().name
    if code == "INTERNAL" and exc.details() == TRANSPORT_FAILURE:
        code = "UNAVAILABLE"
    log.info("%s %s answered %s: %s", kind, address, code, exc.details())
    details = TRANSPORT_STATUSES.get(code) or _without_addresses(exc.details() or "")
    if code == "INVALID_ARGUMENT" and details.startswith("sampling."):
        return PeerError(code, details)  # a field of the client's own request: its 400 names it first
    return PeerError(code, f"{kind} replica: {code}: {details}")


_ADDRESS = re.compile(r"(ipv[46]:)?(\[[0-9a-fA-F:]+\]|\d{1,3}(\.\d{1,3}){3}|[\w.-]+\.[\w-]+)(:\d{1,5})\b")


def _without_addresses(text: str) -> str:
    """``text`` with HOST:PORT and IP:PORT spans (as gRPC's transport errors name peers) removed."""
    return _ADDRESS.sub("<address>", text)


def _start_request(session_id: str, prompt: Sequence[int], params: SamplingParams, **extra):
    return engine_pb2.StartSessionRequest(
        session_id=session_id,
        prompt_token_ids=list(prompt),
        sampling=wire.sampling_to_proto(params),
        prompt_length=params.prompt_length,
        eos_token_ids=list(params.eos_token_ids),
        cache_salt=params.cache_salt,
        **extra,
    )


class _LoadReports:
    """What a replica reports of its batched passes: its profiled cost curve (asked once, then
    refreshed from every reported pass, shared by all sessions on the replica) and each
    session's latest pass (taken by the loop after each call)."""

    kind = ""
    address = ""
    last_live_sessions = 0  # the replica's live sessions in its latest report to any session
    _curve: CostCurve | None = None
    _curve_asked: asyncio.Future | None = None

    release_timeout = 10.0
    stub: Any  # the replica's service stub (Draft or Target: both have Release)

    def _init_reports(self) -> None:
        self._loads: dict[str, PassLoad] = {}
        self._cached: dict[str, int] = {}  # per session: prompt positions its start copied (until taken)
        self._releasing: set[asyncio.Future] = set()  # releases in flight, first tries and retries

    async def release(self, session_id: str) -> None:
        """Free the session on the replica. The call survives the caller's cancellation, a
        retryable failure is retried in the background, and close() waits for what is in flight:
        a session is never left behind for the TTL when it can be freed now."""
        self._loads.pop(session_id, None)
        self._cached.pop(session_id, None)
        first = self._track(asyncio.ensure_future(self._release_call(session_id)))
        try:
            await asyncio.shield(first)
        except grpc.aio.AioRpcError as exc:
            if exc.code().name in RETRYABLE_RELEASE and len(self._releasing) < MAX_PENDING_RELEASES:
                self._track(asyncio.ensure_future(self._retry_release(session_id)))
            raise _peer_error(self.kind, self.address, exc) from None

    async def _release_call(self, session_id: str) -> None:
        await self.stub.Release(engine_pb2.ReleaseRequest(session_id=session_id), timeout=self.release_timeout)

    async def _retry_release(self, session_id: str) -> None:
        for delay in RELEASE_RETRY_DELAYS_S:
            await asyncio.sleep(delay)
            try:
                await self._release_call(session_id)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code().name not in RETRYABLE_RELEASE:
                    return
        log.warning("%s %s: release of %s failed; its TTL will free it", self.kind, self.address, session_id)

    def _track(self, future: asyncio.Future) -> asyncio.Future:
        self._releasing.add(future)
        future.add_done_callback(_forget_from(self._releasing))
        return future

    async def ping(self, timeout: float) -> bool:
        """Whether the replica answers its Info within ``timeout`` (the health check's probe)."""
        try:
            await self.stub.Info(engine_pb2.InfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return True

    async def drain_releases(self, timeout: float = CLOSE_GRACE_S) -> None:
        """Wait up to ``timeout`` for releases in flight; cancel what is left."""
        pending = set(self._releasing)
        if pending:
            _done, late = await asyncio.wait(pending, timeout=timeout)
            for future in late:
                future.cancel()

    async def info(self) -> engine_pb2.EngineInfo:
        raise NotImplementedError

    async def cost_curve(self) -> CostCurve | None:
        """The replica's curve, asked once: requests that start while the answer is on its way
        wait for it (not None, which would put them on another policy)."""
        if self._curve_asked is None:
            self._curve_asked = asyncio.ensure_future(self._ask_curve())
        await asyncio.shield(self._curve_asked)
        return self._curve

    async def _ask_curve(self) -> None:
        try:
            self._curve = wire.cost_curve_from_info(await self.info())
        except PeerError:
            self._curve = None

    def _report(self, session_id: str, msg: engine_pb2.PassLoad) -> None:
        load = wire.pass_load_from_proto(msg)
        if load is None:
            return
        self._loads[session_id] = load
        self.last_live_sessions = load.live_sessions
        if self._curve is not None:
            self._curve.observe(load.size, load.seconds)

    @property
    def current_curve(self) -> CostCurve | None:
        return self._curve

    def take_load(self, session_id: str) -> PassLoad | None:
        return self._loads.pop(session_id, None)


def _forget_from(tracked: set):
    def forget(future: asyncio.Future) -> None:
        tracked.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: a failed release someone stopped waiting for is not an error

    return forget


class GrpcDraft(_LoadReports, DraftPeer):
    kind = "draft"

    def __init__(
        self, address: str, timeout: float = 5.0, channel: grpc.aio.Channel | None = None, draft_kind: str = "model"
    ):
        self.address = address
        self.timeout = timeout
        self.channel = channel or client_channel(address)
        self.stub = draft_pb2_grpc.DraftStub(self.channel)
        self.release_timeout = timeout
        self.wants_features = draft_kind == "feature"  # it drafts from the target's features
        self._init_reports()

    async def info(self) -> engine_pb2.EngineInfo:
        try:
            return await self.stub.Info(engine_pb2.InfoRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error("draft", self.address, exc) from None

    async def start(self, session_id, prompt, params, features=None):
        request = _start_request(session_id, prompt, params, features=wire.features_to_proto(features))
        try:
            await self.stub.StartSession(request, timeout=self.timeout * 4)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error("draft", self.address, exc) from None

    async def propose(
        self,
        session_id: str,
        step: int,
        k: int,
        commit: Commit | None,
        assumed: Sequence[int] = (),
        rejections: int = 0,
    ) -> DraftProposal:
        request = draft_pb2.ProposeRequest(
            session_id=session_id,
            step=step,
            k=k,
            commit=wire.commit_to_proto(commit),
            assumed=list(assumed),
            rejection_branches=rejections,
        )
        try:
            reply = await self.stub.Propose(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error("draft", self.address, exc) from None
        self._report(session_id, reply.load)
        return wire.proposal_from_proto(reply.tokens, reply.branches)

    async def close(self) -> None:
        await self.drain_releases()
        await self.channel.close()


class GrpcTarget(_LoadReports, TargetPeer):
    kind = "target"

    def __init__(self, address: str, timeout: float = 60.0, channel: grpc.aio.Channel | None = None):
        self.address = address
        self.timeout = timeout
        self.channel = channel or client_channel(address)
        self.stub = target_pb2_grpc.TargetStub(self.channel)
        self.context_length = 0  # set by info()
        self._init_reports()
        self.regime = SpeculationRegime()  # whether its sessions speculate, measured (specdec.loop.load_aware_k)

    async def info(self) -> engine_pb2.EngineInfo:
        try:
            info = await self.stub.Info(engine_pb2.InfoRequest(), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error("target", self.address, exc) from None
        self.context_length = info.context_length
        return info

    async def start(self, session_id, prompt, params, return_features: bool = False):
        """Prefill; with ``return_features`` returns the prompt's features (for a feature draft)."""
        try:
            reply = await self.stub.StartSession(
                _start_request(session_id, prompt, params, return_features=return_features), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise _peer_error("target", self.address, exc) from None
        if reply.cached_tokens:  # taken by the loop right after this returns
            self._cached[session_id] = reply.cached_tokens
        return wire.features_from_proto(reply.features) if reply.HasField("features") else None

    def take_cached_tokens(self, session_id: str) -> int:
        """The prompt positions the session's start copied from the replica's prefix cache."""
        return self._cached.pop(session_id, 0)

    async def verify(
        self, session_id: str, step: int, proposal: DraftProposal, commit: Commit | None, return_features: bool = False
    ) -> TargetVerdict:
        async def chunks():
            # The header, then the block streamed one proposal (token + its q) per message.
            yield target_pb2.VerifyChunk(
                session_id=session_id, step=step, commit=wire.commit_to_proto(commit), return_features=return_features
            )
            for token in wire.proposed_tokens_to_proto(proposal):
                yield target_pb2.VerifyChunk(proposals=[token])

        try:
            reply = await self.stub.Verify(chunks(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and proposal.tokens:
                raise MalformedProposalError("proposals", exc.details() or "refused by the target") from None
            raise _peer_error("target", self.address, exc) from None
        self._report(session_id, reply.load)
        return wire.verdict_from_proto(reply)

    async def close(self) -> None:
        await self.drain_releases()
        await self.channel.close()
