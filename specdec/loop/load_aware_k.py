"""Load-aware speculation: each step's k chosen to maximise the expected committed tokens per
second of the whole batch the request shares (docs/goodput.md).

Verifying k proposals costs k more target rows and k draft positions. While the target pass is
memory-bound (few rows) the rows are nearly free and speculation pays; in a full batch every row
is compute, and a rejected proposal's row is compute thrown away. So the right k for a request
depends on everything else in the pass: the same request should speculate alone and stop when
many share its passes. The pieces, each a small pure part:

- :class:`CostCurve`: seconds of one batched pass against its size (target: rows; draft: sessions
  advancing one position), measured by the replica at startup (specdec.engine.profile) and
  refreshed online from the pass times the replicas report.
- :class:`PositionAcceptance`: the request's own acceptance per block position, decayed.
- :class:`BatchLoad`: what the request saw of the batch on its last step.
- :func:`choose_k`: the expected-value rule over those; :class:`GoodputK`, the per-request policy
  around it (with probes while the request's own blocks do not pay).

k never changes the output law (any schedule of k gives the target's law). It does change which
tokens a seed gives when sampling, and a load-dependent k depends on other users: seeded sampled
output is reproducible only under the replayable policy (specdec.loop.adaptive_k, the coordinator's
``--replayable-schedule``), whose k depends on the request's own past alone.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

log = logging.getLogger("specdec.loop.load_aware_k")

PRIOR_ACCEPTANCE = 0.6  # per position before the request's own blocks say (weight of one block)
MAX_CONTENTION = 2.0  # the contention a regime fits (SpeculationRegime.contention) is at most this
# What a session whose draft shares its target's hardware assumes before its regime has measured
# a load: the most. Past the serial model's turns, the two processes' threads oversubscribe the
# cores; on the 2-core CPU every fit ends at or near this bound (docs/goodput.md, "Bursts").
SHARED_HARDWARE_CONTENTION = MAX_CONTENTION
DRAFT_CALL_SECONDS = 0.002  # a propose round trip beyond its passes, until observed


class CostCurve:
    """Seconds of one pass of ``size`` (>= 1): piecewise linear through measured points, flat below
    the first point (a pass of 1 costs what it costs) and extended past the last point by the
    slope of the last segment. ``observe`` moves the curve toward a measured pass: the points on
    either side of its size are scaled toward it (weight ``rate``), keeping the curve
    non-decreasing, so a curve profiled on an idle machine follows the machine it runs on."""

    def __init__(self, points: Iterable[tuple[int, float]], rate: float = 0.2):
        pts = sorted((int(s), float(t)) for s, t in points)
        if (
            not pts
            or any(s < 1 or not math.isfinite(t) or t < 0 for s, t in pts)
            or len({s for s, _ in pts}) != len(pts)
        ):
            raise ValueError(f"a cost curve needs distinct sizes >= 1 with finite seconds >= 0, got {pts}")
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        self.sizes = [s for s, _ in pts]
        self.values = [t for _, t in pts]
        self.rate = rate
        self._monotone(0)

    def _monotone(self, anchor: int) -> None:
        for i in range(anchor + 1, len(self.values)):
            self.values[i] = max(self.values[i], self.values[i - 1])
        for i in range(anchor - 1, -1, -1):
            self.values[i] = min(self.values[i], self.values[i + 1])

    @property
    def points(self) -> list[tuple[int, float]]:
        return list(zip(self.sizes, self.values, strict=True))

    def seconds(self, size: float) -> float:
        if size <= 0:
            return 0.0
        sizes, values = self.sizes, self.values
        if size <= sizes[0] or len(sizes) == 1:
            return values[0] if size <= sizes[0] else values[0] * size / sizes[0]
        i = min(bisect.bisect_left(sizes, size), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        slope = (values[i] - values[i - 1]) / (hi - lo)
        return values[i - 1] + slope * (size - lo)

    def observe(self, size: int, seconds: float) -> None:
        if size < 1 or not (seconds > 0 and math.isfinite(seconds)):  # a NaN or inf report moves nothing
            return
        predicted = self.seconds(size)
        if predicted <= 0:
            return
        ratio = seconds / predicted
        i = bisect.bisect_left(self.sizes, size)
        touched = {min(i, len(self.sizes) - 1), max(i - 1, 0)}
        for j in touched:
            self.values[j] *= 1.0 + self.rate * (ratio - 1.0)
        self._monotone(min(touched))


class PositionAcceptance:
    """The request's acceptance per block position j = 1..k: the decayed share of its blocks that
    reached position j and accepted it (each block weighs ``decay`` times the one after it at that
    position), starting at ``prior`` with the weight of one block."""

    def __init__(self, k_max: int, decay: float = 0.9, prior: float = PRIOR_ACCEPTANCE):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 < decay <= 1.0 or not 0.0 <= prior <= 1.0:
            raise ValueError(f"decay must be in (0, 1] and prior in [0, 1], got {decay}, {prior}")
        self.decay = decay
        self.reached = [1.0] * k_max
        self.accepted = [prior] * k_max

    def observe(self, k: int, accepted: int) -> None:
        """A block of ``k`` proposals accepted its first ``accepted``."""
        for j in range(min(k, accepted + 1, len(self.reached))):
            self.reached[j] = self.decay * self.reached[j] + 1.0
            self.accepted[j] = self.decay * self.accepted[j] + (1.0 if j < accepted else 0.0)

    def rates(self) -> list[float]:
        return [a / r for a, r in zip(self.accepted, self.reached, strict=True)]

    def expected_tokens(self) -> list[float]:
        """E[tokens a step commits] for k = 0 .. k_max: 1 + the expected accepted prefix."""
        out, run = [1.0], 1.0
        for rate in self.rates():
            run *= rate
            out.append(out[-1] + run)
        return out


@dataclass(frozen=True)
class BatchLoad:
    """What a request saw on its last step: ``other_rows`` / ``other_sessions`` in the target
    pass it was in, ``other_drafting`` sessions in the draft pass it was in, ``other_live``
    sessions on the target replica, the wall ``cycle_seconds`` of its step (0: not measured), the
    ``last_k`` it proposed then and how long that proposal took (``propose_seconds``)."""

    other_rows: int = 0
    other_sessions: int = 0
    other_drafting: int = 0
    other_live: int = 0
    cycle_seconds: float = 0.0
    last_k: int = 0
    propose_seconds: float = 0.0  # the wall time of its last step's proposal (0: none)


IDLE = BatchLoad()
CALL_RATE = 0.3  # how fast the estimate of a proposal's overhead follows each measured one


@dataclass(frozen=True)
class Costs:
    target: CostCurve  # seconds of a target pass by rows
    draft: CostCurve | None  # seconds of a draft position by sessions (None: costs nothing, e.g. n-gram)
    draft_call_seconds: float = DRAFT_CALL_SECONDS  # a proposal's overhead beyond its passes (learnt)


def step_goodputs(expected: Sequence[float], load: BatchLoad, costs: Costs) -> list[float]:
    """Expected tokens committed per second by the batch, for each k = 0 .. len(expected) - 1,
    were every session on the replica to do as this request does (the batch as copies of it).

    Symmetric, not "me alone against the others' fixed rows": a pass's fixed cost is shared only
    by the sessions in it, so a batch where some sessions speculate and others do not falls out
    of step (their requests reach the target at different times) and pays for more passes; and
    one session's extra rows look cheap to it while everyone's together are not. The cycle: what
    the request's last step took (``cycle_seconds``, which holds what no model sees: round
    trips, the coordinator, a shared CPU), with the modelled passes of that step replaced by the
    modelled passes of a batch proposing k each; where nothing was measured, the modelled cycle."""
    sessions = max(load.other_live, load.other_sessions) + 1
    base = unmodelled_seconds(load, costs)
    return [
        sessions * tokens / max(1e-6, base + lockstep_seconds(k, sessions, costs)) for k, tokens in enumerate(expected)
    ]


def unmodelled_seconds(load: BatchLoad, costs: Costs) -> float:
    """What the request's last step took beyond its modelled passes (round trips, the
    coordinator, a shared CPU); 0 where nothing was measured."""
    if load.cycle_seconds <= 0:
        return 0.0
    observed_rows = load.other_rows + load.last_k + 1
    return max(0.0, load.cycle_seconds - costs.target.seconds(observed_rows) - load.propose_seconds)


def lockstep_seconds(k: int, sessions: int, costs: Costs) -> float:
    """The modelled passes of a step of ``sessions`` proposing ``k`` each in step: one target
    pass over all their rows, then (k > 0) ``k`` draft positions over all of them."""
    target = costs.target.seconds(sessions * (k + 1))
    if k == 0:
        return target
    per_position = costs.draft.seconds(sessions) if costs.draft is not None else 0.0
    return target + costs.draft_call_seconds + k * per_position


def serial_seconds(k: int, sessions: int, costs: Costs) -> float:
    """The modelled passes of the same step where the draft and target share their hardware:
    the sessions fall out of step (one drafts while another is verified), so each pays its own
    passes, and the passes take turns on the shared cores instead of overlapping -- every
    session's target pass of k + 1 rows and its k draft positions, one after another."""
    per_position = costs.draft.seconds(1) if costs.draft is not None else 0.0
    return sessions * (costs.target.seconds(k + 1) + costs.draft_call_seconds + k * per_position)


