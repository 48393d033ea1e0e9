"""Sampling parameters and THE transform pipeline: logits -> probability distribution.

Both the draft (to build q) and the target (to build p) call :func:`probs_from_logits`; there is
no second implementation anywhere. If the two sides transformed logits differently, the verifier
would compare the wrong distributions and the output would silently stop being the target's law
(docs/exactness.md, "One transform pipeline").

Order of transforms, each on the result of the previous one:

1. ``logit_bias``                 additive, per token id; then ``min_tokens``: while fewer than
                                  min_tokens tokens are generated, EOS and ``stop_token_ids``
                                  are impossible (vLLM's meaning)
2. ``repetition_penalty``         HF/CTRL style: positive logits divided, negative multiplied,
                                  for every token already seen in the prompt or the generated
                                  tokens (as vLLM and transformers)
3. ``presence_penalty`` and ``frequency_penalty``  OpenAI style: ``- presence * [count > 0]
                                  - frequency * count``, counting the *generated* tokens only
                                  (as OpenAI and vLLM: the prompt does not count); then a
                                  structured-output constraint: tokens outside the row's
                                  ``allowed`` set get -inf (specdec.exact.constraint)
4. temperature                    ``temperature == 0`` (or below 1e-5, as vLLM) means greedy: a one-hot on the argmax
                                  (ties broken toward the lowest id); steps 5-7 are then moot
5. ``top_k``                      keep tokens whose probability is >= the k-th largest (so ties
                                  at the boundary are all kept: the result never depends on sort
                                  order)
6. ``top_p``                      keep the smallest prefix of tokens, sorted by probability
                                  descending (ties by lower id), whose mass reaches top_p
7. ``min_p``                      keep tokens with probability >= min_p * max probability

The "history" for penalties at proposal position i is the generated tokens committed so far +
the proposals before i, passed as per-row token counts (:func:`block_token_counts`), and the
prompt, passed as the set of its tokens (``prompt_seen``, for the repetition penalty only).
Which tokens are the prompt is the request's: a session started from prompt + committed tokens
(a resume, a failover, a late draft) is told ``prompt_length``.

Everything is computed in float32 (float64 on request, for reference laws) with a log-softmax
after every truncation, so no step ever exponentiates an unnormalised logit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from specdec.errors import InvalidArgumentError, NonFiniteLogitsError
from specdec.exact.constraint import Constraint, constrained

# Generous but finite: a single request must not be able to ask for unbounded work.
MAX_NEW_TOKENS_LIMIT = 1 << 20
UINT64_MAX = (1 << 64) - 1
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS = 16, 512, 64
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_CACHE_SALT_CHARS = 512  # a session's prefix-cache scope (the tenant's part and the request's)
# Ranges that keep every transform finite in float32 (a tiny temperature or repetition penalty,
# or a huge bias, divides or shifts logits to inf and the softmax to NaN): below GREEDY_BELOW a
# temperature is greedy (vLLM's rule), a bias is OpenAI's [-100, 100].
GREEDY_BELOW = 1e-5
MAX_ABS_LOGIT_BIAS = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings of one request (see module docstring for semantics)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # end the request when generated, even with ignore_eos
    # The request's prompt length, for a session that starts from the prompt plus tokens already
    # generated (resume, failover, a late draft): the penalties tell the two apart. 0: every token
    # a session starts from is prompt.
    prompt_length: int = 0
    min_tokens: int = 0  # EOS and stop_token_ids impossible until this many tokens are generated
    # The model's end-of-sequence ids, which min_tokens keeps out (filled in by the request path
    # from the target's model, so the draft and the target mask the same set).
    eos_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # report each emitted token's logprob and its position's top-n (None: off)
    # Gumbel-max with noise keyed by (seed, position, token): the output depends on the seed alone,
    # whatever the draft, k or schedule (specdec.exact.gumbel)
    invariant: bool = False
    # The prefix cache's scope: a session reuses kept positions only from sessions of the same
    # salt (the tenant and the request's cache_salt; "" = shared). Not sampling, but per session,
    # and it travels with the rest of what a session starts with.
    cache_salt: str = ""
    # Structured output: the generated tokens are constrained to this (specdec.exact.constraint);
    # the masks come from each replica's matcher at the session's committed tokens.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        # Normalise containers so the object is hashable-ish and immutable in spirit.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        self.validate()

    # -- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidArgumentError(name, f"must be a finite number, got {value!r}")

        finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidArgumentError("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {self.top_p}")
        finite("min_p", self.min_p)
        if not 0.0 <= self.min_p < 1.0:
            raise InvalidArgumentError("min_p", f"must be in [0, 1), got {self.min_p}")
        finite("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise InvalidArgumentError(
                "repetition_penalty", f"must be in [{low}, {high}] (1 = off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidArgumentError(name, f"must be in [-2, 2], got {value}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgumentError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise InvalidArgumentError("logit_bias", f"token ids must be integers >= 0, got {token!r}")
            finite(f"logit_bias[{token}]", bias)
            if abs(bias) > MAX_ABS_LOGIT_BIAS:
                raise InvalidArgumentError(
                    "logit_bias", f"biases must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias}"
                )
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= UINT64_MAX):
            raise InvalidArgumentError("seed", f"must be an unsigned 64-bit integer, got {self.seed!r}")
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise InvalidArgumentError(
                "max_new_tokens", f"must be in [1, {MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens!r}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgumentError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgumentError(
                    "stop", f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgumentError(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}"
            )
        for token in self.stop_token_ids:
            if not isinstance(token, int) or token < 0:
                raise InvalidArgumentError("stop_token_ids", f"token ids must be integers >= 0, got {token!r}")
        if not isinstance(self.prompt_length, int) or self.prompt_length < 0:
            raise InvalidArgumentError("prompt_length", f"must be an integer >= 0, got {self.prompt_length!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidArgumentError(
                "min_tokens",
                f"must be an integer in [0, max_new_tokens = {self.max_new_tokens}], got {self.min_tokens!r}",
            )
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise InvalidArgumentError("logprobs", f"must be an integer in [0, 20] (the top-n), got {self.logprobs!r}")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidArgumentError("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidArgumentError("constraint", f"must be a Constraint, got {type(self.constraint).__name__}")
        if len(self.eos_token_ids) > MAX_STOP_TOKEN_IDS or any(
            not isinstance(t, int) or t < 0 for t in self.eos_token_ids
        ):
            raise InvalidArgumentError("eos_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids >= 0")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: logit_bias ids must exist in the vocabulary."""
        named = (
            ("logit_bias", self.logit_bias),
            ("stop_token_ids", self.stop_token_ids),
            ("eos_token_ids", self.eos_token_ids),
        )
        for name, tokens in named:
            for token in tokens:
                if token >= vocab_size:
                    raise InvalidArgumentError(name, f"token id {token} is outside the vocabulary (size {vocab_size})")

    # -- derived ----------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def needs_counts(self) -> bool:
        """Whether the pipeline reads the generated tokens' counts (penalties; min_tokens, which
        reads how many there are)."""
        return self.uses_penalties or self.min_tokens > 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def with_seed(self, seed: int) -> SamplingParams:
        return replace(self, seed=seed)


