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

import asyncio
import concurrent.futures
import json
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdec.errors import InvalidArgumentError, ResourceExhaustedError
from specdec.exact.constraint import Constraint, choices_of

DEFAULT_CACHE_ENTRIES = 128
# The compiled templates' memory, estimated (llguidance reports none): a fixed part and a part
# per character of the spec, fitted on schemas up to 64 KB with some margin (docs/structured-output.md).
DEFAULT_CACHE_BYTES = 64 << 20
TEMPLATE_BASE_BYTES = 64 << 10
TEMPLATE_BYTES_PER_CHAR = 64
REFUSED_ENTRIES = 1024  # specs refused once, answered again without a compile
# Compiles run on threads of their own: llguidance's compiler recurses once per nested rule, and
# a 64 KB chain of rules needs more than the 8 MB stack of an ordinary thread -- an overflow is a
# segfault that takes the whole process. The stack is address space; only what a compile touches
# becomes memory.
COMPILE_THREADS = 2
COMPILE_STACK_BYTES = 256 << 20
COMPILE_QUEUE = 32  # compiles waiting for a thread; past this a request is refused (RESOURCE_EXHAUSTED)
COMPILE_BUDGET_S = 10.0  # how long a request waits for its constraint once its compile has started
# llguidance's GBNF reader is Python whose time grows with the square of the rules: this bounds
# it to about a second (Lark grammars compile in llguidance's Rust, bounded by its own limits)
MAX_GBNF_RULES = 1000
MAX_ERROR_CHARS = 400  # what of llguidance's message reaches a client
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.MULTILINE)

# Any JSON object: the OpenAI json_object mode (the model chooses the keys).
_ANY_OBJECT_SCHEMA = {"type": "object"}


class GrammarError(InvalidArgumentError):
    """A constraint that does not compile (field "constraint"; the message names the problem:
    the caller's 400)."""


class UnfollowableConstraintError(InvalidArgumentError):
    """A compiled constraint the output cannot follow further: its matcher hit one of
    llguidance's limits (too many parser items or lexer states at some position), or no token of
    the model's vocabulary continues it (a vocabulary without byte fallback). The client's
    constraint, a 400 naming the position, not a server fault."""


class MatcherError(RuntimeError):
    """A matcher asked to consume a token its constraint does not admit, or to roll back past
    its start: a bug upstream, since every committed token was drawn under the mask."""


def short(message: str) -> str:
    """llguidance's message, on one line and bounded: some quote the grammar back."""
    line = " ".join(message.replace("<non-verbose/>", "").split())
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def dead_end(error: str) -> bool:
    """Whether llguidance's ``error`` says its mask admits no token at all (the bytes the
    constraint needs next are in no token); its matcher cannot roll back from it."""
    return error.startswith("NoExtensionBias")


def spelled(matcher, words: bytes, eos: Sequence[int]) -> bool:
    """Whether the first token ``words`` (a fresh matcher's mask) admits besides EOS is one its
    parser accepts: where the constraint's first bytes are in no token (a vocabulary without
    byte fallback), llguidance's mask admits tokens as if they were spelled, and refuses each."""
    allowed = [t for t in unpack_bitmask(words, len(words) * 8).nonzero().flatten().tolist() if t not in eos]
    return not allowed or matcher.validate_tokens(allowed[:1]) == 1