@dataclass(frozen=True)
class ModelGains:
    """The cost model's expected tokens per second of speculating over not, per session, at one
    load: with the sessions' passes in ``lockstep`` (what the profiles show: separate devices),
    and ``serial`` (hardware the draft and target share: see :func:`serial_seconds`)."""

    lockstep: float
    serial: float

    def blended(self, contention: float) -> float:
        """The gain at ``contention`` between the two (0: lockstep, 1: serial; the step's time is
        linear in it, so the gain's inverse is)."""
        if not (math.isfinite(self.lockstep) and math.isfinite(self.serial)):
            return self.lockstep
        inverse = (1.0 - contention) / max(1e-9, self.lockstep) + contention / max(1e-9, self.serial)
        return 1.0 / max(1e-9, inverse)


def model_gains(expected: Sequence[float], sessions: int, costs: Costs, base: float = 0.0) -> ModelGains:
    """:class:`ModelGains` at ``sessions`` for the k the lockstep model finds best (1 ..
    len(expected) - 1); ``base``: the step's unmodelled seconds."""
    off = base + lockstep_seconds(0, sessions, costs)

    def gain(k: int, seconds: float) -> float:
        return expected[k] * off / (expected[0] * max(1e-6, base + seconds))

    best = max(range(1, len(expected)), key=lambda k: (gain(k, lockstep_seconds(k, sessions, costs)), -k))
    return ModelGains(
        gain(best, lockstep_seconds(best, sessions, costs)), gain(best, serial_seconds(best, sessions, costs))
    )


