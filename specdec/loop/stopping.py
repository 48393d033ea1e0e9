"""Stop conditions and the output text of one request, both kept incrementally.

A request's text grows token by token. Re-decoding the whole output after every token, and
re-scanning it for every stop string, would cost O(n) per token and O(n^2) per request; here each
token costs a decode of a window of a few tokens and a scan of the text it added (plus the
longest stop string's length).

The window: a token's text is the decode of [previous token, this token] minus the decode of the
previous token alone (a tokenizer may render a word-initial token differently on its own), and is
held back while it ends in U+FFFD -- half of a multi-byte character whose other bytes come with
the next token. So the text settled so far is always exactly the decode of the tokens settled so
far (tests/test_stopping.py checks it against the one-shot decode on the bench prompts) -- but
for tokens that complete no character for MAX_UNSETTLED_TOKENS in a row, which are settled as they
decode then, so no window grows without bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specdec.exact.sampling import SamplingParams

FINISH_LENGTH, FINISH_STOP, FINISH_EOS = "length", "stop", "eos"
INCOMPLETE = "\ufffd"  # what decoding yields for the first bytes of an unfinished character
# A character is at most 4 bytes, so tokens that complete none for this long are bytes that
# never will (a model emitting lone byte tokens): their text is settled as it decodes now, U+FFFD
# and all, instead of re-decoding an ever longer window for each new token (quadratic).
MAX_UNSETTLED_TOKENS = 32


class IncrementalDetokenizer:
    """The text of a growing token sequence (``skip_special_tokens``, as the one-shot decode)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # the window's context starts here ...
        self.read_offset = 0  # ... and the tokens not yet settled start here

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append ``token``; return the text it settled ("" while a character is incomplete,
        or for a token that renders as nothing)."""
        self.tokens.append(int(token))
        context = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        window = self._decode(self.tokens[self.prefix_offset :])
        stuck = len(self.tokens) - self.read_offset >= MAX_UNSETTLED_TOKENS
        if len(window) <= len(context) or not window.startswith(context):
            if not stuck:
                return ""
            self.prefix_offset = self.read_offset = len(self.tokens)  # renders as nothing: start afresh
            return ""
        if window.endswith(INCOMPLETE) and not stuck:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return window[len(context) :]

    def unsettled(self) -> str:
        """The decode of the tokens not settled yet, as is (it may end in U+FFFD)."""
        context = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        window = self._decode(self.tokens[self.prefix_offset :])
        return window[len(context) :] if window.startswith(context) else ""


class StopChecker:
    """Applies max_new_tokens, EOS and stop strings to emitted tokens, one token at a time, so a
    stop inside a block cuts the block exactly there; keeps the text (with a tokenizer) and hands
    it out in pieces that never run past a matched stop string."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = (), tokenizer=None):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.params = params
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self._pieces: list[str] = []  # the settled text, piece by piece
        self._length = 0  # characters in _pieces
        # what take_text handed out: _sent characters; pieces before _next_piece entirely, and
        # _next_piece (which starts at character _piece_start) maybe in part
        self._sent = self._next_piece = self._piece_start = 0
        self._stop_at: int | None = None  # character index where the matched stop string starts
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self._tail = ""  # the last _longest_stop - 1 settled characters (a stop may straddle pieces)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def resume(self, committed: Sequence[int]) -> None:
        """Continue after tokens an earlier run of the request committed (no stop among them,
        or that run would have ended), whose text its client already has."""
        for token in map(int, committed):
            self.generated.append(token)
            self._settle(token)
        self._sent = self._piece_start = self._length
        self._next_piece = len(self._pieces)

    def feed(self, tokens: Sequence[int]) -> list[int]:
        """Append tokens until a stop condition; return those that made it into the output."""
        taken: list[int] = []
        for token in map(int, tokens):
            if self.finished:
                break
            self.generated.append(token)
            taken.append(token)
            piece = self._settle(token)
            if len(self.generated) < self.params.min_tokens:
                if piece and self.params.stop and self._find_stop(piece):  # (keeps the tail searched)
                    self._stop_at = None  # before min_tokens nothing ends the request (vLLM's meaning)
                continue
            if token in self.params.stop_token_ids:
                self.finish_reason = FINISH_STOP
            elif not self.params.ignore_eos and token in self.eos:
                self.finish_reason = FINISH_EOS
            elif piece and self.params.stop and self._find_stop(piece):
                self.finish_reason = FINISH_STOP
            elif len(self.generated) >= self.params.max_new_tokens:
                self.finish_reason = FINISH_LENGTH
        return taken

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finish_reason = reason

    def _settle(self, token: int) -> str:
        if self.detokenizer is None:
            return ""
        piece = self.detokenizer.add(token)
        if piece:
            self._pieces.append(piece)
            self._length += len(piece)
        return piece

    def _find_stop(self, piece: str) -> bool:
        """Whether a stop string now occurs: it must end inside ``piece`` (the text before it had
        none), so only ``piece`` and the characters just before it are searched."""
        window = self._tail + piece
        offset = self._length - len(window)
        hits = [i for i in (window.find(s) for s in self.params.stop) if i >= 0]
        self._tail = window[max(0, len(window) - self._longest_stop + 1) :] if self._longest_stop > 1 else ""
        if not hits:
            return False
        self._stop_at = offset + min(hits)
        return True

    def _limit(self, final: bool) -> int:
        """How much of the settled text may go out: all of it up to a matched stop string; while
        the request runs, not the last ``longest stop - 1`` characters, which may yet turn out to
        begin a stop string (a client must never receive text the final output does not have)."""
        if self._stop_at is not None:
            return self._stop_at
        if final or self._longest_stop <= 1:
            return self._length
        return self._length - (self._longest_stop - 1)

    def take_text(self, final: bool = False) -> str:
        """The text settled since the last call that may go out (see :meth:`_limit`); with
        ``final`` also the text of tokens not settled yet (an unfinished character) when no stop
        cut it. The pieces handed out add up to :meth:`text`."""
        limit = self._limit(final)
        out = []
        while self._sent < limit and self._next_piece < len(self._pieces):
            piece = self._pieces[self._next_piece]
            begin, end = self._sent - self._piece_start, min(len(piece), limit - self._piece_start)
            out.append(piece[begin:end])
            self._sent = self._piece_start + end
            if end < len(piece):
                break
            self._piece_start += len(piece)
            self._next_piece += 1
        if final and self._stop_at is None and self.detokenizer is not None:
            out.append(self.detokenizer.unsettled())
        return "".join(out)

    def text(self) -> str:
        """The whole output text (what a one-shot decode of the output tokens gives, cut at a
        matched stop string)."""
        if self.detokenizer is None:
            return ""
        settled = "".join(self._pieces)
        if self._stop_at is not None:
            return settled[: self._stop_at]
        return settled + self.detokenizer.unsettled()
