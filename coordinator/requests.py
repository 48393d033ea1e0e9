"""A client's GenerateRequest, validated and resolved against the served model: its prompt
tokenized (off the event loop), its constraint compiled, every default the server chooses made
explicit (``ParsedRequest``), and the canonical form the session log stores, so that a
coordinator taking over runs exactly the same request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from coordinator.config import METHODS, CoordinatorConfig
from specdec.errors import InvalidArgumentError
from specdec.exact.rng import new_seed
from specdec.exact.sampling import MAX_NEW_TOKENS_LIMIT, SamplingParams, constraint_conflict
from specdec.loop.reproducible import resolve_reproducibility
from specdec.modeling.loading import encode_chat, encode_prompt
from specdec.runtime import wire
from specdec.v1 import coordinator_pb2

if TYPE_CHECKING:
    from specdec.modeling.grammar import Matcher

CHAT_ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 256  # a conversation's messages (its tokens are bounded by the context)
MAX_CACHE_SALT_CHARS = 256  # a client's cache_salt (the front may prefix its tenant's)


def check_constraint_settings(params: SamplingParams) -> None:
    """What a constraint cannot be combined with is refused here, before any replica is asked
    (docs/structured-output.md). Either sampling mode takes a constraint: both draw under its masks."""
    conflict = constraint_conflict(params)
    if conflict:
        raise InvalidArgumentError("sampling.structured_output", f"cannot be combined with {conflict}")


@dataclass(frozen=True)
class ParsedRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # seed resolved
    k: int
    method: str
    adaptive: bool
    replayable: bool = False  # k from its own past only (else the load-aware policy may choose it)
    forced_tokens: bool = True  # a constraint's forced runs proposed by the loop (with k > 0)
    # the draft drafts the next block while the target verifies (loop.pipelining); None: where
    # the session's draft and target compute apart (decided once they are chosen)
    pipeline: bool | None = None

    def resolved(self) -> coordinator_pb2.GenerateRequest:
        """The server defaults this request was given (seed, invariant, k, method, adaptive,
        replayable), as request fields."""
        out = coordinator_pb2.GenerateRequest()
        assert self.params.seed is not None  # parse() resolves it
        out.sampling.seed = self.params.seed
        out.sampling.invariant = self.params.invariant
        out.speculation.num_speculative_tokens = self.k
        out.speculation.method = self.method
        out.speculation.adaptive = self.adaptive
        out.speculation.replayable = self.replayable
        out.speculation.forced_tokens = self.forced_tokens
        if self.pipeline is not None:  # else decided per session, the same tokens either way
            out.speculation.pipeline = self.pipeline
        return out


def canonical(
    request: coordinator_pb2.GenerateRequest, request_id: str, defaults: coordinator_pb2.GenerateRequest
) -> bytes:
    """The request as stored in the session log: id filled in, resume index cleared, and every
    field the client left to the server (seed, invariant, k, method, adaptive, replayable) taken
    from ``defaults``, so that a coordinator taking over (whatever its own defaults) runs exactly
    the same request, with the same tokens."""
    copy = coordinator_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.request_id = request_id
    copy.resume_from_index = 0
    sampling, default_sampling = copy.sampling, defaults.sampling
    for name in ("seed", "invariant"):
        if not sampling.HasField(name):
            setattr(sampling, name, getattr(default_sampling, name))
    spec, default_spec = copy.speculation, defaults.speculation
    for name in ("num_speculative_tokens", "adaptive", "replayable", "forced_tokens", "pipeline"):
        if not spec.HasField(name) and default_spec.HasField(name):
            setattr(spec, name, getattr(default_spec, name))
    if not spec.method:
        spec.method = default_spec.method
    return copy.SerializeToString(deterministic=True)


class RequestParser:
    """Requests against the served model: its vocabulary, context and EOS ids, the tokenizer (for
    text, chat templates, stop strings and constraints) and the constraints compiled over it. The
    coordinator sets what it learns of the model at setup."""

    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.tokenizer: Any = None
        self.vocab_size = 0
        self.context_length = 0
        self.eos_token_ids: list[int] = []
        self.max_token_chars = 0  # the tokenizer's longest token (0: no bound known)
        self.grammars: Any = None  # structured output: constraints compiled over the tokenizer

    def _text_chars(self, request: coordinator_pb2.GenerateRequest) -> int:
        return len(request.prompt) + sum(len(m.content) for m in request.messages)

    async def encode(self, request: coordinator_pb2.GenerateRequest) -> list[int] | None:
        """A text prompt's or a conversation's token ids, tokenized off the event loop (a long
        text would stall every other request), after refusing text that cannot fit the context
        whatever it tokenizes to; None for a request of token ids."""
        if not (request.prompt or request.messages) or request.prompt_token_ids:
            return None
        chars = self._text_chars(request)
        if self.max_token_chars and chars > self.context_length * self.max_token_chars:
            field = "messages" if request.messages else "prompt"
            raise InvalidArgumentError(
                field,
                f"{chars} characters cannot fit the model context of {self.context_length} tokens "
                f"(no token is longer than {self.max_token_chars} characters)",
            )
        return await asyncio.to_thread(self._encode_text, request)

    async def constraint_matcher(self, params: SamplingParams) -> Matcher:
        """A matcher of the request's constraint, compiled within its scope (its tenant's cache
        salt) on the grammar workers, never on the event loop nor on the threads that tokenize.
        Called once the request is admitted: a slot bounds how many compiles clients can start.
        A constraint that does not compile (or not within the budget) is the client's 400 naming
        the problem, so the replicas' caches hold only constraints that compile; a full compile
        queue is RESOURCE_EXHAUSTED."""
        assert params.constraint is not None
        try:
            if self.tokenizer is None:
                raise InvalidArgumentError("structured_output", "this server has no tokenizer to compile it with")
            if self.grammars is None:
                from specdec.modeling.grammar import Grammars

                self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return await self.grammars.matcher_async(params.constraint, params.cache_salt)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError("sampling.structured_output", str(exc).split(": ", 1)[-1]) from None

    async def check_constraint(self, parsed: ParsedRequest) -> None:
        """Refuse an admitted request whose constraint does not compile, before anything is
        written or any replica asked (a no-op without a constraint)."""
        if parsed.params.constraint is not None:
            await self.constraint_matcher(parsed.params)

    def _encode_text(self, request: coordinator_pb2.GenerateRequest) -> list[int]:
        if request.messages:
            return self._encode_messages(request.messages)
        if self.tokenizer is None:
            raise InvalidArgumentError("prompt", "this server has no tokenizer: send prompt_token_ids")
        return encode_prompt(self.tokenizer, request.prompt, chat=request.apply_chat_template)

    def parse(
        self, request: coordinator_pb2.GenerateRequest, request_id: str, text_ids: list[int] | None = None
    ) -> ParsedRequest:
        """The request, validated and resolved; ``text_ids``: its text already tokenized
        (:meth:`encode`), else tokenized here."""
        cfg = self.config
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(request, name)]
        if len(given) > 1:
            raise InvalidArgumentError(given[1], f"give one of prompt, prompt_token_ids or messages, not {given}")
        if request.messages:
            prompt_ids = text_ids if text_ids is not None else self._encode_text(request)
        elif request.prompt_token_ids:
            prompt_ids = [int(t) for t in request.prompt_token_ids]
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgumentError(
                    "prompt_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
        elif request.prompt:
            prompt_ids = text_ids if text_ids is not None else self._encode_text(request)
            if not prompt_ids:
                raise InvalidArgumentError("prompt", "tokenizes to zero tokens")
        else:
            raise InvalidArgumentError("prompt", "empty: give prompt, prompt_token_ids or messages")
        if request.apply_chat_template and not request.prompt:
            raise InvalidArgumentError("apply_chat_template", "needs a text prompt")
        if len(prompt_ids) >= self.context_length:
            raise InvalidArgumentError(
                "prompt", f"{len(prompt_ids)} tokens leave no room in the model context of {self.context_length}"
            )
        if request.sampling.max_new_tokens > cfg.max_new_tokens_limit:
            raise InvalidArgumentError(
                "sampling.max_new_tokens",
                f"{request.sampling.max_new_tokens} exceeds this server's limit of {cfg.max_new_tokens_limit}",
            )
        params = wire.sampling_from_proto(request.sampling, min(cfg.default_max_new_tokens, MAX_NEW_TOKENS_LIMIT))
        asked_invariant = request.sampling.invariant if request.sampling.HasField("invariant") else None
        if params.constraint is not None:
            check_constraint_settings(params)
        spec = request.speculation
        invariant, replayable = resolve_reproducibility(
            seeded=request.sampling.HasField("seed"),
            sampled=params.temperature > 0,
            invariant=asked_invariant,
            replayable=spec.replayable if spec.HasField("replayable") else None,
            seeded_sampling=cfg.seeded_sampling,
            invariant_default=cfg.invariant_sampling,
            replayable_default=cfg.replayable_schedule,
        )
        if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidArgumentError("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters")
        params = replace(params, invariant=invariant, cache_salt=request.cache_salt)
        try:
            params.validate_for_vocab(self.vocab_size)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"sampling.{exc.field}", str(exc).split(": ", 1)[-1]) from None
        if params.stop and self.tokenizer is None:
            raise InvalidArgumentError("sampling.stop", "this server has no tokenizer to match stop strings")
        method = spec.method or cfg.default_method
        if method not in METHODS:
            raise InvalidArgumentError("speculation.method", f"unknown method {spec.method!r}; use one of {METHODS}")
        k = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else cfg.default_k
        if not 0 <= k <= cfg.max_k:
            raise InvalidArgumentError("speculation.num_speculative_tokens", f"must be in [0, {cfg.max_k}], got {k}")
        if method == "none":
            k = 0
        # By default only for draft models: an n-gram lookup costs no call, and when it finds
        # nothing the step is target-only anyway, so pausing it would only miss repetitions.
        adaptive = spec.adaptive if spec.HasField("adaptive") else cfg.default_adaptive and method == "draft_model"
        if params.seed is None:
            params = params.with_seed(new_seed())
        forced = spec.forced_tokens if spec.HasField("forced_tokens") else True
        pipeline = spec.pipeline if spec.HasField("pipeline") else {"on": True, "off": False}.get(cfg.pipeline_drafts)
        return ParsedRequest(request_id, prompt_ids, params, k, method, adaptive, replayable, forced, pipeline)

    def _encode_messages(self, messages) -> list[int]:
        """A conversation through the model's chat template, the assistant's turn to follow."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgumentError("messages", "this model has no chat template: send a prompt")
        if len(messages) > MAX_MESSAGES:
            raise InvalidArgumentError("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgumentError(f"messages[{i}].role", f"must be one of {CHAT_ROLES}, got {m.role!r}")
        try:
            prompt_ids = encode_chat(self.tokenizer, [(m.role, m.content) for m in messages])
        except Exception as exc:  # noqa: BLE001 - a template may refuse an order of roles
            raise InvalidArgumentError("messages", f"the chat template refused them: {exc}") from None
        if not prompt_ids:
            raise InvalidArgumentError("messages", "tokenize to zero tokens")
        return prompt_ids