def choose_k(expected: Sequence[float], load: BatchLoad, costs: Costs) -> int:
    """The k in 0 .. len(expected) - 1 of the highest expected batch goodput (the smallest on ties)."""
    goodputs = step_goodputs(expected, load, costs)
    return max(range(len(goodputs)), key=lambda k: (goodputs[k], -k))


@dataclass
class GoodputK:
    """The load-aware policy of one request: k in 0 .. ``k_max`` per step by :func:`choose_k`.

    When even an idle batch would not speculate (the request's own blocks do not pay for
    themselves), it probes with a block of ``k_max`` now and then, waiting twice as long after each
    probe that does not pay (at most ``max_probe_gap`` steps), so a request whose draft improves
    finds out. When only the load stops it, it does not probe: its estimate stays, and it
    speculates again when the load falls."""

    k_max: int
    costs: Costs
    decay: float = 0.9
    max_probe_gap: int = 16
    regime: SpeculationRegime | None = None  # the replica's measured on/off (None: the model alone)
    contention: float = 0.0  # the machine's, before the regime has measured it (SpeculationRegime.contention)
    window: int = field(init=False, default=-1)  # the regime window of this step
    deciding: bool = field(init=False, default=False)  # this step's k is its own choice, not the regime's
    acceptance: PositionAcceptance = field(init=False)
    load: BatchLoad = field(init=False, default=IDLE)
    idle: int = field(init=False, default=0)
    probe_gap: int = field(init=False, default=1)

    def __post_init__(self):
        if self.max_probe_gap < 1:
            raise ValueError(f"max_probe_gap must be >= 1, got {self.max_probe_gap}")
        self.acceptance = PositionAcceptance(self.k_max, self.decay)

    def _best(self, load: BatchLoad) -> int:
        return choose_k(self.acceptance.expected_tokens(), load, self.costs)

    def _learn_call(self, load: BatchLoad) -> None:
        """A proposal's overhead beyond its passes (round trip, queueing, serialising q) from
        the measured proposal time, so the cost of a block is not only what the curves see."""
        if load.last_k <= 0 or load.propose_seconds <= 0:
            return
        draft = self.costs.draft
        per_position = draft.seconds(load.other_drafting + 1) if draft is not None else 0.0
        overhead = max(0.0, load.propose_seconds - load.last_k * per_position)
        call = self.costs.draft_call_seconds + CALL_RATE * (overhead - self.costs.draft_call_seconds)
        self.costs = replace(self.costs, draft_call_seconds=call)

    def pays_alone(self) -> bool:
        return self._best(IDLE) > 0

    def next_k(self) -> int:
        if self.regime is not None:
            sessions = max(self.load.other_live, self.load.other_sessions) + 1
            expected = self.acceptance.expected_tokens()
            goodputs = step_goodputs(expected, self.load, self.costs)
            deepest = max(range(1, len(goodputs)), key=lambda k: (goodputs[k], -k))
            base, costs = unmodelled_seconds(self.load, self.costs), self.costs
            on, self.window = self.regime.speculating(
                sessions,
                gains=lambda at: model_gains(expected, at, costs, base),
                contention=self.contention,
            )
            self.deciding = on and self.regime.requests_decide
            if not self.deciding:
                # measured to pay on this replica now: the model chooses only how deep
                return deepest if on else 0
        return self._own_k()

    def _own_k(self) -> int:
        """k by the request's own model, 0 included, probing now and then where even an idle
        batch would not speculate."""
        best = self._best(self.load)
        if best > 0 or not self.idle >= self.probe_gap or self.pays_alone():
            return best
        return self.k_max  # a probe

    def observe(self, k: int, accepted: int) -> None:
        if self.regime is not None:
            self.regime.committed(self.window, accepted + 1)
            if k == 0 and not self.deciding:
                return  # the replica's regime said off: nothing learnt about this request's draft
        if k == 0:
            self.idle += 1
            return
        self.acceptance.observe(k, accepted)
        if self.idle:  # this block followed target-only steps: a probe, or the load fell
            self.probe_gap = 1 if self.pays_alone() else min(2 * self.probe_gap, self.max_probe_gap)
        self.idle = 0

    def observe_load(self, load: BatchLoad) -> None:
        self._learn_call(load)
        self.load = load

    def replay(self, step_lengths: Iterable[int]) -> None:
        """Rebuild the acceptance estimate from the tokens each earlier step committed. Which k
        each step had is not recorded; a step that committed n > 1 tokens accepted n - 1
        proposals of at least that many, which is what is observed (a one-token step says
        nothing). The k a taken-over request chooses next depends on this estimate only as an
        optimisation: its law does not."""
        for n in step_lengths:
            if n > 1:
                accepted = min(n - 1, self.k_max)
                self.acceptance.observe(accepted, accepted)


