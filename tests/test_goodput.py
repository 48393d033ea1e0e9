"""The load-aware policy as pure functions: cost curves, acceptance estimates, the choice of k."""

from __future__ import annotations

import logging

import pytest

from specdec.loop.load_aware_k import (
    IDLE,
    BatchLoad,
    CostCurve,
    Costs,
    GoodputK,
    PositionAcceptance,
    choose_k,
    load_bucket,
)

# A memory-bound pass (rows nearly free up to 8, then compute: the 2-core CPU's shape) and a
# compute-bound one (every row costs the same), in seconds.
FLAT = CostCurve([(1, 0.040), (2, 0.041), (4, 0.042), (8, 0.045), (16, 0.090), (32, 0.180)])
LINEAR = CostCurve([(1, 0.010), (8, 0.080), (32, 0.320)])
FIXED_PLUS_ROWS = CostCurve([(1, 0.030), (8, 0.100)])  # 20 ms per pass + 10 ms per row
DRAFT = CostCurve([(1, 0.003), (8, 0.006), (32, 0.020)])


def expected(rate: float, k_max: int) -> list[float]:
    out, run = [1.0], 1.0
    for _ in range(k_max):
        run *= rate
        out.append(out[-1] + run)
    return out


CASES = [
    # (name, acceptance per position, load, target curve, k chosen must satisfy)
    ("alone, cheap rows, high acceptance: speculate deep", 0.9, IDLE, FLAT, lambda k: k == 4),
    ("alone, cheap rows, low acceptance: a short block", 0.3, IDLE, FLAT, lambda k: 1 <= k <= 2),
    ("alone, cheap rows, no acceptance: none", 0.0, IDLE, FLAT, lambda k: k == 0),
    ("alone, every row costs, middling acceptance: none", 0.5, IDLE, LINEAR, lambda k: k == 0),
    ("alone, rows cost only what they cost: never, even if always right", 0.98, IDLE, LINEAR, lambda k: k == 0),
    ("alone, a fixed cost per pass to share, near-certain acceptance", 0.98, IDLE, FIXED_PLUS_ROWS, lambda k: k >= 3),
    (
        "a full batch on the memory-bound curve (past its knee): none",
        0.6,
        BatchLoad(other_rows=15, other_sessions=15, other_drafting=0, other_live=15),
        FLAT,
        lambda k: k == 0,
    ),
    (
        "a light batch still under the knee: speculate",
        0.7,
        BatchLoad(other_rows=2, other_sessions=2, other_live=2),
        FLAT,
        lambda k: k >= 2,
    ),
]


@pytest.mark.parametrize("name, rate, load, curve, ok", CASES, ids=[c[0] for c in CASES])
def test_choice_of_k(name, rate, load, curve, ok):
    k = choose_k(expected(rate, 4), load, Costs(curve, DRAFT))
    assert ok(k), (name, k)


def test_the_choice_is_a_function_of_its_inputs_only():
    load = BatchLoad(other_rows=5, other_sessions=3, other_drafting=2, other_live=3, cycle_seconds=0.07, last_k=2)
    costs = Costs(FLAT, DRAFT)
    picks = {choose_k(expected(0.55, 4), load, costs) for _ in range(20)}
    assert len(picks) == 1


def test_speculation_turns_off_as_load_rises_and_back_on_as_it_falls():
    costs = Costs(FLAT, DRAFT)
    ks = []
    for others in [0, 1, 3, 7, 15, 31, 15, 7, 3, 1, 0]:
        load = BatchLoad(other_rows=others, other_sessions=others, other_live=others)
        ks.append(choose_k(expected(0.6, 4), load, costs))
    assert ks[0] > 0 and ks[-1] > 0  # alone it pays
    assert ks[5] == 0  # 31 others: every row is compute
    assert ks == ks[::-1]  # the same load gives the same k, whichever way it came


def test_a_measured_cycle_counts_what_the_model_does_not_see():
    # The same pass costs, but the step took far longer than its passes (others' draft passes,
    # round trips): the extra rows' share of the cycle is small, so blocks pay more easily.
    costs = Costs(LINEAR, DRAFT)
    modelled = choose_k(expected(0.8, 4), BatchLoad(last_k=0), costs)
    measured = choose_k(expected(0.8, 4), BatchLoad(last_k=0, cycle_seconds=1.0), costs)
    assert modelled == 0 and measured > 0


