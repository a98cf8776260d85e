"""pass@1 and pass@k from each episode's sampled outcomes."""

import pytest

from bench.bench_pass_at_k import pass_at_k


def test_pass_at_k_counts_an_episode_once_any_sample_succeeds():
    outcomes = [[False, False, True, False], [False] * 4, [True] * 4]
    assert pass_at_k(outcomes) == {
        "pass@1": pytest.approx((0.25 + 0 + 1) / 3),
        "pass@k": pytest.approx(2 / 3),
        "mixed": pytest.approx(1 / 3),
    }
    with pytest.raises(ValueError):
        pass_at_k([[]])