REGIME_WINDOW_SECONDS = 0.5  # a regime holds for this long, for every request on the replica
REGIME_EXPLORE_FIRST = 1  # windows: a bucket that measured one regime runs the other this soon ...
REGIME_EXPLORE_EVERY = 10  # ... and once both are measured, the losing one runs again after this many at first ...
REGIME_EXPLORE_MAX = 20  # ... the gap doubling, up to this, while each exploration confirms the loser
REGIME_RATE = 0.3  # EWMA weight of one window's figure
REGIME_CLEAR_MARGIN = 0.3  # the better regime this far ahead: explore the other only every explore_far windows
REGIME_EXPLORE_FAR = 60  # windows between explorations of a loser that far behind
REGIME_SETTLE_WINDOWS = 4  # after the load jumps (4x or more), this many windows explore nothing
REGIME_MODEL_CLEAR = 0.6  # a model gain below this (or above its inverse) rules the other regime out
REGIME_CONTENTION_PRIOR_WINDOWS = 8  # the assumed contention weighs as much as this many scored windows
REGIME_OVERRIDE_MARGIN = 0.15  # a bucket's own figures overrule what the other buckets imply only this far ahead


def load_bucket(sessions: int) -> int:
    """Live sessions on a replica in powers of two (1, 2, 3-4, 5-8, ...): regimes are judged per bucket."""
    return max(0, sessions - 1).bit_length()


def load_bucket_label(bucket: int) -> str:
    """A bucket as the session counts it holds: 0 -> "1", 1 -> "2", 2 -> "3-4", 3 -> "5-8"."""
    high = 1 << bucket
    low = high // 2 + 1 if bucket >= 2 else high
    return str(high) if low == high else f"{low}-{high}"


@dataclass
class _Window:
    """One regime window's tally: committed tokens of the steps decided in it (late commits
    included), and the sessions its decisions saw."""

    id: int
    on: bool
    start: float
    end: float = 0.0
    tokens: int = 0
    decisions: int = 0
    session_sum: int = 0
    max_sessions: int = 1
    exploring: bool = False  # it runs the regime that lost, to measure it again
    chosen_for: int = 0  # its regime's load bucket: the larger of the load then and the window before's
    disturbed: bool = False  # a burst of prefills ran in it: its figure says nothing of either regime
    switched: bool = False  # the window before ran the other regime: a warm-up, not scored

    def see(self, sessions: int) -> None:
        self.decisions += 1
        self.session_sum += sessions
        self.max_sessions = max(self.max_sessions, sessions)

    def per_session_rate(self) -> float | None:
        seconds = self.end - self.start
        if self.switched or self.disturbed or not self.tokens or not self.decisions or seconds <= 0:
            return None
        return self.tokens / seconds / (self.session_sum / self.decisions)


