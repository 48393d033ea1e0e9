"""Conversions between the core's dataclasses and the protobuf messages: the one place where
wire formats are read and written. Reading a request validates it (InvalidArgumentError names the
field), so servicers stay thin."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import torch

from specdec.engine.batching import PassLoad
from specdec.engine.commits import Commit
from specdec.errors import InvalidArgumentError, MalformedProposalError
from specdec.exact.constraint import Constraint
from specdec.exact.logprobs import RowLogprobs
from specdec.exact.proposal import Branch, DraftProposal
from specdec.exact.sampling import SamplingParams
from specdec.exact.sparse import SparseDist
from specdec.exact.verify import TargetVerdict
from specdec.loop.load_aware_k import CostCurve
from specdec.loop.stats import StepStats
from specdec.v1 import coordinator_pb2, draft_pb2, engine_pb2, target_pb2


# -- sampling params -------------------------------------------------------------------------
def sampling_from_proto(msg: coordinator_pb2.SamplingParams, default_max_new_tokens: int = 64) -> SamplingParams:
    """Public-API params -> validated SamplingParams (unset optionals take their defaults)."""
    if msg.max_new_tokens < 0:
        raise InvalidArgumentError("sampling.max_new_tokens", "must be >= 0 (0 = server default)")

    def opt(name: str, default: float) -> float:
        return float(getattr(msg, name)) if msg.HasField(name) else default

    try:
        return SamplingParams(
            temperature=opt("temperature", 1.0),
            top_k=int(msg.top_k),
            top_p=opt("top_p", 1.0),
            min_p=float(msg.min_p),
            repetition_penalty=opt("repetition_penalty", 1.0),
            presence_penalty=float(msg.presence_penalty),
            frequency_penalty=float(msg.frequency_penalty),
            logit_bias={int(k): float(v) for k, v in msg.logit_bias.items()},
            seed=int(msg.seed) if msg.HasField("seed") else None,
            max_new_tokens=int(msg.max_new_tokens) or default_max_new_tokens,
            stop=tuple(msg.stop),
            ignore_eos=bool(msg.ignore_eos),
            stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
            min_tokens=int(msg.min_tokens),
            logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None,
            invariant=bool(msg.invariant),  # unset: the coordinator resolves it (resolve_reproducibility)
            constraint=constraint_from_proto(msg.structured_output) if msg.HasField("structured_output") else None,
        )
    except InvalidArgumentError as exc:  # name the field as the client spells it
        raise InvalidArgumentError(f"sampling.{exc.field}", str(exc).split(": ", 1)[-1]) from None


def constraint_from_proto(msg: coordinator_pb2.StructuredOutput) -> Constraint:
    """The oneof as a validated Constraint (errors name the field ``structured_output``)."""
    kind = msg.WhichOneof("constraint")
    try:
        if kind is None or (kind == "json_object" and not msg.json_object):
            raise InvalidArgumentError(
                "structured_output", "set one of json_schema, json_object, regex, choice, grammar"
            )
        if kind == "json_object":
            return Constraint("json_object")
        if kind == "choice":
            return Constraint("choice", json.dumps(list(msg.choice.choices)))
        return Constraint(kind, getattr(msg, kind))
    except InvalidArgumentError as exc:
        raise InvalidArgumentError("structured_output", str(exc).split(": ", 1)[-1]) from None


def constraint_to_proto(constraint: Constraint) -> coordinator_pb2.StructuredOutput:
    if constraint.kind == "json_object":
        return coordinator_pb2.StructuredOutput(json_object=True)
    if constraint.kind == "choice":
        return coordinator_pb2.StructuredOutput(choice=coordinator_pb2.ChoiceList(choices=json.loads(constraint.spec)))
    msg = coordinator_pb2.StructuredOutput()
    setattr(msg, constraint.kind, constraint.spec)  # json_schema, regex, grammar: a string field each
    return msg


def sampling_to_proto(params: SamplingParams) -> coordinator_pb2.SamplingParams:
    msg = coordinator_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_new_tokens=params.max_new_tokens,
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
        min_tokens=params.min_tokens,
    )
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.invariant:
        msg.invariant = True
    if params.seed is not None:
        msg.seed = params.seed
    if params.constraint is not None:
        msg.structured_output.CopyFrom(constraint_to_proto(params.constraint))
    for token, bias in params.logit_bias.items():
        msg.logit_bias[token] = bias
    return msg


# -- q, proposals, verdicts, commits ---------------------------------------------------------
def sparse_to_proto(q: SparseDist) -> engine_pb2.SparseDistribution:
    return engine_pb2.SparseDistribution(token_ids=q.token_ids.tolist(), probs=q.probs.tolist())


def sparse_from_proto(msg: engine_pb2.SparseDistribution) -> SparseDist:
    # float32 on the wire, float32 here: the verifier sees exactly what the draft shipped.
    return SparseDist(np.asarray(msg.token_ids, dtype=np.int64), np.asarray(msg.probs, dtype=np.float32))


def proposal_to_proto(proposal: DraftProposal, load: PassLoad | None = None) -> draft_pb2.ProposeResponse:
    branches = [
        draft_pb2.Branch(prefix=list(b.prefix), tokens=proposed_tokens_to_proto(b.block)) for b in proposal.branches
    ]
    return draft_pb2.ProposeResponse(
        tokens=proposed_tokens_to_proto(proposal), load=pass_load_to_proto(load), branches=branches
    )


def pass_load_to_proto(load: PassLoad | None) -> engine_pb2.PassLoad | None:
    if load is None:
        return None
    return engine_pb2.PassLoad(
        size=load.size, sessions=load.sessions, seconds=load.seconds, live_sessions=load.live_sessions
    )


def cost_curve_from_info(info: engine_pb2.EngineInfo) -> CostCurve | None:
    """The replica's profiled pass cost (None where it reports none: it does not batch)."""
    points = [(int(n), float(t)) for n, t in zip(info.cost_sizes, info.cost_seconds, strict=False) if n > 0]
    if not points or len(info.cost_sizes) != len(info.cost_seconds):
        return None
    try:
        return CostCurve(points)
    except ValueError:
        return None


