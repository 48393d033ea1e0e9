"""When to speculate, step by step, within one request (the adaptive policy).

A draft block costs a draft call and wider target rows whether or not it is accepted, so when
the draft is rarely right, speculation is slower than the target alone (docs/performance.md has
the break-even on the 2-core CPU machine). The adaptive policy follows the request's own
blocks: while they emit more tokens than they cost, every step proposes the request's k; when
they do not, it pauses (target-only steps) and probes with one block now and then, waiting twice
as long after each probe that still does not pay (at most ``max_probe_gap`` steps).

Why not re-optimise k itself every step: tried in simulation over the bench prompts' measured
draft run lengths (a geometric model of acceptance, k chosen in [0, 4] per step), it lost to a
fixed k=2 on the held-out prompts -- acceptance comes in runs the model does not see -- while
this on/off rule matched fixed k=2 there and cut the loss on the worst prompt
(docs/performance.md).

Exactness does not depend on k (any k gives the target's law). Reproducibility does: with
sampling, the tokens depend on which k each step used. So the policy uses no clocks or timings,
only the request's own history, and that history is recoverable from the committed output alone:
each step commits accepted + 1 tokens (only a request's last step can commit fewer, cut by a stop
condition), so :meth:`AdaptiveK.replay` over the per-step token counts rebuilds the state of the
run that wrote them. A coordinator taking over a request continues exactly as the lost one would.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StepCost:
    """Cost of one step that proposes k > 0 tokens, in units of a target-only step:
    ``1 + fixed + per_token * k``. ``fixed``: the draft call and the commit it carries;
    ``per_token``: one more draft forward plus one more verified row. Fixed numbers (not timings)
    so that a request's steps are reproducible; the defaults were measured on the 2-core CPU
    machine with the shipped SmolLM2 pair (docs/performance.md). On a GPU target, verifying k rows
    costs about as much as one: ``per_token`` is then mostly the draft's."""

    fixed: float = 0.17
    per_token: float = 0.19

    def __post_init__(self):
        if self.fixed < 0 or self.per_token < 0:
            raise ValueError(f"step costs must be >= 0, got fixed={self.fixed}, per_token={self.per_token}")

    @classmethod
    def parse(cls, text: str) -> StepCost:
        """From ``"FIXED,PER_TOKEN"`` (a command-line flag)."""
        try:
            fixed, per_token = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"a step cost is FIXED,PER_TOKEN (two numbers), got {text!r}") from None
        return cls(fixed, per_token)

    def of(self, k: int) -> float:
        return 1.0 if k == 0 else 1.0 + self.fixed + self.per_token * k


class KPolicy(Protocol):
    """How a request chooses each step's k: fixed (FixedK), from its own past only (AdaptiveK),
    or from the load as well (loop.load_aware_k.GoodputK). A policy sees only what the run
    committed, so a resumed run rebuilds it by ``replay``."""

    def next_k(self) -> int: ...
    def observe(self, k: int, accepted: int) -> None:
        """A step proposed ``k`` and the target accepted ``accepted`` of them."""
        ...

    def replay(self, step_lengths: Iterable[int]) -> None:
        """The state after steps that committed these many tokens each (a resumed request)."""
        ...


class FixedK:
    """Always ``k`` (the request asked for a fixed block size)."""

    def __init__(self, k: int):
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, k: int, accepted: int) -> None:
        pass

    def replay(self, step_lengths: Iterable[int]) -> None:
        pass


class AdaptiveK:
    """Blocks of ``k`` while they pay, target-only steps (and probes) while they do not.

    "Pays": a decayed mean of the tokens the request's blocks emitted (accepted + 1), each block
    weighing ``decay`` times the one after it, exceeds the block's cost in target-only steps.
    The mean starts optimistic (``cost + 0.5``, the weight of one block), so a request speculates
    until its own blocks say otherwise."""

    def __init__(self, k: int, cost: StepCost = StepCost(), decay: float = 0.9, max_probe_gap: int = 16):
        if k < 1:
            raise ValueError(f"an adaptive policy needs k >= 1, got {k}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if max_probe_gap < 1:
            raise ValueError(f"max_probe_gap must be >= 1, got {max_probe_gap}")
        self.k, self.decay, self.max_probe_gap = k, decay, max_probe_gap
        self.break_even = cost.of(k)
        self.emitted, self.weight = self.break_even + 0.5, 1.0  # decayed sum of tokens per block, of blocks
        self.idle = 0  # target-only steps since the last block
        self.probe_gap = 1  # target-only steps before the next probe; doubles while probes fail

    @property
    def tokens_per_block(self) -> float:
        return self.emitted / self.weight

    @property
    def pays(self) -> bool:
        return self.tokens_per_block > self.break_even

    def next_k(self) -> int:
        return self.k if self.pays or self.idle >= self.probe_gap else 0

    def observe(self, k: int, accepted: int) -> None:
        """Record a step that proposed ``k`` tokens (as :meth:`next_k` said) and accepted ``accepted``."""
        if k == 0:
            self.idle += 1
            return
        self.emitted = self.decay * self.emitted + accepted + 1
        self.weight = self.decay * self.weight + 1.0
        if self.idle:  # this block was a probe
            self.probe_gap = 1 if self.pays else min(2 * self.probe_gap, self.max_probe_gap)
        self.idle = 0

    def replay(self, step_lengths: Iterable[int]) -> None:
        """Rebuild the state from the tokens each earlier step committed (accepted + 1 each)."""
        for n in step_lengths:
            k = self.next_k()
            self.observe(k, min(k, max(0, n - 1)))


def make_policy(k: int, adaptive: bool, cost: StepCost = StepCost()) -> KPolicy:
    return AdaptiveK(k, cost) if adaptive and k > 0 else FixedK(k)
