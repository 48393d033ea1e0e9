"""gRPC clients for the draft and target services, shaped as the loop's DraftPeer / TargetPeer.

Every RPC has a deadline. gRPC errors become PeerError carrying the status name, except a target
refusing a proposal block (INVALID_ARGUMENT on Verify), which becomes MalformedProposalError so the
loop drops the draft instead of failing the request.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from specdec.engine.commits import Commit
from specdec.errors import MalformedProposalError, PeerError
from specdec.exact.proposal import DraftProposal
from specdec.exact.sampling import SamplingParams
from specdec.exact.verify import TargetVerdict
from specdec.runtime import wire
from specdec.runtime.grpc_server import insecure_channel
from specdec.v1 import draft_pb2, draft_pb2_grpc, engine_pb2, target_pb2, target_pb2_grpc


def _peer_error(who: str, exc: grpc.aio.AioRpcError) -> PeerError:
    return PeerError(exc.code().name, f"{who}: {exc.code().name}: {exc.details()}")


def _start_request(session_id: str, prompt: Sequence[int], params: SamplingParams, **extra):
    return engine_pb2.StartSessionRequest(
        session_id=session_id, prompt_token_ids=list(prompt), sampling=wire.sampling_to_proto(params), **extra
    )


class GrpcDraft:
    def __init__(
        self, address: str, timeout: float = 5.0, channel: grpc.aio.Channel | None = None, draft_kind: str = "model"
    ):
        self.address = address
        self.timeout = timeout
        self.channel = channel or insecure_channel(address)
        self.stub = draft_pb2_grpc.DraftStub(self.channel)
        self.wants_features = draft_kind == "feature"  # it drafts from the target's features

    async def info(self) -> engine_pb2.EngineInfo:
        try:
            return await self.stub.Info(engine_pb2.InfoRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error(f"draft {self.address}", exc) from None

    async def start(self, session_id, prompt, params, features=None):
        request = _start_request(session_id, prompt, params, features=wire.features_to_proto(features))
        try:
            await self.stub.StartSession(request, timeout=self.timeout * 4)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error(f"draft {self.address}", exc) from None

    async def propose(self, session_id: str, step: int, k: int, commit: Commit | None) -> DraftProposal:
        request = draft_pb2.ProposeRequest(session_id=session_id, step=step, k=k, commit=wire.commit_to_proto(commit))
        try:
            reply = await self.stub.Propose(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error(f"draft {self.address}", exc) from None
        return wire.proposal_from_proto(reply.tokens)

    async def release(self, session_id: str) -> None:
        try:
            await self.stub.Release(engine_pb2.ReleaseRequest(session_id=session_id), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error(f"draft {self.address}", exc) from None

    async def close(self) -> None:
        await self.channel.close()


class GrpcTarget:
    def __init__(self, address: str, timeout: float = 60.0, channel: grpc.aio.Channel | None = None):
        self.address = address
        self.timeout = timeout
        self.channel = channel or insecure_channel(address)
        self.stub = target_pb2_grpc.TargetStub(self.channel)
        self.context_length = 0  # set by info()

    async def info(self) -> engine_pb2.EngineInfo:
        try:
            info = await self.stub.Info(engine_pb2.InfoRequest(), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error(f"target {self.address}", exc) from None
        self.context_length = info.context_length
        return info

    async def start(self, session_id, prompt, params, return_features: bool = False):
        """Prefill; with ``return_features`` returns the prompt's features (for a feature draft)."""
        try:
            reply = await self.stub.StartSession(
                _start_request(session_id, prompt, params, return_features=return_features), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise _peer_error(f"target {self.address}", exc) from None
        return wire.features_from_proto(reply.features) if reply.HasField("features") else None

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
            raise _peer_error(f"target {self.address}", exc) from None
        return wire.verdict_from_proto(reply)

    async def release(self, session_id: str) -> None:
        try:
            await self.stub.Release(engine_pb2.ReleaseRequest(session_id=session_id), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error(f"target {self.address}", exc) from None

    async def close(self) -> None:
        await self.channel.close()
