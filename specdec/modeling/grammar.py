"""Structured output: a request's constraint (JSON schema, JSON object, regex, choice, grammar)
as llguidance matchers over a tokenizer's vocabulary (issue 45; docs/structured-output.md).

Why llguidance (measured on the default target's 49k vocabulary, docs/structured-output.md): no
dependencies of its own (xgrammar pulls triton and a TVM runtime), token-level forced runs
(``compute_ff_tokens``, the free proposals), rollback, and resource limits on every grammar and
every mask step, so a hostile schema is refused or bounded rather than stalling a replica.

The allowed set at a position is a pure function of (constraint, tokens since the constraint
began): every replica that holds the same committed tokens computes the same mask, which is what
keeps the draft's q and the target's p constrained identically.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from specdec.errors import InvalidArgumentError
from specdec.exact.constraint import Constraint, choices_of

DEFAULT_CACHE_ENTRIES = 128

# Any JSON object: the OpenAI json_object mode (the model chooses the keys).
_ANY_OBJECT_SCHEMA = {"type": "object"}


class GrammarError(InvalidArgumentError):
    """A constraint that does not compile (field "constraint"; the message names the problem:
    the caller's 400)."""


class MatcherError(RuntimeError):
    """A matcher asked to consume a token its constraint does not admit, or to roll back past
    its start: a bug upstream, since every committed token was drawn under the mask."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint`` (not yet checked against a tokenizer)."""
    import llguidance

    kind, spec = constraint.kind, constraint.spec
    if kind in ("json_object", "json_schema"):
        if kind == "json_object":
            schema = _ANY_OBJECT_SCHEMA
        else:
            try:
                schema = json.loads(spec)
            except json.JSONDecodeError as error:
                raise GrammarError(
                    "constraint", f"json_schema: not JSON ({error.msg} at character {error.pos})"
                ) from None
            if not isinstance(schema, dict):
                raise GrammarError("constraint", "json_schema: a JSON schema is an object")
        # Python's json.dumps layout (", " and ": "), no free whitespace: a model cannot pad forever
        layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=layout)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # each choice a Lark string literal (JSON's escapes), the start rule their alternation
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices_of(spec)))
    lark = spec
    if "::=" in spec:  # GBNF (llama.cpp's, what vLLM users often send)
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            lark = gbnf_to_lark(spec)
        except GbnfToLarkError as error:
            raise GrammarError("constraint", f"grammar: not valid GBNF ({error})") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def unpack_bitmask(words: bytes, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (32-bit words, token i at bit i % 32 of word i // 32, least
    significant first) as a bool tensor of ``vocab_size``."""
    as_bytes = torch.frombuffer(bytearray(words), dtype=torch.uint8)
    bits = (as_bytes.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.flatten()[:vocab_size].bool()


class Matcher:
    """One sequence's place in its constraint: the allowed next tokens, advanced by committed
    tokens and rolled back with the caches."""

    def __init__(self, inner, vocab_size: int, eos_tokens: Sequence[int] = ()):
        self._inner = inner
        self.vocab_size = vocab_size
        self.consumed = 0  # tokens consumed since the constraint began
        # EOS ends the sequence: it is never consumed (llguidance does not count it in what a
        # rollback undoes), and after it only EOS is allowed
        self.eos = frozenset(int(t) for t in eos_tokens)

    def _until_eos(self, tokens: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in tokens]
        return next((tokens[:i] for i, t in enumerate(tokens) if t in self.eos), tokens)

    def _eos_only(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[[t for t in self.eos if t < self.vocab_size]] = True
        return mask

    def _check(self) -> None:
        if self._inner.is_error():
            raise MatcherError(f"the constraint's matcher failed: {self._inner.get_error()}")

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the constraint admits next (only EOS once it is complete)."""
        mask = unpack_bitmask(self._inner.compute_bitmask(), self.vocab_size)
        self._check()
        return mask

    def admits(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the constraint admits from here (state unchanged)."""
        return self._inner.validate_tokens(list(tokens))

    def advance(self, tokens: list[int]) -> None:
        """Consume committed ``tokens``; a token the constraint does not admit is a MatcherError,
        with nothing consumed (llguidance's matcher never leaves an error state, so a token is
        checked before it is offered)."""
        tokens = [int(t) for t in tokens]
        admitted = self._inner.validate_tokens(tokens)
        if admitted < len(tokens):
            raise MatcherError(f"token {tokens[admitted]} (index {admitted}) is not admitted here")
        if tokens and not self._inner.consume_tokens(tokens):
            raise MatcherError(f"the matcher refused tokens it had admitted: {self._inner.get_error()}")
        self.consumed += len(tokens)

    def rollback(self, count: int) -> None:
        if count > self.consumed or not self._inner.rollback(count):
            raise MatcherError(f"cannot roll back {count} of {self.consumed} tokens")
        self.consumed -= count

    def follow(self, generated: Sequence[int]) -> None:
        """Bring the matcher to the end of ``generated`` (the session's committed generated tokens,
        which a commit extends and nothing rewrites): consume what it has not seen; after a
        rollback of committed state (a resumed session restarting shorter), step back. Called at
        each use, so commits, rollbacks and resumes need no hook of their own."""
        generated = self._until_eos(generated)
        if self.consumed > len(generated):
            self.rollback(self.consumed - len(generated))
        self.advance(generated[self.consumed :])

    def allowed_after(self, tokens: Sequence[int]) -> torch.Tensor:
        """[vocab_size] bool: the allowed set after ``tokens`` (a draft's own proposals so far),
        the state restored afterwards; a token the constraint does not admit is a MatcherError."""
        before_eos = self._until_eos(tokens)
        start = self.consumed
        try:
            self.advance(before_eos)
            allowed = self.allowed()
            if len(before_eos) == len(tokens):
                return allowed
            if not allowed[int(tokens[len(before_eos)])]:
                raise MatcherError(f"EOS (index {len(before_eos)}) is not admitted here")
            return self._eos_only()
        finally:  # also after a refused token: what was consumed before it goes back
            if self.consumed > start:
                self.rollback(self.consumed - start)

    def forced(self) -> list[int]:
        """The run of tokens the constraint forces next: at each position the mask admits that
        token alone, so the constrained law there is a point mass (checked on the mask itself,
        not taken on trust from llguidance's fast-forward tokens); once the constraint is
        complete, the EOS when the model has one alone. The state is unchanged."""
        if self.complete:
            return list(self.eos) if len(self.eos) == 1 else []
        run: list[int] = []
        try:
            for token in self._inner.compute_ff_tokens():
                mask = self.allowed()
                if not mask[token] or int(mask.sum()) != 1:
                    break
                self.advance([token])
                run.append(token)
        finally:
            if run:
                self.rollback(len(run))
        return run

    def masks_along(self, tokens: Sequence[int]) -> torch.Tensor:
        """[len(tokens) + 1, vocab_size]: the allowed set before each of ``tokens`` and after the
        last -- a verify block's k + 1 positions -- with the state restored afterwards. Positions
        past a token the constraint does not admit repeat that position's mask (their rows are
        never reached by an exact verifier, which stops at the first rejection)."""
        masks = [self.allowed()]
        before_eos = self._until_eos(tokens)
        admitted = self._inner.validate_tokens(before_eos)
        for token in before_eos[:admitted]:
            self._inner.consume_token(token)
            masks.append(self.allowed())
        if admitted:
            self._inner.rollback(admitted)
        self._check()
        if admitted == len(before_eos) < len(tokens) and bool(masks[-1][int(tokens[admitted])]):
            masks.append(self._eos_only())  # an admitted EOS: only EOS after it
        while len(masks) < len(tokens) + 1:
            masks.append(masks[-1])
        return torch.stack(masks)

    @property
    def complete(self) -> bool:
        """The constraint is satisfied and admits nothing more than EOS."""
        return self._inner.is_stopped()


class Grammars:
    """Compiled constraints for one tokenizer: each spec compiled once (bounded LRU of template
    matchers), each session a cheap copy. Thread-safe: replicas compile off their event loop.
    The tokenizer's llguidance form is built on the first constraint (a third of a second for a
    49k vocabulary): a replica no request constrains never pays it, and a tokenizer llguidance
    cannot read fails those requests, not the replica's start."""

    def __init__(self, tokenizer, vocab_size: int, eos_tokens: list[int], max_entries: int = DEFAULT_CACHE_ENTRIES):
        import llguidance

        self.vocab_size = vocab_size
        self._source, self._eos = tokenizer, sorted(eos_tokens)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.compiles = 0
        self.hits = 0
        self.compile_seconds = 0.0

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher at the start of ``constraint``; GrammarError names what is wrong."""
        import llguidance

        with self._lock:
            template = self._templates.get(constraint)
            if template is not None:
                self._templates.move_to_end(constraint)
                self.hits += 1
        if template is None:
            started = time.perf_counter()
            text = grammar_text(constraint)
            template = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0)
            if template.is_error():
                raise GrammarError("constraint", f"{constraint.kind}: {template.get_error()}")
            with self._lock:
                self.compiles += 1
                self.compile_seconds += time.perf_counter() - started
                self._templates[constraint] = template
                while len(self._templates) > self.max_entries:
                    self._templates.popitem(last=False)
        return Matcher(template.deep_copy(), self.vocab_size, self._eos)

    def _llg_tokenizer(self):
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                backend = getattr(self._source, "backend_tokenizer", None)
                if backend is None:
                    raise GrammarError("constraint", "this replica's tokenizer is not a fast (Rust) tokenizer")
                try:
                    self._tokenizer = llguidance.LLTokenizer(
                        backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos
                    )
                except (ValueError, RuntimeError) as error:  # what llguidance raises for a tokenizer it cannot read
                    raise GrammarError(
                        "constraint", f"this replica's tokenizer cannot serve constraints: {error}"
                    ) from None
            return self._tokenizer

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "grammar_compiles": self.compiles,
                "grammar_cache_hits": self.hits,
                "grammar_compile_seconds": self.compile_seconds,
                "grammar_cache_entries": len(self._templates),
            }
