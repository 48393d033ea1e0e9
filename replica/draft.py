"""The draft gRPC service: a thin adapter over DraftEngine / NgramDraft (parse, call the engine,
map errors; no sampling math here: docs/architecture.md)."""

from __future__ import annotations

import argparse
import dataclasses

from replica.servicer import (
    ServiceSpec,
    SessionServicer,
    add_replica_arguments,
    apply_pass_arguments,
    cache_limits,
    main_async,
    replica_spec,
)
from specdec.engine.interface import ProposingEngine
from specdec.errors import InvalidArgumentError
from specdec.exact.proposal import MAX_BLOCK
from specdec.runtime import security, wire
from specdec.runtime.grpc_server import grpc_method
from specdec.telemetry import tracing
from specdec.v1 import draft_pb2_grpc, engine_pb2

SERVICE = "specdec.v1.Draft"


class DraftServicer(SessionServicer, draft_pb2_grpc.DraftServicer):
    kind = "draft"

    engine: ProposingEngine

    def __init__(self, engine: ProposingEngine, model_spec: str, tokenizer_fingerprint: str = ""):
        self.engine = engine
        self.model_spec = model_spec
        self.fingerprint = tokenizer_fingerprint

    @grpc_method
    async def Propose(self, request, context):
        if not 0 <= request.k <= MAX_BLOCK:
            raise InvalidArgumentError("k", f"must be in [0, {MAX_BLOCK}], got {request.k}")
        if len(request.assumed) > MAX_BLOCK + 1:  # (the engine checks the ids)
            raise InvalidArgumentError("assumed", f"at most {MAX_BLOCK + 1} tokens, got {len(request.assumed)}")
        rejections, assumed = request.rejection_branches, len(request.assumed)
        if not 0 <= rejections <= assumed:
            raise InvalidArgumentError(
                "rejection_branches", f"must be in [0, {assumed}] (len(assumed)), got {rejections}"
            )
        commit = wire.optional_commit(request)  # the previous step's commit, applied first by the engine
        with tracing.tracer().start_as_current_span("draft.propose") as span:
            span.set_attribute("specdec.session_id", request.session_id)
            span.set_attribute("specdec.step", request.step)
            span.set_attribute("specdec.k", request.k)
            span.set_attribute("specdec.committed_tokens", len(commit.tokens) if commit else 0)
            span.set_attribute("specdec.assumed_tokens", len(request.assumed))
            # one hop to the model thread for commit + proposal (each hop costs a thread hand-off)
            proposal, load = await self.run_work_with_load(
                request.session_id,
                self.engine.propose_work(
                    request.session_id,
                    request.step,
                    request.k,
                    commit,
                    list(request.assumed),
                    request.rejection_branches,
                ),
            )
            span.set_attribute("specdec.proposed", len(proposal))
        if load is not None:  # a draft pass's size is its sessions: each advances one position
            load = dataclasses.replace(load, size=load.sessions)
        return wire.proposal_to_proto(proposal, load)

    def prefill_arguments(self, request) -> tuple:
        if self.engine.kind != "feature":
            return ()
        return (wire.features_from_proto(request.features) if request.HasField("features") else None,)

    @grpc_method
    async def Info(self, request, context):
        stats = self.engine.stats()
        return engine_pb2.EngineInfo(
            kind="draft",
            model_id=self.model_spec,
            vocab_size=self.engine.vocab_size,
            context_length=self.engine.context_length,
            tokenizer_fingerprint=self.fingerprint,
            draft_kind=self.engine.kind,
            feature_size=self.engine.feature_size,
            **self.replica_info(stats),
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="draft model spec (HF dir, .gguf, cached id) or 'ngram'")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    add_replica_arguments(p)
    p.add_argument("--vocab-size", type=int, default=0, help="ngram only: the target's vocabulary size (0 = unchecked)")
    p.add_argument("--top-m", type=int, default=64, help="ship at most M tokens of q per position (0 = all)")
    p.add_argument("--eps", type=float, default=1e-4, help="ship the smallest set covering 1-eps of q (0 = off)")


def build_engine(args):
    from specdec.engine.draft import draft_engine_for
    from specdec.engine.ngram import NgramDraft

    if args.model == "ngram":
        return NgramDraft(args.vocab_size or (1 << 31) - 1, max_sessions=args.max_sessions)
    import torch

    from specdec.modeling.loading import default_device, load_model, parse_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or default_device()
    model = load_model(args.model, device, parse_dtype(args.dtype, device))
    return draft_engine_for(model, cache_limits(args, device), top_m=args.top_m, eps=args.eps)


def main(args) -> int:
    security.apply_arguments(args)  # TLS / token flags -> this process's environment
    apply_pass_arguments(args)

    from specdec.engine.draft import DraftEngine, FeatureDraftEngine
    from specdec.modeling.grammar import Grammars
    from specdec.modeling.loading import eos_token_ids, tokenizer_fingerprint, try_load_tokenizer

    def spec() -> ServiceSpec:
        engine = build_engine(args)
        tokenizer = None if args.model == "ngram" else try_load_tokenizer(args.model)
        fingerprint = "" if args.model == "ngram" else tokenizer_fingerprint(tokenizer)
        if isinstance(engine, (DraftEngine, FeatureDraftEngine)) and tokenizer is not None:  # masked proposals
            eos = sorted(eos_token_ids(engine.store.model, tokenizer))
            engine.store.grammars = Grammars(tokenizer, engine.vocab_size, eos)
        return replica_spec(
            args,
            kind="draft",
            full_service_name=SERVICE,
            add_to_server=draft_pb2_grpc.add_DraftServicer_to_server,
            servicer=DraftServicer(engine, args.model, fingerprint),
            engine=engine,
            fingerprint=fingerprint,
            vocab_size=args.vocab_size if args.model == "ngram" else engine.vocab_size,
            feature_size=engine.feature_size,
            draft_kind=engine.kind,
        )

    return main_async(spec, "draft")
