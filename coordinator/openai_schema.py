"""The OpenAI-compatible HTTP API's request schema, and its translation to the gRPC API's
``GenerateRequest``: pure functions, so the HTTP front (``coordinator.http_api``) stays a thin
encoding of the one request path.

Parameters keep vLLM's meaning (docs/http-api.md lists each and the order of the transforms).
Fields the server does not implement are refused (HTTP 400 naming the field), never ignored:
a client that asks for something gets it or is told it cannot.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from specdec.errors import InvalidArgumentError
from specdec.exact.sampling import MAX_LOGIT_BIAS
from specdec.v1 import coordinator_pb2

MAX_CHOICES = 16  # n
MAX_PROMPTS = 16  # a completions request's batch of prompts
MAX_PROMPT_CHARS = 1 << 20  # one text prompt or message (the context bounds its tokens anyway)
MAX_PROMPT_TOKEN_IDS = 1 << 17
MAX_TOP_LOGPROBS = 20  # as OpenAI's API and vLLM
NEG_INF_LOGPROB = -9999.0  # JSON has no -inf: what vLLM sends for a token the transforms exclude

FINISH_REASONS = {"length": "length", "stop": "stop", "eos": "stop"}  # ours -> OpenAI's


# Integers bound for the gRPC fields they become (int32): a larger one is a 400 naming the field,
# not a protobuf ValueError (HTTP 500).
Int32 = Annotated[StrictInt, Field(ge=-(1 << 31), le=(1 << 31) - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class SpeculationOptions(_Strict):
    """Our extension: speculation per request (the server's default when absent)."""

    num_speculative_tokens: Int32 | None = None
    method: Literal["draft_model", "ngram", "none"] | None = None
    adaptive: StrictBool | None = None
    replayable: StrictBool | None = None  # k from the request's own past only (None: the server's choice)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: the usage so far on every chunk


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema`` (``strict`` is accepted: the schema is always
    enforced)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None


class _Common(_Strict):
    """The sampling fields both endpoints take (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None  # vLLM: -1 or 0 = off
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0, le=(1 << 31) - 1)] = 0
    ignore_eos: StrictBool = False
    invariant: StrictBool | None = None  # our extension: invariant sampling (None: the server's default)
    cache_salt: Annotated[str, Field(max_length=256)] | None = None  # vLLM's: the prefix cache's scope
    user: str | None = None  # accepted and ignored, as by vLLM
    speculation: SpeculationOptions | None = None
    response_format: ResponseFormat | None = None  # OpenAI's structured output
    structured_outputs: StructuredOutputs | None = None  # vLLM's

    @field_validator("logit_bias")
    @classmethod
    def _bounded_bias(cls, value):
        if value is not None and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        return value


class CompletionRequest(_Common):
    prompt: str | list[str] | list[Int32] | list[list[Int32]]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=(1 << 31) - 1)] | None = 16  # OpenAI's default
    echo: StrictBool = False
    logprobs: Int32 | None = None
    best_of: Int32 | None = None
    suffix: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=(1 << 31) - 1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=(1 << 31) - 1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Int32 | None = None


def parse(model: type[BaseModel], body: Any) -> Any:
    """The request, validated; the first problem as an InvalidArgumentError naming its field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        # a field of several accepted shapes fails once per shape: a bound broken says more
        # than "should be a valid string" of a shape the client did not mean
        error = next((e for e in errors if not str(e["type"]).endswith("_type")), errors[0])
        where = ".".join(str(part) for part in error["loc"] if not _shape_name(part)) or "body"
        if error["type"] == "extra_forbidden":
            raise InvalidArgumentError(where, "unknown or unsupported field") from None
        raise InvalidArgumentError(where, error["msg"]) from None


def _shape_name(part) -> bool:
    """Whether a part of pydantic's error location names a union member ('str', 'list[int]'),
    not a field or an index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict") or "[" in part)


def _unsupported(field: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(field, f"not supported by this server: {why}")


def _sampling(req: _Common, max_tokens: int | None) -> coordinator_pb2.SamplingParams:
    s = coordinator_pb2.SamplingParams()
    if req.temperature is not None:
        s.temperature = req.temperature
    if req.top_p is not None:
        s.top_p = req.top_p
    if req.top_k is not None:
        if req.top_k < -1:
            raise InvalidArgumentError("top_k", f"must be -1 or 0 (off) or a positive integer, got {req.top_k}")
        s.top_k = max(0, req.top_k)
    if req.min_p is not None:
        s.min_p = req.min_p
    if req.presence_penalty is not None:
        s.presence_penalty = req.presence_penalty
    if req.frequency_penalty is not None:
        s.frequency_penalty = req.frequency_penalty
    if req.repetition_penalty is not None:
        s.repetition_penalty = req.repetition_penalty
    for token, bias in (req.logit_bias or {}).items():
        try:
            s.logit_bias[int(token)] = bias
        except ValueError:
            raise InvalidArgumentError("logit_bias", f"keys must be token ids, got {token!r}") from None
    if req.seed is not None:
        if not 0 <= req.seed < 1 << 64:
            raise InvalidArgumentError("seed", f"must be an unsigned 64-bit integer, got {req.seed}")
        s.seed = req.seed
    if max_tokens is not None:
        s.max_new_tokens = max_tokens
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    s.stop.extend(stops)
    s.stop_token_ids.extend(req.stop_token_ids or [])
    s.ignore_eos = req.ignore_eos
    s.min_tokens = req.min_tokens
    if req.invariant is not None:
        s.invariant = req.invariant
    structured = _structured_output(req)
    if structured is not None:
        s.structured_output.CopyFrom(structured)
    return s


def _structured_output(req: _Common) -> coordinator_pb2.StructuredOutput | None:
    """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM) as the gRPC constraint; the
    constraint itself is compiled and checked by the request path (a 400 naming the problem)."""
    fmt, vllm = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and vllm is not None:
        raise InvalidArgumentError("structured_outputs", "set response_format or structured_outputs, not both")
    out = coordinator_pb2.StructuredOutput()
    if fmt is not None and fmt.type == "json_object":
        out.json_object = True
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidArgumentError("response_format.json_schema", "required when type is json_schema")
        out.json_schema = json.dumps(fmt.json_schema.schema_)
    elif vllm is not None:
        given = [
            name
            for name in ("json_", "json_object", "regex", "choice", "grammar")
            if getattr(vllm, name) not in (None, False)
        ]
        if len(given) != 1:
            names = ", ".join(name.rstrip("_") for name in given) or "none"
            raise InvalidArgumentError(
                "structured_outputs", f"set exactly one of json, json_object, regex, choice, grammar; got {names}"
            )
        if vllm.json_ is not None:
            out.json_schema = vllm.json_ if isinstance(vllm.json_, str) else json.dumps(vllm.json_)
        elif vllm.json_object:
            out.json_object = True
        elif vllm.choice is not None:
            out.choice.choices.extend(vllm.choice)
        elif vllm.regex is not None:
            out.regex = vllm.regex
        elif vllm.grammar is not None:
            out.grammar = vllm.grammar
    else:
        return None
    return out


def _speculation(req: _Common, out: coordinator_pb2.GenerateRequest) -> None:
    out.cache_salt = req.cache_salt or ""  # (with the rest of what is not sampling)
    spec = req.speculation
    if spec is None:
        return
    if spec.num_speculative_tokens is not None:
        out.speculation.num_speculative_tokens = spec.num_speculative_tokens
    if spec.method is not None:
        out.speculation.method = spec.method
    if spec.adaptive is not None:
        out.speculation.adaptive = spec.adaptive
    if spec.replayable is not None:
        out.speculation.replayable = spec.replayable


def _choice_seed(seed: int, index: int) -> int:
    """Choice ``index`` of a seeded request samples with seed + index (choice 0 is the request's
    own seed, so n = 1 equals the gRPC API with that seed)."""
    return (seed + index) % (1 << 64)


def _fan_out(base: coordinator_pb2.GenerateRequest, n: int, request_id: str) -> list[coordinator_pb2.GenerateRequest]:
    out = []
    for index in range(n):
        one = coordinator_pb2.GenerateRequest()
        one.CopyFrom(base)
        one.request_id = f"{request_id}-{index}"
        if index and base.sampling.HasField("seed"):
            one.sampling.seed = _choice_seed(base.sampling.seed, index)
        out.append(one)
    return out


def completion_requests(req: CompletionRequest, request_id: str) -> list[coordinator_pb2.GenerateRequest]:
    """One GenerateRequest per (prompt, choice), prompt-major, as OpenAI numbers the choices."""
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}")
    if req.best_of is not None and req.best_of != req.n:
        raise _unsupported("best_of", "only best_of == n (no ranking of extra samples)")
    if req.suffix:
        raise _unsupported("suffix", "no insertion / fill-in-the-middle")
    prompts: list[str | list[int]]
    if isinstance(req.prompt, str):
        prompts = [req.prompt]
    elif req.prompt and isinstance(req.prompt[0], int):
        prompts = [list(req.prompt)]
    else:
        prompts = list(req.prompt)  # type: ignore[arg-type]
    if not prompts:
        raise InvalidArgumentError("prompt", "empty")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidArgumentError("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    out: list[coordinator_pb2.GenerateRequest] = []
    for i, prompt in enumerate(prompts):
        base = coordinator_pb2.GenerateRequest(sampling=_sampling(req, req.max_tokens))
        if req.logprobs is not None:
            base.sampling.logprobs = req.logprobs
        if isinstance(prompt, str):
            if len(prompt) > MAX_PROMPT_CHARS:
                raise InvalidArgumentError("prompt", f"longer than {MAX_PROMPT_CHARS} characters")
            base.prompt = prompt
        else:
            if len(prompt) > MAX_PROMPT_TOKEN_IDS:
                raise InvalidArgumentError("prompt", f"more than {MAX_PROMPT_TOKEN_IDS} token ids")
            base.prompt_token_ids.extend(prompt)
        _speculation(req, base)
        out.extend(_fan_out(base, req.n, f"{request_id}-p{i}" if len(prompts) > 1 else request_id))
    return out


def _message_text(i: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _unsupported(f"messages.{i}.content.{j}", "only text parts ({'type': 'text', 'text': ...})")
        parts.append(part["text"])
    return "".join(parts)


def chat_requests(req: ChatCompletionRequest, request_id: str) -> list[coordinator_pb2.GenerateRequest]:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise InvalidArgumentError("top_logprobs", "needs logprobs: true")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgumentError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    base = coordinator_pb2.GenerateRequest(sampling=_sampling(req, max_tokens))
    if req.logprobs:
        base.sampling.logprobs = req.top_logprobs or 0
    total = 0
    for i, message in enumerate(req.messages):
        text = _message_text(i, message)
        total += len(text)
        if total > MAX_PROMPT_CHARS:
            raise InvalidArgumentError("messages", f"longer than {MAX_PROMPT_CHARS} characters in all")
        role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for it
        base.messages.add(role=role, content=text)
    _speculation(req, base)
    return _fan_out(base, req.n, request_id)


def finish_reason(ours: str) -> str:
    return FINISH_REASONS.get(ours, ours)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` (prompt tokens the target copied from its prefix
    cache, known once the generations finished) as OpenAI reports prompt caching."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def speculation_stats(stats: coordinator_pb2.SpeculationStats) -> dict[str, Any]:
    """Our acceptance figures, as the extension object of a response (``specdec``)."""
    proposed, accepted = stats.proposed_tokens, stats.accepted_tokens
    return {
        "target_passes": stats.target_passes,
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "accepted_per_position": list(stats.accepted_per_position),
        "policy": stats.policy,
        "steps_by_k": list(stats.steps_by_k),
        "draft_fallbacks": stats.draft_fallbacks,
        "draft_failovers": stats.draft_failovers,
        "target_failovers": stats.target_failovers,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
    }


def _finite(logprob: float) -> float:
    return logprob if logprob > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def completion_logprobs(entries, offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (OpenAI's legacy shape) from chunks' TokenLogprobs;
    ``offset``: the characters of text before these tokens (text_offset counts from there)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(e.token)
        offset += len(e.token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [{t: _finite(lp) for t, lp in zip(e.top_tokens, e.top_logprobs, strict=True)} for e in entries],
        "text_offset": offsets,
    }


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


def chat_logprobs(entries) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``content``, one entry per token with its top-n."""
    return {
        "content": [
            {
                **_chat_entry(e.token, e.logprob),
                "top_logprobs": [_chat_entry(t, lp) for t, lp in zip(e.top_tokens, e.top_logprobs, strict=True)],
            }
            for e in entries
        ]
    }
