"""issue 38: sampling at float32's edges. A temperature whose quotient under- or overflows float32
behaves as its limit -- T -> 0 is greedy (the argmax of the scores), T -> inf uniform over the kept
tokens -- and no NaN reaches the choice (before, 1e-40 made every logit +-inf, the CDF NaN and
``searchsorted`` returned the vocabulary's last id every time)."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.runtime.generation.sampling import Sampling, choose, process_logits

V = 7
LOGITS = np.array([[0.5, 2.25, -1.0, 2.0, 0.0, -3.5, 1.0],
                   [-0.25, -4.0, 3.0, 2.5, -1.0, 0.75, 3.25]], dtype=np.float32)
ARGMAX = [1, 6]  # written by hand: the best score of each row

TINY = [5e-324, 1e-320, 1e-45, 1e-44, 1e-40, 1e-39, 1.17e-38, 1e-37, 1e-30]
HUGE = [1e37, 3.4e38, 3.5e38, 1e39, 1e300, 1.7976931348623157e308]


@pytest.mark.parametrize("t", TINY)
@pytest.mark.parametrize("extra", [{}, {"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.1}, {"repetition_penalty": 1.3}])
def test_a_vanishing_temperature_is_greedy(t, extra):
    s = Sampling(temperature=t, seed=0, **extra)
    s.check()
    seen = np.zeros_like(LOGITS, dtype=bool) if "repetition_penalty" in extra else None
    x = process_logits(LOGITS, seen, s)
    assert not np.isnan(x).any()
    rng = np.random.default_rng(0)
    for _ in range(50):
        assert choose(LOGITS, seen, s, rng).tolist() == ARGMAX


@pytest.mark.parametrize("t", HUGE)
def test_a_huge_temperature_is_uniform(t):
    s = Sampling(temperature=t, seed=0)
    x = process_logits(LOGITS, None, s)
    assert not np.isnan(x).any() and np.isfinite(x).all()
    rng = np.random.default_rng(1)
    counts = np.zeros((2, V), dtype=int)
    n = 1400
    for _ in range(n):
        for r, c in enumerate(choose(LOGITS, None, s, rng)):
            counts[r, c] += 1
    # uniform: each id about n / V = 200 times (a 7-sigma band is far wider than the binomial's 14)
    assert (np.abs(counts - n / V) < 100).all(), counts


@pytest.mark.parametrize("t", HUGE + TINY)
def test_filtered_tokens_stay_filtered_at_any_temperature(t):
    """top_k keeps the 2 best of each row: nothing else may be chosen, NaN or not."""
    s = Sampling(temperature=t, top_k=2, seed=0)
    rng = np.random.default_rng(2)
    kept = [{1, 3}, {6, 2}]
    for _ in range(100):
        for r, c in enumerate(choose(LOGITS, None, s, rng)):
            assert int(c) in kept[r]


@pytest.mark.parametrize("t", [1e-3, 0.5, 1.0, 2.0, 1e3])
def test_ordinary_temperatures_divide_in_float32(t):
    """The usual range is unchanged: scores divided by the float32 temperature, as transformers does."""
    x = process_logits(LOGITS, None, Sampling(temperature=t))
    np.testing.assert_array_equal(x, LOGITS / np.float32(t))


def test_large_logits_with_a_small_temperature_do_not_overflow():
    big = np.array([[3e38, -3e38, 1e38, 2.9e38]], dtype=np.float32)
    s = Sampling(temperature=1e-3, seed=0)
    assert not np.isnan(process_logits(big, None, s)).any()
    rng = np.random.default_rng(3)
    assert {int(choose(big, None, s, rng)[0]) for _ in range(30)} == {0}


def test_a_nan_row_is_not_the_last_id():
    bad = np.array([[np.nan, 1.0, np.nan, 0.5]], dtype=np.float32)
    s = Sampling(temperature=1.0, seed=0)
    rng = np.random.default_rng(4)
    assert int(choose(bad, None, s, rng)[0]) in (1, 3)
