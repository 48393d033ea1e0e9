"""The target gRPC service: a thin adapter over TargetEngine. Verify is client-streaming: the
coordinator streams the proposal block (tokens with their sparse q) and half-closes; the target
runs one pass and answers with the target side of the verifier."""

from __future__ import annotations

import argparse

from replica.servicer import (
    ServiceSpec,
    SessionServicer,
    add_replica_arguments,
    apply_pass_arguments,
    cache_limits,
    main_async,
    replica_spec,
)
from specdec.engine.interface import VerifyingEngine
from specdec.errors import InvalidArgumentError
from specdec.exact.proposal import MAX_BLOCK
from specdec.runtime import security, wire
from specdec.runtime.grpc_server import grpc_method
from specdec.telemetry import tracing
from specdec.v1 import engine_pb2, target_pb2_grpc

SERVICE = "specdec.v1.Target"


class TargetServicer(SessionServicer, target_pb2_grpc.TargetServicer):
    kind = "target"

    engine: VerifyingEngine

    def __init__(
        self, engine: VerifyingEngine, model_spec: str, eos_token_ids=(), tokenizer_fingerprint: str = "", tp: int = 1
    ):
        self.engine = engine
        self.tp = tp
        self.model_spec = model_spec
        self.eos_token_ids = sorted(eos_token_ids)
        self.fingerprint = tokenizer_fingerprint

    @grpc_method
    async def Verify(self, request_iterator, context):
        header = None
        proposals = []
        async for chunk in request_iterator:
            if header is None:
                header = chunk
            elif chunk.session_id and chunk.session_id != header.session_id:
                raise InvalidArgumentError("session_id", "every chunk of one Verify stream must name the same session")
            proposals.extend(chunk.proposals)
            # bounded as it is read: a client stream must not grow this replica's memory at will
            if len(proposals) > MAX_BLOCK:
                raise InvalidArgumentError("proposals", f"more than {MAX_BLOCK} proposals in one block")
            if any(len(p.q.token_ids) > self.engine.vocab_size for p in chunk.proposals):
                raise InvalidArgumentError("q", f"a q with more entries than the vocabulary ({self.engine.vocab_size})")
        if header is None or not header.session_id:
            raise InvalidArgumentError("session_id", "the Verify stream must start with a chunk naming the session")
        block = wire.proposal_from_proto(proposals)
        commit = wire.optional_commit(header)  # the previous step's commit, applied first by the engine
        with tracing.tracer().start_as_current_span("target.verify") as span:
            span.set_attribute("specdec.session_id", header.session_id)
            span.set_attribute("specdec.step", header.step)
            span.set_attribute("specdec.k", len(block))
            span.set_attribute("specdec.committed_tokens", len(commit.tokens) if commit else 0)
            # one hop to the model thread for commit + verify (each hop costs a thread hand-off)
            verdict, load = await self.run_work_with_load(
                header.session_id,
                self.engine.verify_work(
                    header.session_id, header.step, block.tokens, block.q, commit, header.return_features
                ),
            )
        return wire.verdict_to_proto(verdict, load)

    def prefill_arguments(self, request) -> tuple:
        return (request.return_features,)

    @grpc_method
    async def Info(self, request, context):
        stats = self.engine.stats()
        ranks = self.engine.rank_stats()  # tensor parallel: every rank's own numbers (a moment old)
        return engine_pb2.EngineInfo(
            tp_size=self.tp,
            rank_param_bytes=[r["param_bytes"] for r in ranks],
            rank_kv_bytes=[r["kv_bytes"] for r in ranks],
            kind="target",
            model_id=self.model_spec,
            vocab_size=self.engine.vocab_size,
            context_length=self.engine.context_length,
            eos_token_ids=self.eos_token_ids,
            tokenizer_fingerprint=self.fingerprint,
            feature_size=self.engine.feature_size,
            **self.replica_info(stats),
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="target model spec (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--port", type=int, default=50062)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    add_replica_arguments(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one device each; gloo on CPU)")


def main(args) -> int:
    security.apply_arguments(args)  # TLS / token flags -> this process's environment
    apply_pass_arguments(args)
    import os
    import sys

    tp = args.tp
    if tp < 1:
        raise SystemExit("specdec target: --tp must be >= 1")
    if tp > 1 and not os.environ.get("SPECDEC_TP_RANK_PROCESS"):
        from replica.supervisor import supervise
        from specdec.engine.tensor_parallel import check_divisible, collective_timeout
        from specdec.modeling.loading import load_config

        check_divisible(load_config(args.model), tp)  # fail before starting any rank
        collective_timeout()  # (a bad SPECDEC_TP_TIMEOUT_SECONDS too)
        return supervise(["target", *sys.argv[sys.argv.index("target") + 1 :]], tp)

    rank = 0
    on_stop = None

    def spec() -> ServiceSpec:
        nonlocal rank, on_stop
        import torch

        from specdec.engine.target import TargetEngine
        from specdec.modeling.grammar import Grammars
        from specdec.modeling.loading import (
            default_device,
            eos_token_ids,
            load_model,
            parse_dtype,
            tokenizer_fingerprint,
            try_load_tokenizer,
        )

        if args.threads:
            torch.set_num_threads(args.threads)
        elif tp > 1 and not torch.cuda.is_available():
            # the ranks share the host's cores: N ranks of a thread team each the size of the host
            # wait on each other's collectives while their teams fight for the same cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
        device = args.device or default_device()
        tokenizer = try_load_tokenizer(args.model)

        def serve_constraints(engine: TargetEngine) -> None:
            # structured output: every rank of a group compiles and follows the constraints, since
            # every rank replays the same works (their masks included)
            if tokenizer is not None:
                engine.store.grammars = Grammars(tokenizer, engine.vocab_size, sorted(eos_token_ids(model, tokenizer)))

        if tp > 1:
            from specdec.engine.tensor_parallel import DistributedTargetEngine, init_rank, load_shard, worker_loop

            rank, _, device = init_rank(args.device)
            model, runner = load_shard(args.model, device, parse_dtype(args.dtype, device), rank, tp)
            shard = TargetEngine(model, cache_limits(args, device, ranks_on_host=tp), kv_shards=tp, runner=runner)
            serve_constraints(shard)
            if rank != 0:
                raise SystemExit(worker_loop(shard))
            mirrored = DistributedTargetEngine(shard, tp)
            on_stop = mirrored.shutdown
            engine: TargetEngine | DistributedTargetEngine = mirrored
        else:
            model = load_model(args.model, device, parse_dtype(args.dtype, device))
            engine = TargetEngine(model, cache_limits(args, device))
            serve_constraints(engine)
        fingerprint = tokenizer_fingerprint(tokenizer)
        eos = eos_token_ids(model, tokenizer)
        return replica_spec(
            args,
            kind="target",
            full_service_name=SERVICE,
            add_to_server=target_pb2_grpc.add_TargetServicer_to_server,
            servicer=TargetServicer(engine, args.model, eos, fingerprint, tp),
            engine=engine,
            fingerprint=fingerprint,
            vocab_size=engine.vocab_size,
            feature_size=engine.feature_size,
            on_stop=lambda: on_stop() if on_stop else None,
        )

    return main_async(spec, "target")
