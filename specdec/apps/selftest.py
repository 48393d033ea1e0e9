"""``specdec selftest``: the exactness certificate, in process, on tiny random models.

For each case we enumerate the exact float64 law of the first T generated tokens under the
target alone (every prefix, the shared transform pipeline in float64), then run N seeded
speculative generations through the real engines and the real loop, and compare the empirical
joint frequencies with a chi-square test at a fixed significance level (G-test and total
variation reported beside it). Seeds are fixed (run i uses seed BASE_SEED + i), so the
certificate is deterministic: it cannot flake, and a bug cannot hide behind a lucky run.

Outcomes with an expected count below 5 are pooled into one bin (the usual validity rule for
the chi-square approximation); an observed outcome with exact probability 0 fails the case
outright.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specdec.exact.sampling import SamplingParams, probs_from_logits, token_counts
from specdec.loop.generate import TargetPeer

ALPHA = 1e-3  # per-case significance level
BASE_SEED = 20231130
VOCAB = 16
TARGET_SEED, DRAFT_SEED = 11, 23
DEFAULT_RUNS = 1000
# The constrained case's vocabulary, as text: a byte-level BPE over the 16 ids that the grammar
# engine can read (specdec.modeling.tiny.char_tokenizer); id 0 is its EOS.
CHAR_TOKENS = ("<eos>", "a", "b", "c", "d", "x", "y", "z", "-", ".", "ab", "ba", "cd", "dc", "xy", "yz")


@dataclass(frozen=True)
class Case:
    name: str
    covers: str
    params: dict = field(default_factory=dict)  # SamplingParams fields (seed and length set per run)
    k: int = 3
    draft: str = "model"  # model | same | negated | ngram | subset | feature
    tokens: int = 3  # T: length of the enumerated joint law (also max_new_tokens)
    top_m: int = 0  # draft truncation (0 = off)
    prompt: tuple[int, ...] = (1, 2, 3)
    expect_acceptance: float | None = None  # exact acceptance rate the case must show
    # The adaptive policy with this (fixed, per_token) step cost: k then changes from step to step
    # with the acceptance so far; None = every step proposes k.
    adaptive_cost: tuple[float, float] | None = None
    # The load-aware policy (specdec.loop.load_aware_k), fed a pseudo-random batch load every step so
    # that k in 0..k follows something outside the request, as it does under real load.
    load_aware: bool = False
    # Structured output: (kind, spec) of a constraint over CHAR_TOKENS; p and q are masked, and
    # the loop proposes what the constraint forces itself (docs/structured-output.md).
    constraint: tuple[str, str] | None = None
    # Pipelined drafting (specdec.loop.pipelining): the draft drafts the next block while the target
    # verifies; every run must also be token for token the serial run of its seed.
    pipeline: bool = False


CASES: tuple[Case, ...] = (
    Case("temperature_1", "plain sampling, k=3 (block crosses max_new_tokens=3)", {"temperature": 1.0}),
    Case("temperature_0.7", "temperature scaling on both sides", {"temperature": 0.7}),
    Case("top_k", "top-k filtering (k=4) on p and q", {"temperature": 0.9, "top_k": 4}),
    Case("top_p", "top-p (nucleus 0.8) on p and q", {"top_p": 0.8}),
    Case("min_p", "min-p (0.15) on p and q", {"min_p": 0.15}),
    Case(
        "penalties_and_bias",
        "repetition 1.8, presence 0.5, frequency 0.4, logit bias; position-wise history",
        {"repetition_penalty": 1.8, "presence_penalty": 0.5, "frequency_penalty": 0.4, "logit_bias": {5: 1.5, 7: -2.0}},
        prompt=(5, 7, 5, 9),
    ),
    Case(
        "min_tokens",
        "min_tokens=2 with stop ids 0-3: impossible in p and q for two tokens, possible at the third",
        {"temperature": 1.0, "min_tokens": 2, "stop_token_ids": (0, 1, 2, 3)},
    ),
    Case("greedy", "temperature 0: one-hot p and q, every run identical", {"temperature": 0.0}),
    Case("k1", "k=1 blocks, 3 steps' worth of tokens", {"temperature": 1.0}, k=1),
    Case("k5_boundary", "k=5 > max_new_tokens=3: the block is cut at the boundary", {"temperature": 1.0}, k=5),
    Case(
        "disjoint_support_forced_rejection",
        "draft support disjoint from the target's top-k: every proposal rejected, output all from the residual",
        {"top_k": 3},
        draft="negated",
        expect_acceptance=0.0,
    ),
    Case(
        "q_equals_p_bonus",
        "draft == target: every proposal accepted, bonus path",
        {"temperature": 1.0},
        draft="same",
        expect_acceptance=1.0,
    ),
    Case(
        "sparse_q_top_m",
        "draft ships a truncated q (top-M=3): sampling from exactly the shipped q",
        {"temperature": 1.0},
        top_m=3,
    ),
    Case(
        "ngram",
        "n-gram / prompt-lookup draft with one-hot q",
        {"temperature": 1.0},
        draft="ngram",
        prompt=(4, 6, 4, 6, 4, 6, 4),
    ),
    Case(
        "long_prompt",
        "a 34-token prompt (two whole prefix-cache blocks): through the stack every run after the "
        "first copies its first 32 positions on the target and the draft instead of computing them",
        {"temperature": 1.0},
        prompt=tuple((5 * i + 2) % 16 for i in range(34)),
    ),
    Case(
        "reduced_head",
        "draft with a reduced-vocabulary head (10 of 16 tokens, as distilled drafts ship): "
        "q = 0 outside it, the residual supplies the rest",
        {"temperature": 1.0},
        draft="subset",
    ),
    Case(
        "feature_draft",
        "feature draft (EAGLE-style): proposals from the target's hidden states, then from its "
        "own fed-back predictions, reduced head; k=2 over 4 tokens",
        {"temperature": 1.0},
        k=2,
        draft="feature",
        tokens=4,
    ),
    Case(
        "adaptive_k",
        "adaptive policy (block cost 1.5 + 0.3k): whether a step is a k=3 block or target-only "
        "depends on the acceptance so far (k=3, 0, 3 ... over 4 tokens)",
        {"temperature": 1.0},
        tokens=4,
        adaptive_cost=(0.5, 0.3),
    ),
    Case(
        "load_aware_k",
        "load-aware policy: each step's k in 0..3 chosen from a batch load that changes at random "
        "from step to step (alone: k=3; 31 others: k=0) over 4 tokens",
        {"temperature": 1.0},
        tokens=4,
        load_aware=True,
    ),
    Case(
        "invariant",
        "invariant sampling (Gumbel-max, noise keyed by position): the target's law, and every run "
        "token for token the target-only run of its seed",
        {"temperature": 1.0, "invariant": True},
    ),
    Case(
        "invariant_load_aware_top_k",
        "invariant sampling with top-k 6 under the randomly loaded load-aware policy: k follows the "
        "load, the tokens do not",
        {"temperature": 0.8, "top_k": 6, "invariant": True},
        tokens=4,
        load_aware=True,
    ),
    Case(
        "constrained_forced_runs",
        "structured output: a regex masks p and q; where it admits one token (after 'ab': '-', 'z') "
        "the loop proposes the run itself with a one-hot q, elsewhere the draft's k=3 blocks cross "
        "forced positions; temperature 2.5 spreads the tiny law; T=5",
        {"temperature": 2.5},
        tokens=5,
        constraint=("regex", r"[ab]{1,2}-z[cd]{1,2}-z[xy]+\."),
    ),
    Case(
        "constrained_feature_draft",
        "structured output with a feature draft (reduced head of 10 tokens): its q masked after its "
        "own proposals, a block ends where the head has no admitted token; k=2, T=5",
        {"temperature": 2.5},
        k=2,
        draft="feature",
        tokens=5,
        constraint=("regex", r"[ab]{1,2}-z[cd]{1,2}-z[xy]+\."),
    ),
    Case(
        "invariant_constrained",
        "invariant sampling under the same regex: Gumbel-max over the masked law on both sides, forced "
        "runs committed as they are; the target's law, and every run the target-only run of its seed",
        {"temperature": 2.5, "invariant": True},
        tokens=5,
        constraint=("regex", r"[ab]{1,2}-z[cd]{1,2}-z[xy]+\."),
    ),
    Case(
        "pipelined",
        "pipelined drafting: k=1 blocks, the next block drafted while the target verifies for the branches "
        "'accepted, bonus as the draft drew it' and 'rejected, recovered token as the draft guesses it', used "
        "when the verdict takes one; T=4",
        {"temperature": 1.0},
        k=1,
        tokens=4,
        pipeline=True,
    ),
    Case(
        "invariant_pipelined_load_aware",
        "pipelined drafting with invariant sampling (the draft's guesses share the target's noise) under "
        "the randomly loaded load-aware policy: a step takes a prefix of a branch's block drafted ahead; "
        "every run the target-only run of its seed; T=4",
        {"temperature": 0.8, "invariant": True},
        k=2,
        tokens=4,
        load_aware=True,
        pipeline=True,
    ),
)
SUBSET_HEAD = (0, 1, 2, 3, 5, 8, 9, 11, 12, 14)


@dataclass
class CaseResult:
    name: str
    covers: str
    n: int
    k: int
    tokens: int
    p_value: float
    g_test_p_value: float
    tv: float
    bins: int
    acceptance_rate: float
    passed: bool
    detail: str = ""
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------
def build_target():
    """A tiny random Llama whose widths the batched layer kernel covers (head_dim 16), so the
    statistical cases run through the same pass that serves under load (docs/batching.md)."""
    from specdec.modeling.tiny import tiny_llama

    return tiny_llama(VOCAB, seed=TARGET_SEED, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2)


def build_draft(kind: str, target, top_m: int):
    from specdec.engine.draft import DraftEngine
    from specdec.engine.ngram import NgramDraft
    from specdec.modeling.heads import apply_head_vocab
    from specdec.modeling.tiny import negated_head, perturbed

    if kind == "ngram":
        return NgramDraft(VOCAB)
    if kind == "feature":
        from specdec.engine.draft import FeatureDraftEngine
        from specdec.training.distill_features import build_feature_draft

        draft = (
            build_feature_draft(
                target, list(SUBSET_HEAD), embed_size=8, heads=4, kv_heads=2, intermediate=64, seed=DRAFT_SEED
            )
            .eval()
            .requires_grad_(False)
        )
        return FeatureDraftEngine(draft, top_m=top_m, eps=0.0)
    model = {
        "model": lambda: perturbed(target, scale=0.04, seed=DRAFT_SEED),
        "same": lambda: target,
        "negated": lambda: negated_head(target),
        "subset": lambda: apply_head_vocab(perturbed(target, scale=0.04, seed=DRAFT_SEED), list(SUBSET_HEAD)),
    }[kind]()
    return DraftEngine(model, top_m=top_m, eps=0.0)


def case_grammars(case: Case):
    """The compiled constraints over CHAR_TOKENS for a constrained case (None otherwise)."""
    if case.constraint is None:
        return None
    from specdec.modeling.grammar import Grammars
    from specdec.modeling.tiny import char_tokenizer

    return Grammars(char_tokenizer(list(CHAR_TOKENS)), VOCAB, [0])


@torch.inference_mode()
def exact_law(
    model, prompt: tuple[int, ...], params: SamplingParams, length: int, grammars=None
) -> dict[tuple[int, ...], float]:
    """P(first ``length`` tokens = x) under the target alone, enumerated in float64 over the
    support of each step (so a large vocabulary is fine when top-k / top-p keep the support small).
    With ``params.constraint``, each step is masked by the constraint after its prefix (compiled
    by ``grammars``), and an EOS ends its sequence there."""
    vocab = model.config.vocab_size
    ends = set() if params.ignore_eos else set(params.eos_token_ids)
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        done = {x: w for x, w in law.items() if x and x[-1] in ends}
        prefixes = [x for x, w in law.items() if w > 0 and x not in done]
        if not prefixes:
            break
        batch = torch.tensor([list(prompt) + list(x) for x in prefixes], dtype=torch.long)
        logits = model(input_ids=batch).logits[:, -1, :].to(torch.float64)
        counts = torch.stack([token_counts(list(x), vocab) for x in prefixes])  # the generated tokens
        prompt_seen = token_counts(list(prompt), vocab) > 0
        allowed = None
        if params.constraint is not None:
            allowed = torch.stack([grammars.matcher(params.constraint).allowed_after(x) for x in prefixes])
        probs = probs_from_logits(logits, params, counts, dtype=torch.float64, prompt_seen=prompt_seen, allowed=allowed)
        law = done | {
            (*x, int(v)): law[x] * float(probs[row, v])
            for row, x in enumerate(prefixes)
            for v in torch.nonzero(probs[row] > 0).flatten().tolist()
        }
    return law


def goodness_of_fit(observed: Counter, law: dict, n: int) -> tuple[float, float, float, int, str]:
    """(chi-square p, G-test p, total variation, bins, problem) with small-expectation pooling."""
    from scipy.stats import power_divergence

    impossible = [x for x in observed if law.get(x, 0.0) <= 0.0]
    tv = 0.5 * sum(abs(observed.get(x, 0) / n - law.get(x, 0.0)) for x in set(law) | set(observed))
    if impossible:
        return 0.0, 0.0, tv, 0, f"observed outcome(s) of probability 0 under the target: {impossible[:3]}"
    big = [x for x, w in law.items() if w * n >= 5]
    obs = [observed.get(x, 0) for x in big]
    exp = [law[x] * n for x in big]
    rest_exp = n - sum(exp)
    if rest_exp > 1e-9:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    if len(exp) < 2:  # a point mass: the only valid outcome was observed every time
        return 1.0, 1.0, tv, len(exp), ""
    total = sum(exp)
    exp = [e * n / total for e in exp]  # guard float drift so scipy's sum check holds
    chi = power_divergence(obs, exp, lambda_="pearson")
    g = power_divergence(obs, exp, lambda_="log-likelihood")
    return float(chi.pvalue), float(g.pvalue), tv, len(exp), ""


def judge(
    case: Case, observed: Counter, law: dict, n: int, proposed: int, accepted: int, seconds: float = 0.0
) -> CaseResult:
    """The verdict on one case from its outcomes (shared by the in-process and the stack runs)."""
    p_value, g_p, tv, bins, problem = goodness_of_fit(observed, law, n)
    acceptance = accepted / proposed if proposed else 0.0
    passed = not problem and p_value >= ALPHA
    if case.expect_acceptance is not None and abs(acceptance - case.expect_acceptance) > 1e-12:
        passed, problem = False, f"acceptance {acceptance:.4f}, expected exactly {case.expect_acceptance}"
    if case.draft != "ngram" and proposed == 0:
        passed, problem = False, "no proposals were made: the speculative path was not exercised"
    return CaseResult(
        case.name, case.covers, n, case.k, case.tokens, p_value, g_p, tv, bins, acceptance, passed, problem, seconds
    )


def case_params(case: Case) -> SamplingParams:
    if case.constraint is not None:  # a complete constraint admits EOS alone: EOS is not ignored
        from specdec.exact.constraint import Constraint

        constraint = Constraint(*case.constraint)
        return SamplingParams(max_new_tokens=case.tokens, eos_token_ids=(0,), constraint=constraint, **case.params)
    return SamplingParams(max_new_tokens=case.tokens, ignore_eos=True, **case.params)


def case_runs(case: Case, runs: int) -> int:
    return runs if not case_params(case).greedy else min(runs, 100)


def run_case(case: Case, runs: int = DEFAULT_RUNS) -> CaseResult:
    torch.set_num_threads(1)
    target_model = build_target()
    return check_pair(case, target_model, build_draft(case.draft, target_model, case.top_m), runs)


def check_pair(case: Case, target_model, draft, runs: int = DEFAULT_RUNS) -> CaseResult:
    """One case with any target model and draft engine: the exact law of ``target_model`` vs the
    outcomes of seeded speculative runs through the real engines and loop."""
    from specdec.engine.target import TargetEngine
    from specdec.loop.adaptive_k import StepCost
    from specdec.loop.generate import speculative_generate

    started = time.perf_counter()
    target = TargetEngine(target_model)
    base = case_params(case)
    grammars = case_grammars(case)
    for engine in (target, draft):
        if grammars is not None:
            engine.store.grammars = grammars
    law = exact_law(target_model, case.prompt, base, case.tokens, grammars)
    n = case_runs(case, runs)
    observed: Counter = Counter()
    proposed = accepted = target_only = 0
    policy: dict[str, Any] = {}
    if case.adaptive_cost is not None:
        policy = {"adaptive": True, "step_cost": StepCost(*case.adaptive_cost)}
    chosen_ks: set[int] = set()
    diverged = 0  # invariant runs whose tokens are not the target-only run's
    forced = 0  # tokens the constraint forced, proposed by the loop
    # pipelined runs: tokens unlike the serial run's; blocks drafted ahead used (of a rejection branch)
    unlike_serial = predraft_hits = rejection_hits = 0
    for i in range(n):
        params = base.with_seed(BASE_SEED + i)
        if grammars is not None:
            policy = {"eos_token_ids": base.eos_token_ids, "constraint": grammars.matcher(base.constraint)}
        if case.load_aware:
            result = _load_aware_run(target, draft, case, params, random.Random(i), chosen_ks, case.pipeline)
        else:
            # (every rejection branch, whatever the timing: the selftest covers each path)
            branches = case.k if case.pipeline else None
            result = speculative_generate(
                target, draft, case.prompt, params, case.k, **policy, pipeline=case.pipeline, pipeline_branches=branches
            )
        if case.pipeline:  # the same loads (the same random.Random(i)) and seed, drafted serially
            if case.load_aware:
                serial = _load_aware_run(target, draft, case, params, random.Random(i), set(), False)
            else:
                serial = speculative_generate(target, draft, case.prompt, params, case.k, **policy)
            unlike_serial += serial.token_ids != result.token_ids
            predraft_hits += result.stats.predraft_hits
            rejection_hits += result.stats.predraft_rejection_hits
        if base.invariant:
            alone = speculative_generate(target, draft, case.prompt, params, 0)
            diverged += alone.token_ids != result.token_ids
        observed[tuple(result.token_ids[: case.tokens])] += 1
        proposed += result.stats.proposed_tokens
        accepted += result.stats.accepted_tokens
        target_only += result.stats.target_passes - result.stats.drafts
        forced += result.stats.forced_tokens
    verdict = judge(case, observed, law, n, proposed, accepted, time.perf_counter() - started)
    if case.pipeline and verdict.passed and (unlike_serial or not 0 < rejection_hits < predraft_hits):
        verdict.passed = False
        verdict.detail = (
            f"{unlike_serial} of {n} pipelined runs unlike the serial run; {predraft_hits} blocks drafted ahead "
            f"used, {rejection_hits} of a rejection branch"
        )
    if diverged and verdict.passed:
        verdict.passed, verdict.detail = False, f"{diverged} of {n} invariant runs differ from target-only"
    if case.adaptive_cost is not None and verdict.passed and not target_only:
        verdict.passed, verdict.detail = False, "the adaptive policy never chose k = 0: its path was not exercised"
    if case.load_aware and verdict.passed and len(chosen_ks) < 3:
        verdict.passed, verdict.detail = False, f"the load-aware policy chose only k in {sorted(chosen_ks)}"
    # (a feature draft needs the target's feature before every token: no forced runs with it)
    if grammars is not None and case.draft != "feature" and verdict.passed and not forced:
        verdict.passed, verdict.detail = False, "no forced run was proposed: that path was not exercised"
    if draft.stats()["live_sessions"] or target.stats()["live_sessions"]:
        verdict.passed, verdict.detail = False, "sessions left behind in an engine after the runs"
    return verdict


class _RandomlyLoadedTarget(TargetPeer):
    """An in-process target that reports a pseudo-random batch around each verify (the load-aware
    policy's input) and a fixed cost curve: memory-bound up to 8 rows, compute past it."""

    CURVE = ((1, 0.040), (2, 0.041), (4, 0.042), (8, 0.045), (16, 0.090), (32, 0.180))
    OTHERS = (0, 0, 2, 8, 31)

    def __init__(self, engine, rng: random.Random, block_sizes: set[int]):
        from specdec.loop.generate import LocalTarget

        self.inner = LocalTarget(engine)
        self.context_length = self.inner.context_length
        self.rng = rng
        self.rows = 0
        self.block_sizes = block_sizes  # every block size verified (the policy's choices)

    async def start(self, *args, **kwargs):
        return await self.inner.start(*args, **kwargs)

    async def verify(self, session_id, step, proposal, commit, return_features=False):
        self.rows = len(proposal) + 1
        self.block_sizes.add(len(proposal))
        return await self.inner.verify(session_id, step, proposal, commit, return_features)

    async def release(self, session_id):
        await self.inner.release(session_id)

    async def cost_curve(self):
        from specdec.loop.load_aware_k import CostCurve

        return CostCurve(self.CURVE)

    def take_load(self, session_id):
        from specdec.engine.batching import PassLoad

        others = self.rng.choice(self.OTHERS)
        return PassLoad(others + self.rows, others + 1, 0.0, others + 1)


def _load_aware_run(target, draft, case: Case, params, rng: random.Random, chosen_ks: set[int], pipeline: bool = False):
    import asyncio

    from specdec.loop.generate import LocalDraft, SpeculativeRun

    loaded = _RandomlyLoadedTarget(target, rng, chosen_ks)
    run = SpeculativeRun(
        loaded,
        LocalDraft(draft),
        case.prompt,
        params,
        case.k,
        adaptive=True,
        load_aware=True,
        pipeline=pipeline,
        pipeline_branches=case.k,
    )

    async def go():
        async for _ in run.steps():
            pass

    asyncio.run(go())
    return run.result()


def _run_case_by_name(args: tuple[str, int]) -> CaseResult:
    name, runs = args
    return run_case(next(c for c in CASES if c.name == name), runs)


def run_all(
    runs: int = DEFAULT_RUNS, workers: int = 2, cases: list[str] | None = None, progress=None
) -> list[CaseResult]:
    selected = [c for c in CASES if cases is None or c.name in cases]
    jobs = [(c.name, runs) for c in selected]
    results: dict[str, CaseResult] = {}
    if workers <= 1:
        for job in jobs:
            results[job[0]] = _run_case_by_name(job)
            if progress:
                progress(results[job[0]])
    else:
        # spawn, not fork: forking a process whose torch thread pools are live can deadlock.
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for result in pool.imap_unordered(_run_case_by_name, jobs):
                results[result.name] = result
                if progress:
                    progress(result)
    return [results[c.name] for c in selected]


def format_row(r: CaseResult) -> str:
    verdict = "PASS" if r.passed else "FAIL"
    line = (
        f"{r.name:<36} n={r.n:<5} k={r.k} T={r.tokens} bins={r.bins:<4} p={r.p_value:<8.4f} "
        f"G-p={r.g_test_p_value:<8.4f} TV={r.tv:.4f} acc={r.acceptance_rate:.3f} {verdict} "
        f"({r.seconds:.0f}s)"
    )
    return line + (f"  <- {r.detail}" if r.detail else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print a machine-readable report on stdout")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="seeded generations per case")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (cases run in parallel)")
    parser.add_argument("--case", action="append", help="run only this case (repeatable)")
    args = parser.parse_args(argv)
    names = [c.name for c in CASES]
    for name in args.case or []:
        if name not in names:
            parser.error(f"unknown case {name!r}; choose from {', '.join(names)}")
    out = sys.stderr if args.json else sys.stdout
    print(
        f"specdec selftest: {len(args.case or names)} cases, N={args.runs} seeded runs each, "
        f"chi-square at alpha={ALPHA}, vocab={VOCAB}",
        file=out,
        flush=True,
    )
    results = run_all(args.runs, args.workers, args.case, progress=lambda r: print(format_row(r), file=out, flush=True))
    failed = [r.name for r in results if not r.passed]
    print(
        f"{len(results) - len(failed)}/{len(results)} cases passed"
        + (f"; FAILED: {', '.join(failed)}" if failed else ""),
        file=out,
        flush=True,
    )
    if args.json:
        report = {
            "alpha": ALPHA,
            "vocab_size": VOCAB,
            "base_seed": BASE_SEED,
            "passed": not failed,
            "cases": [asdict(r) for r in results],
        }
        print(json.dumps(report, indent=2))
    return 1 if failed else 0