def test_cost_curve_interpolates_extends_and_follows_observations():
    curve = CostCurve([(1, 1.0), (4, 2.0), (8, 4.0)])
    assert curve.seconds(0) == 0.0
    assert curve.seconds(1) == curve.seconds(0.5) == 1.0
    assert curve.seconds(2) == pytest.approx(1.0 + 1.0 / 3)
    assert curve.seconds(16) == pytest.approx(8.0)  # the last segment's slope
    for _ in range(50):
        curve.observe(8, 8.0)  # the machine is twice as slow at 8 rows as profiled
    assert curve.seconds(8) == pytest.approx(8.0, rel=0.01)
    assert curve.seconds(1) <= curve.seconds(4) <= curve.seconds(8)  # still non-decreasing
    curve.observe(4, 0.0)  # nonsense is ignored
    curve.observe(0, 5.0)
    assert curve.seconds(8) == pytest.approx(8.0, rel=0.01)
    with pytest.raises(ValueError):
        CostCurve([])
    with pytest.raises(ValueError):
        CostCurve([(0, 1.0)])
    with pytest.raises(ValueError):
        CostCurve([(2, 1.0), (2, 3.0)])


def test_position_acceptance_counts_reached_positions_only():
    acc = PositionAcceptance(3, decay=1.0, prior=0.5)
    acc.observe(3, 1)  # accepted position 1, rejected position 2, never reached 3
    acc.observe(3, 3)
    assert acc.rates() == pytest.approx([(0.5 + 2) / 3, (0.5 + 1) / 3, (0.5 + 1) / 2])
    tokens = acc.expected_tokens()
    assert tokens[0] == 1.0 and tokens == sorted(tokens) and len(tokens) == 4


def test_goodput_policy_probes_only_when_its_own_blocks_do_not_pay():
    costs = Costs(FLAT, DRAFT)
    policy = GoodputK(4, costs, max_probe_gap=4)
    assert policy.next_k() > 0  # optimistic start
    for _ in range(30):
        k = policy.next_k()
        policy.observe(k, 0)  # the draft is never right
    ks = []
    for _ in range(40):
        k = policy.next_k()
        ks.append(k)
        policy.observe(k, 0)
    assert 0 < sum(1 for k in ks if k) <= 40 // 4 + 1  # probes, at most every max_probe_gap steps

    loaded = GoodputK(4, costs)
    loaded.observe_load(BatchLoad(other_rows=31, other_sessions=31, other_live=31))
    ks = []
    for _ in range(40):
        k = loaded.next_k()
        ks.append(k)
        loaded.observe(k, k)  # (any block would be accepted, but none is proposed)
    assert ks == [0] * 40  # under load: no probes
    loaded.observe_load(IDLE)
    assert loaded.next_k() > 0  # the load fell: it speculates again


def test_with_one_session_the_regime_leaves_k_to_the_requests_own_model():
    """A lone stream's regime runs "on" without judging: the request's own model chooses k, 0
    included -- a draft that is never right stops being asked, save for probes (whose verdicts
    it learns from), and one that is always right keeps being asked -- whatever the regime's
    windows would show."""
    regime, now = _regime_clock()
    bad, good = (
        GoodputK(4, Costs(FLAT, DRAFT), max_probe_gap=4, regime=regime),
        GoodputK(4, Costs(FLAT, DRAFT), regime=regime),
    )
    ks: dict[str, list[int]] = {"bad": [], "good": []}
    for step in range(80):
        for name, policy in (("bad", bad), ("good", good)):
            k = policy.next_k()
            assert regime.requests_decide and policy.deciding
            policy.observe(k, 0 if name == "bad" else k)
            if step >= 40:
                ks[name].append(k)
        now[0] += 1
    assert 0 < sum(1 for k in ks["bad"] if k) <= 40 // 4 + 1  # probes only
    assert bad.acceptance.rates()[0] < 0.2  # learnt from them
    assert all(k > 0 for k in ks["good"])
    assert not regime.rates  # nothing scored for one session


def test_replay_rebuilds_an_estimate_from_step_lengths():
    costs = Costs(FLAT, DRAFT)
    fresh, replayed = GoodputK(4, costs), GoodputK(4, costs)
    replayed.replay([5, 5, 5, 1, 5])
    assert replayed.acceptance.rates()[3] > fresh.acceptance.rates()[3]