def pass_load_from_proto(msg: engine_pb2.PassLoad) -> PassLoad | None:
    """None for an absent or empty report (a replica that does not batch)."""
    if msg.size <= 0 or msg.sessions <= 0:
        return None
    if not (math.isfinite(msg.seconds) and msg.seconds >= 0) or msg.live_sessions < 0:
        return None  # a malformed report: the policy must not steer by it
    return PassLoad(int(msg.size), int(msg.sessions), float(msg.seconds), int(msg.live_sessions))


def proposed_tokens_to_proto(proposal: DraftProposal) -> list[draft_pb2.ProposedToken]:
    if not proposal.carries_q:  # invariant sampling: the tokens alone
        return [draft_pb2.ProposedToken(token_id=t) for t in proposal.tokens]
    return [
        draft_pb2.ProposedToken(token_id=t, q=sparse_to_proto(q))
        for t, q in zip(proposal.tokens, proposal.q, strict=True)
    ]


def proposal_from_proto(
    tokens: Iterable[draft_pb2.ProposedToken], branches: Iterable[draft_pb2.Branch] = ()
) -> DraftProposal:
    """A block as shipped: every token with its q, or (invariant sampling) none with one; with a
    pre-draft's branches, each shipped the same way."""
    block = _block_from_proto(tokens)
    found = tuple(Branch(tuple(int(t) for t in b.prefix), _block_from_proto(b.tokens)) for b in branches)
    return replace(block, branches=found) if found else block


def _block_from_proto(tokens: Iterable[draft_pb2.ProposedToken]) -> DraftProposal:
    tokens = list(tokens)
    with_q = sum(t.HasField("q") for t in tokens)
    if 0 < with_q < len(tokens):
        raise MalformedProposalError("q", f"{with_q} of {len(tokens)} proposals carry a q: all or none must")
    qs = [sparse_from_proto(t.q) for t in tokens] if with_q else []
    return DraftProposal([int(t.token_id) for t in tokens], qs)


def verdict_to_proto(verdict: TargetVerdict, load: PassLoad | None = None) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(
        p_proposed=verdict.p_proposed,
        recovered=verdict.recovered,
        bonus=verdict.bonus,
        features=features_to_proto(verdict.features),
        load=pass_load_to_proto(load),
        logprobs=[
            target_pb2.RowLogprobs(
                candidate_ids=list(row.candidates),
                candidate_logprobs=list(row.candidates.values()),
                top_ids=[t for t, _ in row.top],
                top_logprobs=[lp for _, lp in row.top],
            )
            for row in verdict.logprobs or ()
        ],
    )


def verdict_from_proto(msg: target_pb2.VerifyResponse) -> TargetVerdict:
    features = features_from_proto(msg.features, "features") if msg.HasField("features") else None
    logprobs = [
        RowLogprobs(
            dict(zip(map(int, row.candidate_ids), map(float, row.candidate_logprobs), strict=True)),
            tuple(zip(map(int, row.top_ids), map(float, row.top_logprobs), strict=True)),
        )
        for row in msg.logprobs
    ]
    return TargetVerdict(
        [float(p) for p in msg.p_proposed],
        [int(r) for r in msg.recovered],
        int(msg.bonus),
        features,
        logprobs or None,
    )


# -- target features (for feature drafts) ----------------------------------------------------
FLOAT16_MAX = 65504.0
_FEATURE_DTYPES = {"float16": np.float16, "float32": np.float32}


def _wire_dtype(name: str) -> np.dtype:
    return np.dtype(_FEATURE_DTYPES[name]).newbyteorder("<")  # little-endian on every host


