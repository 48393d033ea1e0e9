import numpy as np
from scipy.stats import kstest

from specdec.exact.rng import Purpose, new_seed, uniform


def test_same_key_same_value_and_keys_are_independent():
    assert uniform(7, 3, Purpose.ACCEPT) == uniform(7, 3, Purpose.ACCEPT)
    values = {uniform(s, pos, pur) for s in (1, 2) for pos in range(50) for pur in Purpose}
    assert len(values) == 2 * 50 * len(Purpose)  # no collisions between keys


def test_uniform_range_and_distribution():
    draws = np.array([uniform(12345, pos, Purpose.DRAFT) for pos in range(20000)])
    assert ((draws >= 0) & (draws < 1)).all()
    assert kstest(draws, "uniform").pvalue > 1e-3  # fixed key set: deterministic


def test_full_uint64_seed_and_fresh_seeds():
    assert 0 <= uniform(2**64 - 1, 0, Purpose.BONUS) < 1
    seeds = {new_seed() for _ in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