def parser_limits():
    """The limits every matcher runs under, in every process: a constraint the coordinator
    accepts must compile the same on each replica. No grammar or parser state in messages."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


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
            except RecursionError:
                raise GrammarError("constraint", "json_schema: nested too deeply") from None
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

        rules = len(_GBNF_RULE.findall(spec))
        if rules > MAX_GBNF_RULES:
            raise GrammarError("constraint", f"grammar: {rules} GBNF rules; at most {MAX_GBNF_RULES}")
        try:
            lark = gbnf_to_lark(spec)
        except GbnfToLarkError as error:
            raise GrammarError("constraint", f"grammar: not valid GBNF ({short(str(error))})") from None
        except RecursionError:
            raise GrammarError("constraint", "grammar: GBNF nested too deeply") from None
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
            if dead_end(self._inner.get_error()):
                raise self._dead_end()
            raise UnfollowableConstraintError(
                "sampling.structured_output",
                f"the constraint is too complex to follow after {self.consumed} tokens "
                f"({short(self._inner.get_error())})",
            )

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the constraint admits next (only EOS once it is
        complete), at a position the output has reached: one admitting no token at all leaves
        the law there undefined, UnfollowableConstraintError."""
        mask = self._mask()
        if not bool(mask.any()):
            raise self._dead_end()
        return mask

    def _mask(self) -> torch.Tensor:
        """:meth:`allowed`, where an empty set is an answer (a position looked ahead to: a draft
        ends its block there, a verifier that reaches it finds it at its next step)."""
        mask = unpack_bitmask(self._inner.compute_bitmask(), self.vocab_size)
        self._check()
        return mask

    def _dead_end(self) -> UnfollowableConstraintError:
        return UnfollowableConstraintError(
            "sampling.structured_output",
            f"no token of the model's vocabulary continues the constraint after {self.consumed} tokens",
        )

    def admits(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the constraint admits from here (state unchanged)."""
        return self._inner.validate_tokens(list(tokens))

    def advance(self, tokens: list[int]) -> None:
        """Consume committed ``tokens``; a token the constraint does not admit is a MatcherError,
        with nothing consumed (llguidance's matcher never leaves an error state, so a token is
        checked before it is offered) -- or UnfollowableConstraintError where the constraint
        admits no token at all there, which ends the matcher."""
        tokens = [int(t) for t in tokens]
        admitted = self._inner.validate_tokens(tokens)
        if admitted < len(tokens):
            self.advance(tokens[:admitted])
            words = self._inner.compute_bitmask()
            if not any(words) or (self._inner.is_error() and dead_end(self._inner.get_error())):
                raise self._dead_end()  # drawn where nothing is admitted (no rollback from there)
            masked_in = bool(unpack_bitmask(words, self.vocab_size)[tokens[admitted]])
            self.rollback(admitted)
            if masked_in:  # llguidance's mask admits what its parser refuses: bytes no token spells
                raise UnfollowableConstraintError(
                    "sampling.structured_output",
                    f"the model's vocabulary cannot spell what the constraint needs after "
                    f"{self.consumed + admitted} tokens",
                )
            raise MatcherError(f"token {tokens[admitted]} (index {admitted}) is not admitted here")
        if tokens and not self._inner.consume_tokens(tokens):
            self._check()  # a limit reached on the way is the client's constraint, not a bug
            raise MatcherError(f"the matcher refused tokens it had admitted: {short(self._inner.get_error())}")
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
            allowed = self._mask()
            if len(before_eos) == len(tokens):
                return allowed
            if not allowed[int(tokens[len(before_eos)])]:
                raise MatcherError(f"EOS (index {len(before_eos)}) is not admitted here")
            return self._eos_only()
        finally:  # also after a refused token: what was consumed before it goes back
            if self.consumed > start:
                self.rollback(self.consumed - start)

    def forced(self, limit: int) -> list[int]:
        """The run of tokens the constraint forces next, at most ``limit`` of them: at each
        position the mask admits that token alone, so the constrained law there is a point mass
        (checked on the mask itself -- a full-vocabulary mask per token, hence the limit -- not
        taken on trust from llguidance's fast-forward tokens); once the constraint is complete,
        the EOS when the model has one alone. The state is unchanged."""
        if limit <= 0:
            return []
        if self.complete:
            return list(self.eos) if len(self.eos) == 1 else []
        run: list[int] = []
        try:
            for token in self._inner.compute_ff_tokens()[:limit]:
                mask = self._mask() if run else self.allowed()
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
            masks.append(self._mask())
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


class CompileWorkers:
    """Threads of their own for compiling constraints: a deep stack (COMPILE_STACK_BYTES) and a
    bounded queue, so compiles neither overflow a stack nor queue without bound, and never take
    the threads that tokenize or serve. Started on the first compile: a process no request
    constrains never holds them."""

    _stack_lock = threading.Lock()  # threading.stack_size is process-wide

    def __init__(self, threads: int = COMPILE_THREADS, queue_size: int = COMPILE_QUEUE):
        self._jobs: queue.Queue[CompileJob] = queue.Queue(maxsize=queue_size)
        self._threads = threads
        self._started = False
        self._lock = threading.Lock()

    def submit(self, job: CompileJob) -> None:
        """Queue ``job``; ResourceExhaustedError when the queue is full."""
        self._start()
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise ResourceExhaustedError(
                f"{self._jobs.maxsize} constraints are waiting to compile; retry shortly"
            ) from None

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            with CompileWorkers._stack_lock:
                before = threading.stack_size(COMPILE_STACK_BYTES)
                try:
                    for i in range(self._threads):
                        threading.Thread(target=self._work, name=f"specdec-grammar-{i}", daemon=True).start()
                finally:
                    threading.stack_size(before)
            self._started = True

    def _work(self) -> None:
        while True:
            self._jobs.get().run()


class CompileJob:
    """One constraint's compile: ``started`` resolves when a worker takes it (with the time),
    ``done`` with the template or the error, after ``settle`` has recorded it (so a waiter that
    wakes finds the cache already up to date). Everyone waiting for the same constraint shares it."""

    def __init__(
        self, compile_template: Callable[[], Any], settle: Callable[[Any, BaseException | None], None] | None = None
    ):
        self._compile, self._settle = compile_template, settle
        self.started: concurrent.futures.Future[float] = concurrent.futures.Future()
        self.done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run(self) -> None:
        self.started.set_result(time.monotonic())
        value, error = None, None
        try:
            value = self._compile()
        except BaseException as failure:  # noqa: BLE001 - every failure goes to the waiters
            error = failure
        if self._settle is not None:
            self._settle(value, error)
        if error is None:
            self.done.set_result(value)
        else:
            self.done.set_exception(error)


def template_bytes(constraint: Constraint) -> int:
    """What a compiled template of ``constraint`` is assumed to hold in memory."""
    return TEMPLATE_BASE_BYTES + TEMPLATE_BYTES_PER_CHAR * len(constraint.spec)


class Grammars:
    """Compiled constraints for one tokenizer: each spec compiled once per scope, each session a
    cheap copy of its template.

    - Compiles run on CompileWorkers (deep stacks, a bounded queue), never on the caller's
      thread; a caller waits at most ``budget_s`` once its compile has started, after which the
      constraint is refused (and stays refused: a spec that costs that much once is not compiled
      again). Everyone asking for the same constraint meanwhile shares the one compile.
    - Templates are cached per *scope* (the request's tenant, carried as its cache salt): how fast
      a constraint compiles never tells one tenant what another sent. The cache is bounded in
      entries and in estimated bytes (least recently used first out); refusals are remembered
      too (REFUSED_ENTRIES), so repeating a bad constraint costs nothing.
    - A compile also computes the first mask: a constraint whose very first step exceeds
      llguidance's limits is refused here, as the client's error, before any replica is asked.

    The tokenizer's llguidance form is built on the first constraint (a third of a second for a
    49k vocabulary): a replica no request constrains never pays it, and a tokenizer llguidance
    cannot read fails those requests, not the replica's start."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_tokens: list[int],
        max_entries: int = DEFAULT_CACHE_ENTRIES,
        max_bytes: int = DEFAULT_CACHE_BYTES,
        budget_s: float = COMPILE_BUDGET_S,
        workers: CompileWorkers | None = None,
    ):
        import llguidance

        self.vocab_size = vocab_size
        self._source, self._eos = tokenizer, sorted(eos_tokens)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[tuple[str, Constraint], tuple[Any, int]] = OrderedDict()
        self._refused: OrderedDict[tuple[str, Constraint], str] = OrderedDict()
        self._pending: dict[tuple[str, Constraint], CompileJob] = {}
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # building it takes a while: not under the cache's lock
        self.max_entries, self.max_bytes, self.budget_s = max_entries, max_bytes, budget_s
        self._workers = workers or CompileWorkers()
        self.cached_bytes = 0
        self.compiles = 0
        self.hits = 0
        self.refusals = 0
        self.compile_seconds = 0.0

    # -- the two ways to ask: from a thread, from the event loop --------------------------------
    def matcher(self, constraint: Constraint, scope: str = "") -> Matcher:
        """A fresh matcher at the start of ``constraint`` (compiled within ``scope``), waiting on
        this thread; GrammarError names what is wrong, ResourceExhaustedError when the compile
        queue is full."""
        found = self._template_or_job((scope, constraint))
        if isinstance(found, CompileJob):
            started = found.started.result()
            try:
                found = found.done.result(timeout=max(0.0, started + self.budget_s - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise self._over_budget((scope, constraint)) from None
        return self._copy(found)

    async def matcher_async(self, constraint: Constraint, scope: str = "") -> Matcher:
        """:meth:`matcher` for an event loop: the wait holds no thread."""
        found = self._template_or_job((scope, constraint))
        if isinstance(found, CompileJob):
            started = await asyncio.wrap_future(found.started)
            remaining = max(0.0, started + self.budget_s - time.monotonic())
            try:
                found = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(found.done)), remaining)
            except asyncio.TimeoutError:
                raise self._over_budget((scope, constraint)) from None
        return self._copy(found)

    # -- the cache ---------------------------------------------------------------------------
    def _template_or_job(self, key: tuple[str, Constraint]) -> Any:
        """The cached template of ``key``, else the compile job to wait for (started if none
        is under way); a remembered refusal is raised again."""
        with self._lock:
            entry = self._templates.get(key)
            if entry is not None:
                self._templates.move_to_end(key)
                self.hits += 1
                return entry[0]
            refused = self._refused.get(key)
            if refused is not None:
                self._refused.move_to_end(key)
                self.refusals += 1
                raise GrammarError("constraint", refused)
            job = self._pending.get(key)
            if job is not None:
                return job
            job = CompileJob(lambda: self._compile(key[1]), lambda value, error: self._settle(key, value, error))
            self._pending[key] = job
        try:
            self._workers.submit(job)
        except ResourceExhaustedError:
            with self._lock:
                self._pending.pop(key, None)
            raise
        return job

    def _settle(self, key: tuple[str, Constraint], template, error: BaseException | None) -> None:
        """A finished compile: its template cached, or its refusal remembered (unless a waiter
        already refused it for taking too long)."""
        with self._lock:
            self._pending.pop(key, None)
            if key in self._refused:
                return
            if isinstance(error, GrammarError):
                self._remember_refusal(key, str(error).split(": ", 1)[-1])
            elif error is None:
                size = template_bytes(key[1])
                self._templates[key] = (template, size)
                self.cached_bytes += size
                while self._templates and (
                    len(self._templates) > self.max_entries or self.cached_bytes > self.max_bytes
                ):
                    _, (_, evicted) = self._templates.popitem(last=False)
                    self.cached_bytes -= evicted

    def _over_budget(self, key: tuple[str, Constraint]) -> GrammarError:
        message = f"{key[1].kind}: took longer than {self.budget_s:g} s to compile"
        with self._lock:
            self._remember_refusal(key, message)
        return GrammarError("constraint", message)

    def _remember_refusal(self, key: tuple[str, Constraint], message: str) -> None:
        self._refused[key] = message
        self._refused.move_to_end(key)
        while len(self._refused) > REFUSED_ENTRIES:
            self._refused.popitem(last=False)

    def _copy(self, template) -> Matcher:
        return Matcher(template.deep_copy(), self.vocab_size, self._eos)

    # -- on a compile worker -----------------------------------------------------------------
    def _compile(self, constraint: Constraint):
        """The template of ``constraint`` with its first mask computed, or GrammarError."""
        import llguidance

        started = time.perf_counter()
        try:
            text = grammar_text(constraint)
            template = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0, limits=parser_limits())
        except GrammarError:
            raise
        except RecursionError:
            raise GrammarError("constraint", f"{constraint.kind}: nested too deeply") from None
        except BaseException as error:  # what llguidance raises (or panics with) on what it cannot read
            if not isinstance(error, Exception) and type(error).__name__ != "PanicException":
                raise
            raise GrammarError("constraint", f"{constraint.kind}: {short(str(error))}") from None
        if template.is_error():
            raise GrammarError("constraint", f"{constraint.kind}: {short(template.get_error())}")
        first = template.deep_copy()
        words = first.compute_bitmask()
        if not any(words) or (first.is_error() and dead_end(first.get_error())) or not spelled(first, words, self._eos):
            raise GrammarError("constraint", f"{constraint.kind}: no token of the model's vocabulary can begin it")
        if first.is_error():
            raise GrammarError(
                "constraint", f"{constraint.kind}: too complex at its first token ({short(first.get_error())})"
            )
        with self._lock:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - started
        return template

    def _llg_tokenizer(self):
        import llguidance

        with self._tokenizer_lock:
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
                        "constraint", f"this replica's tokenizer cannot serve constraints: {short(str(error))}"
                    ) from None
            return self._tokenizer

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "grammar_compiles": self.compiles,
                "grammar_cache_hits": self.hits,
                "grammar_compile_seconds": self.compile_seconds,
                "grammar_cache_entries": len(self._templates),
                "grammar_cache_bytes": self.cached_bytes,
                "grammar_refusals": self.refusals,
            }