def test_the_startup_profile_measures_every_size_leaves_nothing_and_is_kept(tmp_path, monkeypatch):
    from specdec.engine import profile
    from specdec.modeling.tiny import tiny_llama

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    from specdec.engine.draft import DraftEngine
    from specdec.engine.target import TargetEngine

    model = tiny_llama(32, seed=5, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    draft_points = profile.pass_costs(DraftEngine(model), 4)
    assert [n for n, _ in draft_points] == [1, 2, 4] and all(t > 0 for _, t in draft_points)
    from specdec.engine.sessions import CacheLimits

    engine = TargetEngine(model, CacheLimits(prefix_cache_bytes=1 << 26))
    store = engine.store
    kept = store.prefixes
    points = profile.pass_costs(engine, 8)
    assert [n for n, _ in points] == [1, 2, 4, 8] and all(t > 0 for _, t in points)
    assert len(store) == 0 and store.sessions_started == 0  # scratch sessions are gone, uncounted
    assert store.prefixes is kept  # and they left the prefix cache as it was: empty, nothing looked up
    if kept is not None:
        assert kept.nbytes == 0 and kept.stats()["prefix_cache_queried_tokens"] == 0
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2  # one per engine kind
    monkeypatch.setattr(profile, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert profile.pass_costs(engine, 8) == points  # the next start reads it back
    assert profile.profile_sizes(6) == [1, 2, 4, 6] and profile.profile_sizes(1000)[-1] == 64


def test_pass_reports_and_profiles_round_trip_the_wire():
    from specdec.engine.batching import PassLoad
    from specdec.runtime import wire
    from specdec.v1 import engine_pb2

    load = PassLoad(size=7, sessions=3, seconds=0.012, live_sessions=5)
    assert wire.pass_load_from_proto(wire.pass_load_to_proto(load)) == load
    assert wire.pass_load_from_proto(engine_pb2.PassLoad()) is None  # a replica that does not batch
    info = engine_pb2.EngineInfo(cost_sizes=[1, 4], cost_seconds=[0.01, 0.02])
    curve = wire.cost_curve_from_info(info)
    assert curve is not None and curve.points == [(1, 0.01), (4, 0.02)]
    assert wire.cost_curve_from_info(engine_pb2.EngineInfo()) is None
    assert wire.cost_curve_from_info(engine_pb2.EngineInfo(cost_sizes=[1, 2], cost_seconds=[0.1])) is None


def _regime_clock(window_seconds=1.0, **kw):
    from specdec.loop.load_aware_k import SpeculationRegime

    now = [0]  # tenths of a second (exact)
    return SpeculationRegime(window_seconds=window_seconds, clock=lambda: now[0] / 10, **kw), now


def _run_windows(regime, now, n, sessions, truth) -> list[bool]:
    """``n`` windows of 10 decisions by ``sessions`` sessions, each step committing what ``truth``
    says its regime earns (tokens per second per session); the regime of each window."""
    seen = []
    for _ in range(n):
        for _ in range(10):
            on, window = regime.speculating(sessions)
            regime.committed(window, truth[on] * sessions // 10)
            now[0] += 1
        seen.append(on)
    return seen


def test_the_regime_measures_both_keeps_the_better_and_explores_the_other_ever_less_often():
    regime, now = _regime_clock(explore_every=5, explore_max=20)
    truth = {True: 42, False: 50}  # tokens per second per session the replica commits in each regime

    def windows(n, sessions=8):
        return _run_windows(regime, now, n, sessions, truth)

    seen = windows(60)
    # the prior ("on": no model hint) until its first window is scored (a window late: its late
    # commits), then "off", held until its own figure is in (the first window after a switch is a
    # warm-up, not scored), then the better
    assert seen[:7] == [True, True, False, False, False, False, False]
    explorations = [i for i in range(7, 60) if seen[i]]
    # two windows each (a warm-up, a scored one), the gap doubling from 5 to 10, then 20 (at most)
    assert explorations == [14, 15, 35, 36, 56, 57]
    truth[True] = 90  # the load changed what pays: the next exploration finds it and "on" takes over
    later = windows(60)
    assert not any(later[:17]) and later[17:19] == [True, True] and later[-10:].count(True) >= 8


def test_each_scored_window_is_logged_at_debug(caplog):
    """SPECDEC_LOG_LEVEL=DEBUG shows how the regime decides: a line per window as it is scored,
    with its figure (or why it has none) and the table of measured figures per load bucket."""
    regime, now = _regime_clock()
    with caplog.at_level(logging.DEBUG, logger="specdec.loop.load_aware_k"):
        _run_windows(regime, now, 5, 6, {True: 42, False: 50})
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.loop.load_aware_k"]
    assert len(lines) == 3  # windows 0, 1, 2 scored as windows 2, 3, 4 open (a window late)
    # 6 sessions commit 42 * 6 // 10 = 25 tokens a step: 250 in the window's second, 41.7 per session
    assert lines[0] == (
        "regime window 0: on at 5-8 sessions (up to 6 in 10 steps), 250 tokens in 1.00 s:"
        " 41.7 tokens/s per session; measured [5-8:on=41.7]; model's on/off [] at contention 0.00"
    )
    assert (
        lines[2].startswith("regime window 2: off (exploring) at 5-8 sessions") and "not scored (warm-up)" in lines[2]
    )
    # the cost model's expected gain of "on" per bucket (measured or scored), as the latest
    # request's model gives it, and the contention it is blended at (load_aware_k.ModelGains)
    from specdec.loop.load_aware_k import ModelGains

    def gains(sessions: int) -> ModelGains:
        return ModelGains(1.25, 0.5) if sessions > 2 else ModelGains(0.8, 0.8)

    now[0] += 10
    with caplog.at_level(logging.DEBUG, logger="specdec.loop.load_aware_k"):
        regime.speculating(6, gains=gains, contention=0.0)
    # 5-8 measured both (41.7 on, 50.0 off: 0.83x), fitting contention 0.33 (1/0.83 = 0.67/1.25 +
    # 0.33/0.5), one window each: against the assumed 0's eight windows, (8 * 0 + 0.33) / 9
    assert caplog.records[-1].getMessage().endswith("; model's on/off [5-8:1.18] at contention 0.04")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specdec.loop.load_aware_k"):
        _run_windows(regime, now, 2, 6, {True: 42, False: 50})
    assert not caplog.records


def test_a_loser_far_behind_is_explored_only_every_explore_far_windows():
    """A regime that loses by 30% or more is not about to win at a steady load: it is explored after
    the far gap at once rather than after the doubling ones (each exploration costs two
    windows in it and a warm-up back); a change of load is still found, only later."""
    regime, now = _regime_clock(explore_every=5, explore_max=10, explore_far=20)
    truth = {True: 30, False: 50}
    seen = _run_windows(regime, now, 60, 8, truth)
    assert seen[:7] == [True, True, False, False, False, False, False]  # the first comparison as before
    assert [i for i in range(7, 60) if seen[i]] == [24, 25, 45, 46]  # then every 20 windows
    truth[True] = 90
    later = _run_windows(regime, now, 60, 8, truth)
    assert not any(later[:6]) and later[-10:].count(True) >= 8


def test_only_the_buckets_at_the_boundary_explore():
    """Once "off" measured better at 2 sessions, every heavier load is settled: those buckets never try
    speculation again (a try costs the most there), whatever their own windows would show; the
    boundary bucket (2 sessions) goes on exploring, and one session is never judged (it runs "on",
    each request's own model choosing k). A bucket whose own figures contradict what the others
    imply clearly explores as before; one whose own lead is within the noise follows them."""

    def run(sessions, truth, measured, n=60):
        regime, now = _regime_clock(explore_every=5, explore_max=10)
        regime.rates.update(measured)
        return _run_windows(regime, now, n, sessions, truth)

    settled = {(load_bucket(1), True): 60.0, (load_bucket(1), False): 50.0}
    settled |= {(load_bucket(2), True): 40.0, (load_bucket(2), False): 50.0}
    for sessions in (3, 8, 32):
        assert not any(run(sessions, {True: 30, False: 50}, settled))  # off, never explored
        assert not any(run(sessions, {True: 90, False: 50}, settled))  # settled by the lighter load
    # the boundary explores, two windows at a time, in at most a quarter of the windows
    assert 4 <= run(2, {True: 40, False: 50}, settled).count(True) <= 15
    assert all(run(1, {True: 50, False: 60}, settled))  # whatever its windows would show
    contradicting = settled | {(load_bucket(8), True): 60.0, (load_bucket(8), False): 50.0}
    assert any(run(8, {True: 30, False: 50}, contradicting))  # its own figures disagree: explores
    assert run(8, {True: 30, False: 50}, contradicting)[-10:].count(False) >= 8  # and finds off
    # "on" 14% ahead in a bucket the lighter loads settle "off": within REGIME_OVERRIDE_MARGIN,
    # noise (a wave's tail measured it), so it runs off and never explores
    slightly = settled | {(load_bucket(8), True): 57.0, (load_bucket(8), False): 50.0}
    assert not any(run(8, {True: 30, False: 50}, slightly))
    # a burst into that bucket is decided for "off" at its first step, as the settled buckets
    regime, _ = _regime_clock(explore_every=5, explore_max=10)
    regime.rates.update(slightly)
    assert regime.speculating(1)[0] and not regime.speculating(8)[0]


def test_a_bucket_starts_in_what_the_model_or_the_measured_loads_imply():
    """Before a bucket has measured: the regime a lighter load measured to lose stays lost at a
    heavier one ("off" at 3-4 sessions -> off at 5-8), one a heavier load measured to win still
    wins at a lighter one, and otherwise the cost model's hint decides."""

    def first_regimes(hints, measured=None):
        regime, now = _regime_clock()
        if measured:
            regime.rates.update(measured)
        seen = []
        for sessions, hint in hints:  # the model's gain of "on" over "off": 1.3 (pays) or 0.8
            seen.append(regime.speculating(sessions, model_gain=1.3 if hint else 0.8)[0])
            now[0] += 10  # every call a window of its own
        return seen

    assert first_regimes([(8, False), (8, False)]) == [False, False]  # the model says off: off first
    assert first_regimes([(8, True), (8, True)]) == [True, True]
    off_at_4 = {(load_bucket(4), True): 10.0, (load_bucket(4), False): 12.0}
    assert first_regimes([(8, True), (8, True)], off_at_4) == [False, False]
    assert first_regimes([(2, False), (2, False)], off_at_4) == [False, False]  # nothing said for 2: the hint
    on_at_16 = {(load_bucket(16), True): 12.0, (load_bucket(16), False): 10.0}
    assert first_regimes([(8, False), (8, False)], on_at_16) == [True, True]


def test_an_exploration_whose_window_lands_in_another_load_bucket_breaks_nothing():
    """The load may fall between windows: a window's regime is chosen for the load the window
    before saw (8 sessions), but its figure is scored in the bucket of the load it sees itself
    (2), which may have measured only one regime. That exploration says nothing about the bucket
    that chose it, and the regime goes on deciding (CI once saw every request after such a
    window fail on a KeyError)."""
    rate = {True: 30, False: 50}
    landed_elsewhere = 0
    for windows_at_eight in range(12):  # the drop to 2 sessions comes after 0, 1, ... 11 windows
        regime, now = _regime_clock(explore_every=2, explore_max=4)
        for sessions in [8] * windows_at_eight + [2, 2, 8, 2, 8, 8]:
            for call in range(10):
                on, window = regime.speculating(sessions)
                if call == 0 and regime._current.exploring and sessions == 2:
                    landed_elsewhere += 1
                regime.committed(window, rate[on] * sessions // 10)
                now[0] += 1
        assert regime.rates and regime.speculating(8)[1] > 0  # it measured, and goes on deciding
    assert landed_elsewhere >= 2  # the case happened (at each of the first explorations)


def test_a_window_the_replica_went_quiet_in_is_not_scored_and_a_burst_decides_for_its_own_load():
    """Windows roll when a step decides. One that spans a quiet spell (no step for seconds: between
    requests) would score the quiet time as its regime's: it is not scored. And the window that
    opens a burst of arrivals is chosen for the burst's load, not for the quiet window's lone
    session (every arrival's first step would otherwise speculate, each prefilling the draft)."""
    regime, now = _regime_clock(explore_every=5, explore_max=10)
    measured = {(load_bucket(2), True): 40.0, (load_bucket(2), False): 30.0}
    measured |= {(load_bucket(4), True): 20.0, (load_bucket(4), False): 30.0}  # off from 3 sessions on
    regime.rates.update(measured)
    _run_windows(regime, now, 3, 2, {True: 40, False: 30})  # two streams, "on"
    assert regime.on
    before = regime.rates[(load_bucket(2), True)]
    regime.committed(regime.window, 1)  # its last window: one step, then nothing for 5 s
    now[0] += 50
    on, _ = regime.speculating(16)  # sixteen arrive
    assert not on
    now[0] += 10
    regime.speculating(16)  # scores the quiet window: not at all
    assert regime.rates[(load_bucket(2), True)] == pytest.approx(before)


def test_a_burst_is_seen_by_the_coordinators_own_count_before_the_replica_reports_it():
    """Arrivals report nothing before their first step, so the first decisions of a burst see the
    replica's last report (one session); the regime counts its coordinator's requests as they
    join, and decides for them."""
    regime, now = _regime_clock(explore_every=5, explore_max=10)
    regime.rates.update({(load_bucket(1), True): 40.0, (load_bucket(1), False): 30.0})
    regime.rates.update({(load_bucket(2), True): 20.0, (load_bucket(2), False): 30.0})
    regime.request_started()
    _run_windows(regime, now, 3, 1, {True: 40, False: 30})
    assert regime.on
    for _ in range(8):
        regime.request_started()
    now[0] += 10
    assert regime.speculating(1)[0] is False  # the report still says 1; nine are on the replica
    for _ in range(9):
        regime.request_finished()
    for _ in range(2):  # the window after the burst is chosen for the burst's load too; then its own
        now[0] += 10
        on, _ = regime.speculating(1)
    assert on


def test_the_regime_counts_late_commits_per_session_and_skips_prefill_bursts():
    def scored(sessions_seen, tokens, late=0, prefills=0):
        """One window (1 s) whose decisions saw ``sessions_seen``; its figure once scored."""
        regime, now = _regime_clock()
        windows = {regime.speculating(n)[1] for n in sessions_seen}
        for _ in range(prefills):
            regime.prefill_started()
        regime.committed(windows.pop(), tokens)
        now[0] += 10
        regime.speculating(sessions_seen[-1])  # the next window
        regime.committed(0, late)  # a step decided in window 0 that ended after it
        now[0] += 10
        regime.speculating(sessions_seen[-1])  # scores window 0
        return regime.rates

    bucket = load_bucket(8)
    assert scored([8, 8], 16, late=8) == {(bucket, True): pytest.approx(3.0)}  # 24 tokens / 1 s / 8 sessions
    # sessions finishing inside the window: per mean session seen (6), not per the most (8)
    assert scored([8, 8, 4, 4], 60) == {(bucket, True): pytest.approx(10.0)}
    assert scored([8, 8], 100, prefills=2) == {}  # a quarter of the sessions starting at once: not scored
    assert scored([8, 8], 100, prefills=1) != {}  # one start among eight: scored
    assert scored([8], 0) == {}  # nothing committed: nothing said
    with pytest.raises(ValueError, match="explore_every"):
        _regime_clock(explore_every=1)
    with pytest.raises(ValueError, match="explore_first"):
        _regime_clock(explore_first=0)
    with pytest.raises(ValueError, match="explore_far"):
        _regime_clock(explore_every=5, explore_max=20, explore_far=10)


def test_a_load_aware_run_starts_its_draft_session_only_when_it_first_speculates():
    """Under a regime that says off, the draft never prefills (its CPU is the target's on a
    shared machine); once it says on, the draft starts late from the committed tokens and the
    greedy output is still the target's own."""
    import asyncio

    from specdec.engine.draft import DraftEngine
    from specdec.engine.target import TargetEngine
    from specdec.exact.sampling import SamplingParams
    from specdec.loop.generate import LocalDraft, LocalTarget, SpeculativeRun
    from specdec.modeling.tiny import tiny_llama

    target_model = tiny_llama(48, seed=1, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    draft_engine = DraftEngine(tiny_llama(48, seed=2, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1))

    class Regime:  # off for the first `off_steps` decisions, then on
        requests_decide = False  # (it decides every step itself)

        def __init__(self, off_steps):
            self.left = off_steps

        def speculating(self, sessions, **model):
            self.left -= 1
            return self.left < 0, 0

        def committed(self, window, tokens):
            pass

        prefills = 0  # prefills under way now (the target's, then a late draft start's)
        prefills_seen: list[int] = []  # noqa: RUF012 - one per regime, replaced in __init__ below

        def prefill_started(self):
            self.prefills += 1
            self.prefills_seen.append(self.prefills)

        def prefill_finished(self):
            self.prefills -= 1

        request_started = request_finished = lambda self: None

    class Target(LocalTarget):
        def __init__(self, engine, regime):
            super().__init__(engine)
            self.regime = regime

        async def cost_curve(self):
            return CostCurve(((1, 0.01), (8, 0.012)))

    class CountingDraft(LocalDraft):
        def __init__(self, engine):
            super().__init__(engine)
            self.starts: list[int] = []

        async def start(self, session_id, prompt, params, features=None):
            self.starts.append(len(prompt))
            await super().start(session_id, prompt, params, features)

    prompt = [3, 7, 11, 5]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)

    regimes: list = []

    def run(off_steps):
        draft = CountingDraft(draft_engine)
        target = TargetEngine(target_model)
        regimes.append(Regime(off_steps))
        regimes[-1].prefills_seen = []
        loop = SpeculativeRun(Target(target, regimes[-1]), draft, prompt, params, 2, adaptive=True, load_aware=True)

        async def go():
            async for _ in loop.steps():
                pass

        asyncio.run(go())
        assert len(target.store) == 0 and len(draft_engine.store) == 0  # both freed
        return loop.result(), draft.starts

    never, starts = run(off_steps=100)
    assert starts == [] and never.stats.drafts == 0
    late, starts = run(off_steps=3)
    assert starts == [len(prompt) + 3]  # after three one-token target-only steps
    # the late start is a prefill to the regime too (a window it lands in is not scored)
    assert regimes[-1].prefills_seen == [1, 1] and regimes[-1].prefills == 0
    assert late.stats.drafts > 0 and late.token_ids == never.token_ids  # greedy: the target's own

    # the first decision is for the load the request joins, as the replica last reported it
    seen: list[int] = []

    class Recording(Regime):
        def speculating(self, sessions, **model):
            seen.append(sessions)
            return super().speculating(sessions, **model)

    for reported, first in ((0, 1), (1, 1), (9, 9)):
        seen.clear()
        busy = Target(TargetEngine(target_model), Recording(100))
        busy.last_live_sessions = reported  # what the replica's latest answer to any session said
        loop = SpeculativeRun(busy, CountingDraft(draft_engine), prompt, params, 2, adaptive=True, load_aware=True)

        async def drain(run):
            async for _ in run.steps():
                pass

        asyncio.run(drain(loop))
        assert seen[0] == first  # (a local target reports no passes: later steps see it alone)


def test_a_cost_curve_refuses_nan_and_inf_and_a_report_of_them_moves_nothing():
    """A replica reporting NaN or inf pass times (a bug, a forged report) used to make the policy
    pick the largest k (issue 42, item 7): such a profile is no profile, such a pass no evidence."""
    from specdec.runtime import wire
    from specdec.v1 import engine_pb2

    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="finite"):
            CostCurve([(1, 0.01), (4, bad)])
        info = engine_pb2.EngineInfo(cost_sizes=[1, 4], cost_seconds=[0.01, bad])
        assert wire.cost_curve_from_info(info) is None
        assert wire.pass_load_from_proto(engine_pb2.PassLoad(size=4, sessions=2, seconds=bad, live_sessions=2)) is None
    curve = CostCurve([(1, 0.01), (4, 0.02)])
    for bad in (float("nan"), float("inf")):
        curve.observe(4, bad)
    assert curve.points == [(1, 0.01), (4, 0.02)]


# -- a burst on a fresh or idle server (issue 50) ------------------------------------------------
def test_the_serial_model_is_the_lockstep_one_for_one_session_and_dearer_for_many():
    from specdec.loop.load_aware_k import CostCurve, Costs, ModelGains, model_gains, serial_seconds

    flat = Costs(CostCurve([(1, 0.030), (8, 0.032), (64, 0.080)]), CostCurve([(1, 0.004), (16, 0.006)]), 0.002)
    expected = [1.0, 1.7, 2.2]
    alone = model_gains(expected, 1, flat)
    assert alone.lockstep == pytest.approx(alone.serial) and alone.lockstep > 1.2  # one session: no contention
    many = model_gains(expected, 16, flat)
    assert many.serial < 0.3 < many.lockstep  # 16 sessions taking turns on shared cores: speculation loses
    one_alone = flat.target.seconds(3) + 0.002 + 2 * flat.draft.seconds(1)  # 3 rows, 2 positions
    assert serial_seconds(2, 16, flat) == pytest.approx(16 * one_alone)
    gains = ModelGains(1.2, 0.4)
    assert gains.blended(0.0) == pytest.approx(1.2) and gains.blended(1.0) == pytest.approx(0.4)
    assert gains.blended(0.25) == pytest.approx(0.8)  # the step's time, hence 1 / gain, is linear in it


def test_the_contention_starts_from_the_placement_and_is_fitted_to_measured_buckets():
    """Before anything is measured, the regime assumes contention where the draft and target share
    their hardware (the serial model) and none where they compute apart (the lockstep model);
    once a bucket past one session measured both regimes, the contention moves toward what fits
    it, as far as the windows behind its figures outweigh the assumption."""
    from specdec.loop.load_aware_k import REGIME_CONTENTION_PRIOR_WINDOWS, ModelGains

    def model(sessions: int) -> ModelGains:
        return ModelGains(1.3, 1.3) if sessions == 1 else ModelGains(1.2, 0.4)

    for shared, first in ((True, False), (False, True)):
        regime, _ = _regime_clock()
        assert regime.speculating(8, gains=model, contention=1.0 if shared else 0.0)[0] is first
        assert regime.contention() == (1.0 if shared else 0.0)
    regime, _ = _regime_clock()
    regime.rates.update({(load_bucket(2), True): 24.0, (load_bucket(2), False): 30.0})  # measured 0.8x
    regime.speculating(2, gains=model, contention=1.0)
    fit, prior = 0.25, REGIME_CONTENTION_PRIOR_WINDOWS  # 1/0.8 = 0.75/1.2 + 0.25/0.4
    # one window each (one exploration): the fit weighs one window against the assumption's eight
    assert regime.contention() == pytest.approx((prior * 1.0 + fit) / (prior + 1))
    regime.scored.update({(load_bucket(2), True): 40, (load_bucket(2), False): 60})  # a steady comparison
    assert regime.contention() == pytest.approx((prior * 1.0 + 40 * fit) / (prior + 40))
    c = regime.contention()
    assert regime.model_gain(load_bucket(16)) == pytest.approx(1 / ((1 - c) / 1.2 + c / 0.4))  # an unvisited bucket
    assert regime.model_gain(load_bucket(1)) == pytest.approx(1.3)  # one session: the models agree


def test_a_burst_after_a_lone_stream_is_decided_for_at_its_first_step():
    """A burst arrives within a window a lone stream ran "on": where the model says speculation
    loses at the burst's load, the burst's first step already runs "off" (the window closes at
    once, unscored), and the next windows explore nothing; a burst "on" would pay for keeps on."""
    from specdec.loop.load_aware_k import REGIME_SETTLE_WINDOWS, ModelGains

    def model(sessions: int) -> ModelGains:
        return ModelGains(1.3, 1.3) if sessions == 1 else ModelGains(1.1, 0.2)

    for shared in (True, False):
        regime, now = _regime_clock()
        for _ in range(3):  # a lone stream: "on"
            on, window = regime.speculating(1, gains=model, contention=1.0 if shared else 0.0)
            regime.committed(window, 4)
            now[0] += 5
        assert on
        for _ in range(16):
            regime.request_started()
        on, window = regime.speculating(1, gains=model, contention=1.0 if shared else 0.0)  # the report still says 1
        assert on is not shared  # no window length waited for
        if not shared:
            continue
        seen = []
        for _ in range(REGIME_SETTLE_WINDOWS + 40):  # windows of 16 sessions: "off" measured, "on" ruled out
            for _ in range(10):
                on, window = regime.speculating(16, gains=model, contention=1.0)
                regime.committed(window, 16 * 30 // 10 if not on else 16 * 20 // 10)
                now[0] += 1
            seen.append(on)
        assert not any(seen)  # never explored "on": the model rules it out at 16 sessions on shared cores
        assert regime.rates.get((load_bucket(16), False)) and (load_bucket(16), True) not in regime.rates


def test_the_contention_a_session_assumes_comes_from_placement_unless_the_coordinator_says():
    import argparse
    from types import SimpleNamespace

    from coordinator import settings
    from coordinator.config import CoordinatorConfig
    from coordinator.core import CoordinatorCore
    from coordinator.main import add_arguments, config_from_args
    from specdec.loop.load_aware_k import SHARED_HARDWARE_CONTENTION
    from specdec.runtime.registry import Replica

    def replica(kind: str, node: str) -> Replica:
        return Replica(kind, kind, f"{node}:1", node=node, devices="cpu")

    here = SimpleNamespace(draft=replica("draft", "a"), target=replica("target", "a"))
    apart = SimpleNamespace(draft=replica("draft", "b"), target=replica("target", "a"))
    alone = SimpleNamespace(draft=None, target=replica("target", "a"))  # no draft replica: nothing drafts there
    core = CoordinatorCore(CoordinatorConfig(target_address="h:1"))
    assert [core._contention(r) for r in (here, apart, alone)] == [SHARED_HARDWARE_CONTENTION, 0.0, 0.0]
    assert SHARED_HARDWARE_CONTENTION > 1.0  # past the serial model: the threads contend too
    told = CoordinatorCore(CoordinatorConfig(target_address="h:1", contention=0.3))
    assert told._contention(here) == 0.3
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--target", "h:1"])).contention is None
    assert config_from_args(parser.parse_args(["--target", "h:1", "--contention", "0.5"])).contention == 0.5
    assert settings.parse_values({"contention": "auto"}) == {"contention": None}
    for bad in ("-1", "3", "lots"):
        with pytest.raises(ValueError, match="contention"):
            settings.parse_values({"contention": bad})


def test_after_the_load_falls_a_lone_stream_is_left_to_its_requests_at_once():
    """When a burst ends and a lone stream is left, the window after the burst's last is still
    chosen for the burst's load; the next is chosen for one session, and leaves k to the
    request's own model however the burst's tail ran or the regime's model leans (a lone stream
    is never judged by windows: what its tail ran scores nowhere)."""
    from specdec.loop.load_aware_k import ModelGains

    def model(sessions: int) -> ModelGains:
        return ModelGains(0.95, 0.95) if sessions == 1 else ModelGains(1.1, 0.2)

    regime, now = _regime_clock()
    for _ in range(20):  # a burst of 16, "off"
        for _ in range(10):
            on, window = regime.speculating(16, gains=model, contention=1.0)
            regime.committed(window, 16)
            now[0] += 1
    seen, deciding = [], []
    for _ in range(6):  # a lone stream
        for _ in range(10):
            on, window = regime.speculating(1, gains=model, contention=1.0)
            regime.committed(window, 4)
            now[0] += 1
        seen.append(on)
        deciding.append(regime.requests_decide)
    assert seen == [False] + [True] * 5 and deciding == [False] + [True] * 5
    assert all(bucket > 0 for bucket, _ in regime.rates)  # nothing scored for one session
