"""A small client for the public API (what ``specdec generate`` and ``specdec run`` use)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from specdec.runtime.grpc_server import sync_channel
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc


def build_request(
    prompt: str | None = None,
    prompt_token_ids=None,
    params=None,
    k: int | None = None,
    method: str = "",
    request_id: str = "",
    chat: bool = False,
    adaptive: bool | None = None,
) -> coordinator_pb2.GenerateRequest:
    """``adaptive``: None leaves the choice (adaptive or fixed k) to the server's default."""
    from specdec.runtime.wire import sampling_to_proto

    request = coordinator_pb2.GenerateRequest(request_id=request_id)
    if prompt_token_ids:
        request.prompt_token_ids.extend(prompt_token_ids)
    elif prompt is not None:
        request.prompt = prompt
        request.apply_chat_template = chat
    if params is not None:
        request.sampling.CopyFrom(sampling_to_proto(params))
    if k is not None:
        request.speculation.num_speculative_tokens = k
    request.speculation.method = method
    if adaptive is not None:
        request.speculation.adaptive = adaptive
    return request


@dataclass
class StreamedAnswer:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    seed: int = 0
    stats: coordinator_pb2.SpeculationStats | None = None
    seconds: float = 0.0
    first_token_seconds: float | None = None


def stream_to(
    address: str, request, out=sys.stdout, timeout: float | None = None, api_key: str | None = None
) -> StreamedAnswer:
    """Call GenerateStream, write text to ``out`` as it is committed, return the whole answer.
    ``api_key``: sent as ``authorization: Bearer`` (a server with API keys requires one)."""
    answer = StreamedAnswer()
    started = time.perf_counter()
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with sync_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for chunk in stub.GenerateStream(request, timeout=timeout, metadata=metadata):
            if chunk.token_ids and answer.first_token_seconds is None:
                answer.first_token_seconds = time.perf_counter() - started
            answer.token_ids.extend(chunk.token_ids)
            answer.text += chunk.text
            if out is not None and chunk.text:
                out.write(chunk.text)
                out.flush()
            if chunk.finish_reason:
                answer.finish_reason, answer.seed = chunk.finish_reason, chunk.seed
                answer.stats = chunk.stats
    answer.seconds = time.perf_counter() - started
    return answer


def summary(answer: StreamedAnswer) -> str:
    s = answer.stats
    passes = s.target_passes if s else 0
    accept = s.accepted_tokens / s.proposed_tokens if s and s.proposed_tokens else 0.0
    drafts = s.drafts if s else 0
    mean_len = (s.accepted_tokens + drafts) / drafts if s and drafts else 0.0  # per draft block, vLLM's count
    rate = len(answer.token_ids) / answer.seconds if answer.seconds else 0.0
    speculation = (
        f"acceptance rate {accept:.2f}, mean accepted length {mean_len:.2f}"
        if drafts
        else "no speculation (target only)"
    )
    paused = f" ({passes - drafts} without a draft block)" if drafts and passes > drafts else ""
    cached = s.cached_prompt_tokens if s else 0
    copied = f" ({cached} prompt tokens from the prefix cache)" if cached else ""
    if s and s.forced_tokens:
        speculation += f", {s.forced_tokens} tokens forced by the constraint"
    if s and s.predrafts:  # pipelined drafting (docs/pipelining.md)
        speculation += f", {s.predraft_hits} of {s.predrafts} blocks drafted ahead used"
    return (
        f"[{len(answer.token_ids)} tokens, finish={answer.finish_reason}, seed={answer.seed}]\n"
        f"{speculation}, {rate:.1f} tokens/s, {passes} target passes{paused}, "
        f"time to first token {answer.first_token_seconds or 0:.2f}s{copied}"
    )
