"""The statistical certificate runs in CI, exactly as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REQUIRED = {
    "temperature_1",
    "temperature_0.7",
    "top_k",
    "top_p",
    "min_p",
    "penalties_and_bias",
    "min_tokens",
    "greedy",
    "k1",
    "k5_boundary",
    "disjoint_support_forced_rejection",
    "q_equals_p_bonus",
    "ngram",
    "reduced_head",
    "feature_draft",
    "adaptive_k",
    "load_aware_k",
    "invariant",
    "invariant_load_aware_top_k",
    "pipelined",
    "invariant_pipelined_load_aware",
}


@pytest.mark.slow
@pytest.mark.statistical
def test_selftest_json_reports_every_case_passed():
    specdec = Path(sys.executable).with_name("specdec")
    proc = subprocess.run(
        [str(specdec), "selftest", "--json"], capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    names = {case["name"] for case in report["cases"]}
    assert names >= REQUIRED
    for case in report["cases"]:
        assert {"name", "n", "p_value", "tv", "passed"} <= set(case)
        assert case["passed"], case
        assert case["n"] >= 100
    assert report["alpha"] == 1e-3


def test_selftest_fails_loudly_when_the_law_is_wrong():
    """The certificate can fail: a reference law that is not the target's is rejected."""
    from collections import Counter

    from specdec.apps.selftest import goodness_of_fit

    law = {(0,): 0.5, (1,): 0.3, (2,): 0.2}
    honest = Counter({(0,): 500, (1,): 300, (2,): 200})
    assert goodness_of_fit(honest, law, 1000)[0] > 0.99
    skewed = Counter({(0,): 560, (1,): 260, (2,): 180})
    assert goodness_of_fit(skewed, law, 1000)[0] < 1e-3
    impossible = Counter({(0,): 999, (3,): 1})
    p_value, _, _, _, problem = goodness_of_fit(impossible, law, 1000)
    assert p_value == 0.0 and "probability 0" in problem