# ------------------------------------------------------------------------------------------
# Token counts (the penalty history)
# ------------------------------------------------------------------------------------------
def token_counts(history: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Counts of each token id in ``history`` as a float32 vector of length ``vocab_size``."""
    counts = torch.zeros(vocab_size, dtype=torch.float32)
    if len(history):
        ids = torch.as_tensor(list(history), dtype=torch.long)
        counts.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float32))
    return counts


def block_token_counts(base_counts: torch.Tensor, block: Sequence[int], rows: int | None = None) -> torch.Tensor:
    """Per-row penalty histories for a block: row i counts the base history + block[:i].

    ``rows`` defaults to ``len(block) + 1`` (one row per proposal plus the bonus row).
    """
    vocab = base_counts.shape[-1]
    rows = len(block) + 1 if rows is None else rows
    counts = base_counts.unsqueeze(0).repeat(rows, 1)
    for i, token in enumerate(block[: rows - 1]):
        counts[i + 1 :, token] += 1.0
    assert counts.shape == (rows, vocab)
    return counts


# ------------------------------------------------------------------------------------------
# The pipeline
# ------------------------------------------------------------------------------------------
def _check_finite(logits: torch.Tensor) -> None:
    # -inf is a legitimate "impossible token" (vocab padding); NaN and +inf are not. One reduction
    # answers all three cases: a row's max is NaN if the row holds a NaN (max propagates it), +inf
    # if it holds +inf, -inf if every entry is -inf (one pass over the row instead of five).
    top = logits.amax(dim=-1)
    if bool(torch.isfinite(top).all()):
        return
    if bool((torch.isnan(top) | torch.isposinf(top)).any()):
        raise NonFiniteLogitsError("model produced NaN or +inf logits; refusing to sample from them")
    raise NonFiniteLogitsError("every logit in a row is -inf; the distribution is empty")


def _apply_penalties(
    logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor, prompt_seen: torch.Tensor | None
) -> torch.Tensor:
    if params.repetition_penalty != 1.0:
        seen = counts > 0 if prompt_seen is None else (counts > 0) | prompt_seen
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * counts
    return logits


def greedy_one_hot(logits: torch.Tensor) -> torch.Tensor:
    """One-hot on the argmax of each row; ties go to the lowest token id.

    ``torch.argmax`` returns the first maximal index, which is the lowest id.
    """
    probs = torch.zeros_like(logits)
    probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return probs


@dataclass(frozen=True)
class RowParams:
    """The truncation parameters of rows of several sessions, one row each ([R, 1] tensors):
    what lets one call transform the rows of every session in a pass (:func:`logprobs_rows`).
    A step no row takes is None (no tensor built, nothing computed: a lone session's call costs
    what it did before the rows were batched)."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None  # int64; 0 = off for that row
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None

    @classmethod
    def of(cls, groups: Sequence[tuple[SamplingParams, int]], dtype: torch.dtype = torch.float32) -> RowParams:
        """Per-row tensors for ``groups`` of (params, rows), in row order."""

        def column(values: list, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=kind).unsqueeze(-1)

        def per_row(name: str) -> list:
            return [getattr(params, name) for params, rows in groups for _ in range(rows)]

        used = [params for params, rows in groups if rows]
        return cls(
            column(per_row("temperature")),
            column(per_row("top_k"), torch.long) if any(p.top_k > 0 for p in used) else None,
            column(per_row("top_p")) if any(p.top_p < 1.0 for p in used) else None,
            column(per_row("min_p")) if any(p.min_p > 0.0 for p in used) else None,
        )


def constraint_conflict(params: SamplingParams) -> str | None:
    """What a constrained request sets that a constraint cannot be combined with (None: nothing):
    settings that forbid the EOS a complete constraint allows alone."""
    for conflict, present in (
        ("ignore_eos", params.ignore_eos),
        ("min_tokens", params.min_tokens > 0),
    ):
        if present:
            return conflict
    return None


def logprobs_rows(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Steps 4-7 of the pipeline for rows [R, V] (after bias and penalties), each row with its
    own parameters: temperature, then top_k, top_p, min_p, renormalised after each truncation --
    a row that a step leaves alone keeps its values untouched (not renormalised again). A row's
    result depends on that row alone, so rows of many sessions can share one call."""
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    vocab = logprobs.shape[-1]
    if params.top_k is not None:
        # the k-th largest value of each row; ties with it are all kept
        kth = torch.sort(logprobs, dim=-1, descending=True).values.gather(-1, params.top_k.clamp(1, vocab) - 1)
        cut = (params.top_k > 0) & (params.top_k < vocab)
        logprobs = _renormalised_where(cut, logprobs, logprobs < kth)
    if params.top_p is not None:
        # Stable descending sort: equal probabilities keep ascending id order, so ties are
        # resolved toward lower ids deterministically.
        sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
        sorted_p = sorted_lp.exp()
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p  # the first token always has mass_before 0: kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logprobs = _renormalised_where(params.top_p < 1.0, logprobs, drop)
    if params.min_p is not None:
        threshold = logprobs.max(dim=-1, keepdim=True).values + torch.log(params.min_p)
        logprobs = _renormalised_where(params.min_p > 0.0, logprobs, logprobs < threshold)
    return logprobs


class RowsOf(NamedTuple):
    """Logits rows of one session and what its transform needs (see :func:`transformed_rows`)."""

    logits: torch.Tensor  # [rows, V]
    params: SamplingParams
    counts: torch.Tensor | None  # the rows' penalty histories ([rows, V] or [V]), or None
    prompt_seen: torch.Tensor | None
    allowed: torch.Tensor | None = None  # the rows' constraint masks ([rows, V] bool), or None


def transformed_rows(parts: Sequence[RowsOf]) -> tuple[torch.Tensor, dict[int, BaseException]]:
    """The rows of several sessions as one float32 tensor after steps 1-3 (bias and penalties,
    for the sessions that ask for them) and the finiteness check -- without the rows of the parts
    the check refuses; and those refusals, by part index (one session's bad rows fail that
    session alone)."""
    if not parts:
        return torch.empty(0), {}
    rows = torch.cat([part.logits.reshape(-1, part.logits.shape[-1]) for part in parts]).to(torch.float32)
    bounds = [0]
    for part in parts:
        bounds.append(bounds[-1] + part.logits.reshape(-1, part.logits.shape[-1]).shape[0])
    finite = torch.isfinite(rows.amax(dim=-1)).tolist()  # one reduction answers for every row
    refused: dict[int, BaseException] = {}
    for index, part in enumerate(parts):
        start, end = bounds[index], bounds[index + 1]
        nothing_to_apply = not part.params.logit_bias and not part.params.needs_counts and part.allowed is None
        if all(finite[start:end]) and nothing_to_apply:
            continue  # the rows are already what steps 1-3 give
        try:
            rows[start:end] = biased_and_penalised(
                rows[start:end], part.params, part.counts, torch.float32, part.prompt_seen, part.allowed
            )
        except Exception as exc:  # noqa: BLE001 - this part's rows are refused, not the others'
            refused[index] = exc
    if refused:
        kept = [
            i for index in range(len(parts)) if index not in refused for i in range(bounds[index], bounds[index + 1])
        ]
        rows = rows[kept]
    return rows, refused


def _renormalised_where(rows: torch.Tensor, logprobs: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """In ``rows`` ([R, 1] bool), ``logprobs`` without ``drop`` and renormalised; elsewhere as is."""
    return torch.where(rows, torch.log_softmax(logprobs.masked_fill(drop, -math.inf), dim=-1), logprobs)


def biased_and_penalised(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: torch.Tensor | None,
    dtype: torch.dtype,
    prompt_seen: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The finiteness check, then steps 1-3 of the pipeline (logit bias, penalties) and the
    constraint's ``allowed`` mask (bool, broadcastable to ``logits``; None: unconstrained)."""
    logits = logits.to(dtype)
    _check_finite(logits)
    if params.logit_bias:
        bias = torch.zeros(logits.shape[-1], dtype=dtype)
        ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long)
        bias[ids] = torch.tensor(list(params.logit_bias.values()), dtype=dtype)
        logits = logits + bias
    if params.needs_counts:
        if counts is None:
            raise ValueError("penalties and min_tokens need the token counts of the generated tokens")
        if params.min_tokens > 0:
            logits = _before_min_tokens(logits, params, counts)
        if params.uses_penalties:
            logits = _apply_penalties(logits, params, counts.to(dtype), prompt_seen)
    if allowed is not None:
        logits = constrained(logits, allowed)
    return logits


def _before_min_tokens(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor) -> torch.Tensor:
    """Rows whose position has fewer than min_tokens generated tokens before it (the count of
    their generated history) cannot end the request: EOS and stop token ids get -inf."""
    ending = sorted(set(params.stop_token_ids) | set(params.eos_token_ids))
    ending = [t for t in ending if t < logits.shape[-1]]
    if not ending:
        return logits
    generated = counts.sum(dim=-1, keepdim=True)  # [..., 1]
    early = (generated < params.min_tokens).expand(*logits.shape[:-1], len(ending))
    ids = torch.tensor(ending, dtype=torch.long)
    blocked = logits.index_select(-1, ids).masked_fill(early, -math.inf)
    return logits.index_copy(-1, ids, blocked)


def logprobs_from_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    prompt_seen: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Transformed log-probabilities (float32, -inf where filtered) for rows of ``logits``.

    ``logits``: [..., V]. ``counts``: the generated tokens' counts, broadcastable to ``logits``
    (required when the params use penalties); ``prompt_seen``: the prompt's tokens (bool [V], for
    the repetition penalty); ``allowed``: the rows' constraint masks (bool, broadcastable). For
    greedy params this returns log of the one-hot.
    """
    logits = biased_and_penalised(logits, params, counts, dtype, prompt_seen, allowed)
    if params.greedy:
        # log of the one-hot, written directly: log(0) is a slow path on CPU
        return torch.full_like(logits, -math.inf).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
    rows = logits.reshape(-1, logits.shape[-1])
    return logprobs_rows(rows, RowParams.of([(params, rows.shape[0])], rows.dtype)).reshape(logits.shape)


def reported_logprobs(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: torch.Tensor | None = None,
    prompt_seen: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The log-probabilities a request's ``logprobs`` reports (specdec.exact.logprobs): the
    transformed distribution for sampled params; for greedy ones (a one-hot) the log-softmax of
    the logits after bias, penalties and the constraint, the scores the argmax is taken over."""
    if not params.greedy:
        return logprobs_from_logits(logits, params, counts, prompt_seen=prompt_seen, allowed=allowed)
    scores = biased_and_penalised(logits, params, counts, torch.float32, prompt_seen, allowed)
    return torch.log_softmax(scores, dim=-1)


def greedy_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: torch.Tensor | None = None,
    prompt_seen: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """For greedy params: the token each row's one-hot puts its mass on (the argmax after logit
    bias and penalties, ties toward the lowest id) -- exactly where :func:`probs_from_logits`
    puts it, without building the dense one-hot rows. ``logits`` [..., V] -> ids [...]."""
    if not params.greedy:
        raise ValueError("greedy_tokens is for temperature 0")
    return biased_and_penalised(logits, params, counts, torch.float32, prompt_seen, allowed).argmax(dim=-1)


def probs_from_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    prompt_seen: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """THE transform: rows of logits -> rows of probabilities (each row sums to 1).

    float32 is what the engines use; the selftest passes float64 to enumerate the exact law.
    """
    if params.greedy:  # the one-hot itself (exp of its log, without the slow exp(-inf))
        return greedy_one_hot(biased_and_penalised(logits, params, counts, dtype, prompt_seen, allowed))
    return logprobs_from_logits(logits, params, counts, dtype, prompt_seen, allowed).exp()