class SpeculationRegime:
    """Whether the load-aware requests on one target replica speculate at all, from measured
    goodput: the model (:func:`choose_k`) sees passes, not a CPU shared by draft, target and
    coordinator, so on/off is measured instead. Time runs in windows of ``window_seconds``; in
    each, every request on the replica follows one regime ("on": speculate, the model choosing
    how deep; "off": k = 0). A window's figure is the tokens committed by the steps decided in it
    (a step that ends after the window still counts, so long steps are not cut short), per second
    and per live session (so a bucket's windows with fewer sessions, as streams finish, compare
    fairly), kept per load bucket (EWMA); it is scored one window late, once its steps are in.
    One session is not judged at all: its windows run "on" and leave k to each request's own
    model (:attr:`requests_decide`).
    Windows that ran a burst of prefills (a quarter or more of the sessions starting) are not
    scored, nor is a window that follows one of the other regime: the steps a window decides run
    on past its end as those of the window before ran into it, which evens out only between
    windows of one regime (an "off" window after "on" decides its first steps only once the long
    blocks decided before it finish, and its figure comes out low). So a switch costs a warm-up
    window, and an exploration runs two windows. Each bucket starts in its prior
    (:meth:`_prior`: what the measured buckets imply, else the cost model's hint); a bucket the
    others settle does not explore (:meth:`_next_regime`); any other keeps the better measured
    regime, running the other after ``explore_every`` windows, that gap doubling (up to
    ``explore_max``) while the explorations confirm it, or after ``explore_far`` at once where the
    loser is far behind. One object per target replica in a coordinator, shared by its requests;
    ``clock`` injected for tests."""

    def __init__(
        self,
        window_seconds: float = REGIME_WINDOW_SECONDS,
        explore_every: int = REGIME_EXPLORE_EVERY,
        explore_max: int = REGIME_EXPLORE_MAX,
        clock=None,
        explore_first: int = REGIME_EXPLORE_FIRST,
        explore_far: int = REGIME_EXPLORE_FAR,
    ):
        import time

        if explore_every < 2 or explore_max < explore_every or explore_far < explore_max:
            raise ValueError(
                "need 2 <= explore_every <= explore_max <= explore_far,"
                f" got {explore_every}, {explore_max}, {explore_far}"
            )
        if not 1 <= explore_first <= explore_every:
            raise ValueError(f"need 1 <= explore_first <= explore_every, got {explore_first}, {explore_every}")
        self.window_seconds = window_seconds
        self.explore_first = explore_first
        self.explore_every = explore_every
        self.explore_max = explore_max
        self.explore_far = explore_far
        self.clock = clock or time.monotonic
        self.rates: dict[tuple[int, bool], float] = {}
        self.scored: dict[tuple[int, bool], int] = {}  # windows behind each figure (one where set directly)
        self._current = _Window(0, True, self.clock())
        self._closed: _Window | None = None  # the window before, still taking its late commits
        self._prefilling = 0
        self._requests = 0  # load-aware requests of this coordinator on the replica, prefills included
        self._since_explore: dict[int, int] = {}
        self._gap: dict[int, int] = {}
        # the cost model's gains of "on" over "off" at any load, as the latest request sees them
        self._model: Callable[[int], ModelGains] | None = None
        self._contention = 0.0  # the contention the latest request assumed before any is measured
        self._moved_at = -REGIME_SETTLE_WINDOWS  # the window the load last jumped up at: no exploring just after

    @property
    def window(self) -> int:
        return self._current.id

    @property
    def on(self) -> bool:
        return self._current.on

    @property
    def requests_decide(self) -> bool:
        """Whether the current window was chosen for one session: nothing is shared then (the
        lockstep and serial models agree), so the regime runs "on" and each request's own model
        decides how deep, 0 included (GoodputK), from its own acceptance -- what no window's
        figure could say better, as a lone stream's windows are too few and too noisy to tell
        two regimes 10-20% apart."""
        return self._current.chosen_for == 0

    def _score(self, closed: _Window) -> None:
        rate = closed.per_session_rate()
        if rate is None or closed.chosen_for == 0 or closed.max_sessions <= 1:
            return  # the requests decided its k; or a burst's tail, which says nothing of its regime
        key = (load_bucket(closed.max_sessions), closed.on)
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else old + REGIME_RATE * (rate - old)
        self.scored[key] = self.scored.get(key, 0) + 1

    def _implied(self, bucket: int) -> bool | None:
        """The regime the *other* buckets' measurements imply for ``bucket``, if they imply one:
        speculation pays less as the load grows (docs/goodput.md), so "off" measured better
        at a lighter load means off here, "on" measured better at a heavier one means on here.
        None where they say nothing, or contradict each other (noise: each bucket then decides
        by its own figures)."""
        both = [b for b, on in self.rates if on and b != bucket and (b, False) in self.rates]
        off = any(b < bucket and self.rates[(b, False)] > self.rates[(b, True)] for b in both)
        on = any(b > bucket and self.rates[(b, True)] >= self.rates[(b, False)] for b in both)
        return None if off == on else on

    def contention(self) -> float:
        """How far the machine is from the lockstep model towards the serial one (0: separate
        devices, as the profiles see them; 1: every session's passes taking turns on shared
        cores; up to ``MAX_CONTENTION``: worse still, their threads contending for the cores):
        what the requests assume (``SHARED_HARDWARE_CONTENTION`` where their draft and target
        share hardware, else 0, or the coordinator's --contention), refitted by every bucket past
        one session that measured both regimes (their measured gain of "on" over "off" against the
        model's two). Each bucket's fit weighs as many windows as the fewer of its two figures
        rests on, the assumption as many as ``REGIME_CONTENTION_PRIOR_WINDOWS``: one exploration's
        window is noise (a 32-session bucket's single "on" window once fitted 0 and flipped every
        lighter bucket's prior to "on"), a steady comparison is not. What no profile shows -- the
        draft's and the coordinator's work taking the target's cores -- so that an unvisited
        bucket's first regime is right."""
        fits: list[tuple[float, int]] = []
        for bucket in {b for b, _ in self.rates}:
            if bucket == 0 or (bucket, True) not in self.rates or (bucket, False) not in self.rates:
                continue  # one session: the two models agree, nothing to fit
            if self._model is None:
                break
            gains = self._model(1 << bucket)
            spread = 1.0 / max(1e-9, gains.serial) - 1.0 / max(1e-9, gains.lockstep)
            measured = self.rates[(bucket, True)] / max(1e-9, self.rates[(bucket, False)])
            if math.isfinite(spread) and abs(spread) > 1e-6:
                fit = min(MAX_CONTENTION, max(0.0, (1.0 / max(1e-9, measured) - 1.0 / gains.lockstep) / spread))
                fits.append((fit, min(self.scored.get((bucket, on), 1) for on in (True, False))))
        prior = REGIME_CONTENTION_PRIOR_WINDOWS
        return (prior * self._contention + sum(fit * n for fit, n in fits)) / (prior + sum(n for _, n in fits))

    def model_gain(self, bucket: int) -> float:
        """The cost model's gain of "on" over "off" at ``bucket``'s load (its largest session
        count), at the fitted :meth:`contention`; infinite before any request said."""
        if self._model is None:
            return math.inf
        return self._model(1 << bucket).blended(self.contention())

    def _prior(self, bucket: int) -> bool:
        """The regime a bucket starts in, before it has measured anything: what the measured
        buckets imply, else the cost model's expectation for this load (on where it has said
        nothing)."""
        if bucket == 0:
            return True  # one session: the requests decide (requests_decide)
        implied = self._implied(bucket)
        return self.model_gain(bucket) > 1.0 if implied is None else implied

    def _ruled_out(self, bucket: int, regime: bool) -> bool:
        """Whether the model expects ``regime`` to lose clearly at ``bucket``'s load."""
        gain = self.model_gain(bucket)
        if not math.isfinite(gain):  # no model: nothing ruled out
            return False
        return gain < REGIME_MODEL_CLEAR if regime else gain > 1.0 / REGIME_MODEL_CLEAR

    def _next_regime(self, bucket: int, window: int) -> tuple[bool, bool]:
        """The next window's regime, and whether it is an exploration. A bucket that the others'
        measurements settle (:meth:`_implied`) follows them without exploring, unless its own
        figures disagree clearly (:meth:`_measured_best`): only the buckets at the boundary
        between "on" and "off" pay for exploring, and a heavy load is never slowed by trying
        speculation again (each try there costs the most). Otherwise a bucket follows its prior
        until that regime has a figure, runs the other after ``explore_first`` scored windows
        (held until its own figure is in: with 1, the window deciding after the switch still sees
        one regime measured and explores on), then keeps the better measured one and runs the
        loser again after a gap of windows. A loser the model rules out clearly
        (:meth:`_ruled_out`) waits the far gap, first time included, and nothing explores in the
        first ``REGIME_SETTLE_WINDOWS`` windows after the load jumped up: a burst does not pay for
        measuring (after a fall, a light load measures cheaply, and its short requests cannot
        wait). ``window``: the id of the window being decided."""
        if bucket == 0:
            return True, False  # one session: the requests decide (requests_decide)
        known = {regime: self.rates[(bucket, regime)] for regime in (True, False) if (bucket, regime) in self.rates}
        implied = self._implied(bucket)
        if not known or (implied is not None and len(known) == 1):
            return self._prior(bucket), False
        if len(known) == 1:
            best, gap = next(iter(known)), self.explore_first
        else:
            best, gap = self._measured_best(bucket, implied), self._explore_gap(bucket, known)
            if implied == best:
                return best, False
        if self._ruled_out(bucket, not best):
            gap = max(gap, self.explore_far)
        since = self._since_explore[bucket] = self._since_explore.get(bucket, 0) + 1
        if since < gap or window - self._moved_at < REGIME_SETTLE_WINDOWS:
            return best, False
        self._since_explore[bucket] = 0
        return not best, True

    def _measured_best(self, bucket: int, implied: bool | None) -> bool:
        """The better regime of a bucket that measured both: the implied one (:meth:`_implied`)
        unless its own figures put the other ahead by ``REGIME_OVERRIDE_MARGIN`` -- a bucket
        visited only in a wave's tail measures few windows of a changing load, and a lead that
        small there is noise against what the lighter and heavier loads measured."""
        on, off = self.rates[(bucket, True)], self.rates[(bucket, False)]
        if implied is None:
            return on >= off
        leader, other = (on, off) if not implied else (off, on)
        return implied if leader < (1.0 + REGIME_OVERRIDE_MARGIN) * other else not implied

    def _explore_gap(self, bucket: int, known: dict[bool, float]) -> int:
        """Windows between explorations of a measured loser: the doubling gap, or at once a far
        longer one where the loser is far behind -- a load that steady is not about to flip, and
        each exploration costs two windows in the slow regime plus a warm-up back, a loss of
        about twice the margin over the gap."""
        slow, fast = sorted(known.values())
        if fast >= (1.0 + REGIME_CLEAR_MARGIN) * slow:
            return self.explore_far
        return self._gap.get(bucket, self.explore_every)

    def _after_exploring(self, bucket: int, best_before: bool) -> None:
        """An exploration that confirms the better regime doubles the wait for the next."""
        best_now = self.rates[(bucket, True)] >= self.rates[(bucket, False)]
        gap = self._gap.get(bucket, self.explore_every)
        self._gap[bucket] = min(2 * gap, self.explore_max) if best_now == best_before else self.explore_every

    def _roll(self, sessions: int, jumped: bool = False) -> None:
        """Close the current window once it has run its length (or at once where the load
        ``jumped`` to a bucket whose regime differs: its figure, of two loads, is not scored)
        and open the next."""
        now = self.clock()
        current = self._current
        if now - current.start < self.window_seconds and not jumped:
            return
        current.end = now
        current.disturbed |= jumped
        # Windows roll when a step decides: one that outlived two lengths saw the replica go quiet
        # (between requests, or only other policies' requests running), and its figure would count
        # the quiet time as the regime's; nor does its load say anything of the load coming now.
        quiet = now - current.start > 2 * self.window_seconds
        current.disturbed |= quiet
        if self._closed is not None:
            closed = self._closed
            bucket = load_bucket(closed.max_sessions)
            had_both = (bucket, True) in self.rates and (bucket, False) in self.rates
            before = had_both and self.rates[(bucket, True)] >= self.rates[(bucket, False)]
            self._score(closed)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s", self._describe(closed))
            # An exploration informs the bucket that chose it only if the load stayed in it (it
            # may have fallen between windows, and the figure gone to a bucket measuring one
            # regime); the first one, which measures the second regime at all, confirms nothing.
            explored = closed.exploring and bucket == closed.chosen_for and closed.per_session_rate() is not None
            if explored and had_both:
                self._after_exploring(bucket, before)
        if current.exploring and current.switched and not jumped:
            # an exploration's first window only warms up (it is not scored): run it once more
            on, exploring, chosen_for = current.on, True, current.chosen_for
        else:
            # for the load now as well as the window's: a burst of arrivals is decided for itself
            chosen_for = load_bucket(sessions if quiet else max(sessions, current.max_sessions))
            if chosen_for - current.chosen_for >= 2:  # the load jumped up 4x or more: a burst
                self._moved_at = current.id + 1
            on, exploring = self._next_regime(chosen_for, current.id + 1)
        switched = on != current.on and not quiet  # after a quiet spell nothing is in flight to warm up
        nxt = _Window(current.id + 1, on, now, exploring=exploring, chosen_for=chosen_for, switched=switched)
        nxt.disturbed = self._burst(current.max_sessions)
        self._closed, self._current = current, nxt

    def _describe(self, closed: _Window) -> str:
        """One scored window and the table it left, for SPECDEC_LOG_LEVEL=DEBUG: how a replica's
        regime is decided is otherwise invisible (the metrics show only its outcome)."""
        rate = closed.per_session_rate()
        why = "warm-up" if closed.switched else "disturbed" if closed.disturbed else "no tokens" if rate is None else ""
        figure = f"{rate:.1f} tokens/s per session" if rate is not None else f"not scored ({why})"
        table = ", ".join(
            f"{load_bucket_label(b)}:{'on' if on else 'off'}={r:.1f}" for (b, on), r in sorted(self.rates.items())
        )
        buckets = sorted({b for b, _ in self.rates} | {load_bucket(closed.max_sessions)})
        gains = ", ".join(f"{load_bucket_label(b)}:{g:.2f}" for b in buckets if math.isfinite(g := self.model_gain(b)))
        return (
            f"regime window {closed.id}: {'on' if closed.on else 'off'}{' (exploring)' if closed.exploring else ''}"
            f" at {load_bucket_label(load_bucket(closed.max_sessions))} sessions (up to {closed.max_sessions} in"
            f" {closed.decisions} steps), {closed.tokens} tokens in {closed.end - closed.start:.2f} s: {figure};"
            f" measured [{table}]; model's on/off [{gains}] at contention {self.contention():.2f}"
        )

    def _jumps(self, sessions: int) -> bool:
        """Whether the load rose past the bucket the current window was chosen for, to one that
        runs the other regime: a burst is decided for at its first step, not a window later."""
        current = self._current
        bucket = load_bucket(sessions)
        if (current.id == 0 and not current.decisions) or bucket <= max(
            current.chosen_for, load_bucket(current.max_sessions)
        ):
            return False
        both = (bucket, True) in self.rates and (bucket, False) in self.rates
        coming = self._measured_best(bucket, self._implied(bucket)) if both else self._prior(bucket)
        return coming != current.on

    def _burst(self, sessions: int) -> bool:
        return self._prefilling > 0 and 4 * self._prefilling >= sessions

    def speculating(
        self,
        sessions: int,
        model_gain: float = math.inf,
        gains: Callable[[int], ModelGains] | None = None,
        contention: float = 0.0,
    ) -> tuple[bool, int]:
        """The regime now, and the window it belongs to (a step reports its tokens with it).
        ``gains``: the request's cost model at any number of sessions (else ``model_gain`` at
        every load): what it expects of speculating over not (above 1: "on" pays; a bucket's
        prior until it has measured). ``contention``: what the request assumes of the machine
        before any is measured (1 where its draft and target share their hardware, else 0)."""
        # The replica's report lags a burst of arrivals (they report nothing before their first
        # step), while this coordinator's own requests on it are counted as they come.
        sessions = max(sessions, self._requests)
        self._model = gains or (lambda _sessions: ModelGains(model_gain, model_gain))
        self._contention = contention
        self._roll(sessions, jumped=self._jumps(sessions))
        if self._current.id == 0 and not self._current.decisions:  # the very first window
            self._current.chosen_for = load_bucket(sessions)
            self._current.on = self._prior(self._current.chosen_for)
        self._current.see(sessions)
        return self._current.on, self._current.id

    def committed(self, window: int, tokens: int) -> None:
        """A step decided in ``window`` committed ``tokens`` (counted in that window, late or not)."""
        for tally in (self._current, self._closed):
            if tally is not None and tally.id == window:
                tally.tokens += tokens

    def prefill_started(self) -> None:
        """A request on the replica starts its prefill: a burst of them spoils a window's figure."""
        self._prefilling += 1
        if self._burst(self._current.max_sessions):
            self._current.disturbed = True

    def prefill_finished(self) -> None:
        self._prefilling = max(0, self._prefilling - 1)

    def request_started(self) -> None:
        """A load-aware request of this coordinator joins the replica (before its prefill)."""
        self._requests += 1

    def request_finished(self) -> None:
        self._requests = max(0, self._requests - 1)
