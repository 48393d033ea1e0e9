"""The coordinator's request handling, independent of how it is hosted (Ray actor, or in process
for tests): validate the public request, run the speculative loop against the draft and target
services, and produce GenerateChunks of committed tokens only.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from draft_service.ngram import NgramDraft
from specdec import tracing, wire
from specdec.errors import InvalidArgumentError, ResourceExhaustedError
from specdec.generate import LocalDraft, SpeculativeRun, TextStream
from specdec.models import encode_prompt
from specdec.sampling import MAX_NEW_TOKENS_LIMIT
from specdec.v1 import coordinator_pb2

from .peers import GrpcDraft, GrpcTarget

log = logging.getLogger("specdec.coordinator")

METHODS = ("draft_model", "ngram", "none")


@dataclass(frozen=True)
class CoordinatorConfig:
    target_address: str
    draft_address: str | None = None
    tokenizer: str | None = None  # model spec to load the tokenizer from (default: the target's)
    default_k: int = 4
    max_k: int = 16
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 4096
    max_concurrent_requests: int = 64
    draft_timeout_s: float = 5.0
    target_timeout_s: float = 60.0
    default_method: str = "draft_model"


@dataclass(frozen=True)
class ParsedRequest:
    request_id: str
    prompt_ids: list[int]
    params: object  # SamplingParams
    k: int
    method: str


class CoordinatorCore:
    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.target = GrpcTarget(config.target_address, timeout=config.target_timeout_s)
        self.draft = GrpcDraft(config.draft_address, timeout=config.draft_timeout_s) if config.draft_address else None
        self.tokenizer = None
        self.vocab_size = 0
        self.eos_token_ids: list[int] = []
        self.active = 0
        self.ngram: NgramDraft | None = None

    async def setup(self) -> None:
        """Learn the target's model (vocab, context, EOS) and load the tokenizer."""
        from specdec.models import try_load_tokenizer

        info = await self.target.info()
        self.vocab_size = info.vocab_size
        self.eos_token_ids = list(info.eos_token_ids)
        spec = self.config.tokenizer or info.model_id
        self.tokenizer = await asyncio.to_thread(try_load_tokenizer, spec) if spec else None
        if self.tokenizer is None:
            log.warning("no tokenizer for %r: text prompts, text output and stop strings are unavailable", spec)
        self.ngram = NgramDraft(self.vocab_size)
        if self.config.default_method not in METHODS:
            raise ValueError(f"default method must be one of {METHODS}")

    async def close(self) -> None:
        await self.target.close()
        if self.draft is not None:
            await self.draft.close()

    # -- validation ---------------------------------------------------------------------------
    def parse(self, request: coordinator_pb2.GenerateRequest) -> ParsedRequest:
        cfg = self.config
        if request.prompt and request.prompt_token_ids:
            raise InvalidArgumentError("prompt", "give either prompt or prompt_token_ids, not both")
        if request.prompt_token_ids:
            prompt_ids = [int(t) for t in request.prompt_token_ids]
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgumentError("prompt_token_ids",
                                           f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        elif request.prompt:
            if self.tokenizer is None:
                raise InvalidArgumentError("prompt", "this server has no tokenizer: send prompt_token_ids")
            prompt_ids = encode_prompt(self.tokenizer, request.prompt, chat=request.apply_chat_template)
            if not prompt_ids:
                raise InvalidArgumentError("prompt", "tokenizes to zero tokens")
        else:
            raise InvalidArgumentError("prompt", "empty: give prompt or prompt_token_ids")
        if request.apply_chat_template and not request.prompt:
            raise InvalidArgumentError("apply_chat_template", "needs a text prompt")
        if len(prompt_ids) >= self.target.context_length:
            raise InvalidArgumentError("prompt", f"{len(prompt_ids)} tokens leave no room in the model context of "
                                                 f"{self.target.context_length}")
        if request.sampling.max_new_tokens > cfg.max_new_tokens_limit:
            raise InvalidArgumentError("sampling.max_new_tokens",
                                       f"{request.sampling.max_new_tokens} exceeds this server's limit of "
                                       f"{cfg.max_new_tokens_limit}")
        params = wire.sampling_from_proto(request.sampling, min(cfg.default_max_new_tokens, MAX_NEW_TOKENS_LIMIT))
        try:
            params.validate_for_vocab(self.vocab_size)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError("sampling.logit_bias", str(exc).split(": ", 1)[-1]) from None
        if params.stop and self.tokenizer is None:
            raise InvalidArgumentError("sampling.stop", "this server has no tokenizer to match stop strings")
        spec = request.speculation
        method = spec.method or cfg.default_method
        if method not in METHODS:
            raise InvalidArgumentError("speculation.method", f"unknown method {spec.method!r}; use one of {METHODS}")
        if method == "draft_model" and self.draft is None:
            if spec.method:
                raise InvalidArgumentError("speculation.method", "no draft model is configured on this server")
            method = "ngram"
        k = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else cfg.default_k
        if not 0 <= k <= cfg.max_k:
            raise InvalidArgumentError("speculation.num_speculative_tokens",
                                       f"must be in [0, {cfg.max_k}], got {k}")
        if method == "none":
            k = 0
        return ParsedRequest(request.request_id or uuid.uuid4().hex, prompt_ids, params, k, method)

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, request: coordinator_pb2.GenerateRequest,
                       trace_carrier: dict | None = None) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        """Chunks of committed tokens; the last one carries finish_reason, seed and stats.

        ``trace_carrier``: W3C headers of the caller's span (the public gRPC call, across Ray)."""
        parsed = self.parse(request)
        if self.active >= self.config.max_concurrent_requests:
            raise ResourceExhaustedError(f"{self.active} requests in flight, the limit is "
                                         f"{self.config.max_concurrent_requests}")
        self.active += 1
        span = tracing.start_span("specdec.request", trace_carrier, {
            "specdec.request_id": parsed.request_id, "specdec.method": parsed.method,
            "specdec.k": parsed.k, "specdec.prompt_tokens": len(parsed.prompt_ids)})
        run = self._run(parsed)
        steps = run.steps()
        text = TextStream()
        final_tokens: list[int] = []
        try:
            while True:
                with tracing.span_as_current(span):  # never current across our own yield
                    try:
                        tokens = await steps.__anext__()
                    except StopAsyncIteration:
                        break
                if run.stopper.finished:
                    final_tokens = tokens  # they go out on the last chunk, with the stats
                    break
                if tokens:
                    yield coordinator_pb2.GenerateChunk(request_id=parsed.request_id, token_ids=tokens,
                                                        text=text.delta(run.stopper.text(), final=False))
            await steps.aclose()  # releases both sessions and closes the stats
            result = run.result()
            span.set_attribute("specdec.finish_reason", result.finish_reason)
            span.set_attribute("specdec.tokens", len(result.token_ids))
            span.set_attribute("specdec.seed", str(result.seed))
            yield coordinator_pb2.GenerateChunk(
                request_id=parsed.request_id, token_ids=final_tokens, text=text.delta(result.text, final=True),
                finish_reason=result.finish_reason, seed=result.seed, stats=wire.stats_to_proto(result.stats))
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            await steps.aclose()  # idempotent; on cancellation this frees the sessions
            span.end()
            self.active -= 1

    def _run(self, parsed: ParsedRequest) -> SpeculativeRun:
        draft = None
        if parsed.k > 0:
            draft = self.draft if parsed.method == "draft_model" else LocalDraft(self.ngram)
        return SpeculativeRun(self.target, draft, parsed.prompt_ids, parsed.params, parsed.k,
                              self.eos_token_ids, self.tokenizer, session_id=parsed.request_id)

    async def generate_unary(self, request) -> coordinator_pb2.GenerateResponse:
        response = coordinator_pb2.GenerateResponse()
        async for chunk in self.generate(request):
            response.request_id = chunk.request_id
            response.token_ids.extend(chunk.token_ids)
            response.text += chunk.text
            if chunk.finish_reason:
                response.finish_reason = chunk.finish_reason
                response.seed = chunk.seed
                response.stats.CopyFrom(chunk.stats)
        return response