def features_to_proto(features: torch.Tensor | None) -> engine_pb2.Features | None:
    """[rows, H] -> float16 bytes (half the wire of float32; a draft's input needs no more), or
    float32 when a value lies outside float16's range."""
    if features is None:
        return None
    array = features.detach().to(device="cpu", dtype=torch.float32).numpy()
    dtype = "float16" if array.size == 0 or float(np.abs(array).max()) <= FLOAT16_MAX else "float32"
    data = array.astype(_wire_dtype(dtype)).tobytes()
    return engine_pb2.Features(
        rows=array.shape[0], dim=array.shape[1] if array.ndim == 2 else 0, dtype=dtype, data=data
    )


def features_from_proto(msg: engine_pb2.Features, field_name: str = "features") -> torch.Tensor:
    """Checked decoding: known dtype, a size that matches rows x dim, finite values -> float32 [rows, dim]."""
    if msg.dtype not in _FEATURE_DTYPES:
        raise InvalidArgumentError(field_name, f"dtype must be one of {sorted(_FEATURE_DTYPES)}, got {msg.dtype!r}")
    if msg.rows < 0 or msg.dim < 0 or (msg.rows and not msg.dim):
        raise InvalidArgumentError(field_name, f"bad shape [{msg.rows}, {msg.dim}]")
    np_dtype = _wire_dtype(msg.dtype)
    if len(msg.data) != msg.rows * msg.dim * np_dtype.itemsize:
        raise InvalidArgumentError(
            field_name, f"{len(msg.data)} bytes do not hold [{msg.rows}, {msg.dim}] {msg.dtype} values"
        )
    array = np.frombuffer(msg.data, dtype=np_dtype).astype(np.float32).reshape(msg.rows, msg.dim)
    if not np.isfinite(array).all():
        raise InvalidArgumentError(field_name, "values must be finite")
    return torch.from_numpy(array.copy())


def commit_to_proto(commit: Commit | None) -> engine_pb2.Commit | None:
    if commit is None:
        return None
    return engine_pb2.Commit(
        step=commit.step,
        base_len=commit.base_len,
        tokens=list(commit.tokens),
        features=features_to_proto(commit.features),
    )


def commit_from_proto(msg: engine_pb2.Commit | None) -> Commit | None:
    if msg is None:
        return None
    features = features_from_proto(msg.features, "commit.features") if msg.HasField("features") else None
    return Commit(int(msg.step), int(msg.base_len), tuple(int(t) for t in msg.tokens), features)


def optional_commit(parent, field: str = "commit") -> Commit | None:
    return commit_from_proto(getattr(parent, field)) if parent.HasField(field) else None


# -- stats -----------------------------------------------------------------------------------
def stats_to_proto(stats: StepStats) -> coordinator_pb2.SpeculationStats:
    return coordinator_pb2.SpeculationStats(
        target_passes=stats.target_passes,
        proposed_tokens=stats.proposed_tokens,
        accepted_tokens=stats.accepted_tokens,
        accepted_per_position=list(stats.accepted_per_position),
        draft_seconds=stats.draft_seconds,
        verify_seconds=stats.verify_seconds,
        total_seconds=stats.total_seconds,
        draft_fallbacks=stats.draft_fallbacks,
        draft_failovers=stats.draft_failovers,
        target_failovers=stats.target_failovers,
        drafts=stats.drafts,
        policy=stats.policy,
        steps_by_k=list(stats.steps_by_k),
        cached_prompt_tokens=stats.cached_prompt_tokens,
        forced_tokens=stats.forced_tokens,
        predrafts=stats.predrafts,
        predraft_hits=stats.predraft_hits,
        predraft_seconds=stats.predraft_seconds,
        predraft_rejection_hits=stats.predraft_rejection_hits,
    )


def add_chunk(response: coordinator_pb2.GenerateResponse, chunk: coordinator_pb2.GenerateChunk) -> None:
    """Fold one stream chunk into the unary response (Generate is GenerateStream, collected)."""
    response.request_id = chunk.request_id
    response.token_ids.extend(chunk.token_ids)
    response.logprobs.extend(chunk.logprobs)
    response.text += chunk.text
    if chunk.finish_reason:
        response.finish_reason, response.seed = chunk.finish_reason, chunk.seed
        response.prompt_tokens = chunk.prompt_tokens
        response.stats.CopyFrom(chunk.stats)


def token_logprobs_to_proto(entries, tokenizer=None) -> list[coordinator_pb2.TokenLogprobs]:
    """Emitted tokens' log-probabilities (specdec.exact.logprobs.TokenLogprob) for a chunk, with
    each token's text when there is a tokenizer."""

    def text(token: int) -> str:
        return tokenizer.decode([token]) if tokenizer is not None else ""

    return [
        coordinator_pb2.TokenLogprobs(
            logprob=e.logprob,
            top_ids=[t for t, _ in e.top],
            top_logprobs=[lp for _, lp in e.top],
            token=text(e.token),
            top_tokens=[text(t) for t, _ in e.top],
        )
        for e in entries
    ]
