"""The speedup theory against closed forms, limits and published values."""

import math

import numpy as np
import pytest

from specbench.core import metrics
from specbench.models.costs import Cost, ForwardCosts

from ..helpers import noisy_prompts


@pytest.mark.parametrize(
    "alpha,k,c,want",
    [(0.8, 4, 0.05, 2.801), (0.7, 5, 0.01, 2.801), (0.5, 3, 0.01, 1.820), (0.6, 4, 0.05, 1.921), (0.8, 6, 0.01, 3.727)],
)
def test_published_speedup_values(alpha, k, c, want):
    # The published tables print three decimals, some rounded and some truncated.
    assert abs(metrics.predicted_speedup(alpha, c, k) - want) <= 1e-3


@pytest.mark.parametrize("alpha,k,want", [(0.8, 9, 4.463), (0.5, 4, 1.937), (0.1, 3, 1.111)])
def test_published_expected_lengths(alpha, k, want):
    assert abs(metrics.expected_tokens(alpha, k) - want) <= 1e-3


def test_expected_tokens_is_the_geometric_sum():
    for alpha in (0.0, 0.3, 0.9):
        for k in (1, 4, 8):
            assert metrics.expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def test_alpha_one_is_the_limit():
    for k in (1, 4, 8):
        assert metrics.expected_tokens(1.0, k) == k + 1
        assert metrics.predicted_speedup(1.0, 0.1, k) == pytest.approx((k + 1) / (k * 0.1 + 1))
        assert metrics.expected_tokens(1 - 1e-9, k) == pytest.approx(k + 1, rel=1e-6)


def test_alpha_zero_only_pays_for_the_draft():
    assert metrics.predicted_speedup(0.0, 0.05, 4) == pytest.approx(1 / 1.2)
    assert metrics.predicted_speedup(0.0, 0.0, 4) == 1.0


def test_verify_ratio_one_gives_the_classic_formula():
    assert metrics.predicted_speedup_verify(0.7, 0.1, 3, 1.0) == metrics.predicted_speedup(0.7, 0.1, 3)
    assert metrics.predicted_speedup_verify(0.7, 0.1, 3, 2.0) < metrics.predicted_speedup(0.7, 0.1, 3)


def test_optimal_k_and_break_even_c():
    k, best = metrics.optimal_k(0.8, 0.05, range(1, 11))
    assert best == max(metrics.predicted_speedup(0.8, 0.05, j) for j in range(1, 11))
    assert metrics.predicted_speedup(0.8, 0.05, k) == best
    # The break-even c is alpha (reached at K = 1): just below it K = 1 wins, just above nothing does.
    c_max = metrics.max_useful_c(0.6, range(1, 9))
    assert c_max == pytest.approx(0.6)
    assert metrics.predicted_speedup(0.6, c_max - 1e-6, 1) > 1
    assert all(metrics.predicted_speedup(0.6, c_max + 1e-6, k) < 1 for k in range(1, 9))
    assert metrics.max_useful_c(0.6, [3, 4]) == pytest.approx((0.6 + 0.36 + 0.216) / 3)


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("c", [0.005, 0.02, 0.1, 0.5, 1.0, 2.0])
def test_the_optimum_over_every_k_is_the_best_of_a_long_search(alpha, c):
    k, speedup = metrics.unbounded_optimal_k(alpha, c)
    assert (k, speedup) == metrics.optimal_k(alpha, c, range(1, 3000))


def test_no_k_is_best_where_the_speedup_grows_without_end():
    assert metrics.unbounded_optimal_k(0.7, 0.0) is None and metrics.unbounded_optimal_k(1.0, 0.5) is None
    assert metrics.unbounded_optimal_k(1.0, 1.0) == (1, 1.0)  # (K + 1) / (K + 1): every K ties, the smallest wins


def test_best_k_prefers_smaller_k_on_ties():
    assert metrics.best_k({1: 1.5, 2: 1.7, 3: 1.7}) == 2


def test_acceptance_by_position():
    # Steps accepting 0, 2, 3, 3 drafts out of K = 3.
    assert metrics.acceptance_by_position([1, 0, 1, 2]) == [0.75, 0.75, 0.5]
    assert all(math.isnan(x) for x in metrics.acceptance_by_position([0, 0, 0]))


def forward_costs(target: dict[int, float], draft: float) -> ForwardCosts:
    """Costs with the given median seconds (and no spread)."""
    return ForwardCosts(100, {n: Cost(s, 0.0, 0.0) for n, s in target.items()}, Cost(draft, 0.0, 0.0), repeats=1)


def test_forward_costs_ratios_and_their_rows_round_trip():
    costs = forward_costs({1: 0.04, 2: 0.05, 5: 0.08}, 0.004)
    assert costs.c == pytest.approx(0.1)
    assert costs.verify_ratio(4) == pytest.approx(2.0)
    assert ForwardCosts.from_rows([{k: str(v) for k, v in row.items()} for row in costs.rows()]) == costs


def test_iqr_is_the_spread_of_the_middle_half():
    assert metrics.iqr([1.0, 2.0, 3.0, 4.0, 100.0]) == pytest.approx(2.0)  # an outlier barely moves it
    assert metrics.iqr([5.0]) == 0.0


def test_predicted_by_k_weighs_the_measured_verification_cost():
    from specbench.results.summary import predicted_by_k

    # A CPU-like profile: four or more tokens cost twice one token's forward.
    cpu = forward_costs({1: 1.0, 2: 1.1, 3: 1.2, 4: 2.0, 5: 2.0}, 0.1)
    assert sorted(predicted_by_k(0.6, cpu.c, cpu)) == [1, 2, 3, 4]
    assert metrics.best_k(predicted_by_k(0.6, cpu.c, cpu)) == 2
    # Free verification, as the classic formula assumes, moves the best K up.
    free = forward_costs({n: 1.0 for n in range(1, 6)}, 0.05)
    assert metrics.best_k(predicted_by_k(0.8, free.c, free)) == 4


def test_phase_figures_account_for_forwards_and_overhead():
    # The baseline: a 0.5 s prefill, then 10 one-token steps of 0.1 s each and 0.1 s of overhead.
    base = dict(
        new_tokens=11,
        target_forwards=11,
        draft_forwards=0,
        method_s=1.6,
        prefill_s=0.5,
        draft_s=0,
        inner_s=0,
        verify_s=1.0,
    )
    # K = 2 over 4 rounds: 8 draft forwards of 0.01 s, 4 verifications of 0.12 s, 0.04 s of overhead.
    run = dict(
        new_tokens=11,
        target_forwards=5,
        draft_forwards=8,
        method_s=1.15,
        prefill_s=0.55,
        draft_s=0.08,
        inner_s=0,
        verify_s=0.48,
    )
    got = metrics.phase_figures(run, base)
    assert got["c_run"] == pytest.approx(0.1) and got["verify_ratio_run"] == pytest.approx(1.2)
    assert got["predicted_speedup_run"] == pytest.approx((10 / 4) / (2 * 0.1 + 1.2))
    assert got["decode_speedup"] == pytest.approx((10 / 0.6) / (10 / 1.1))
    # Efficiency is the run's share of decode time in forwards over the baseline's.
    assert got["efficiency"] == pytest.approx((0.56 / 0.6) / (1.0 / 1.1))
    # Against itself the baseline loses nothing, and it drafts nothing.
    itself = metrics.phase_figures(base, base)
    assert itself["efficiency"] == pytest.approx(1.0) and math.isnan(itself["c_run"])
    # Sums over two prompts subtract one prefill forward per prompt.
    double = {name: 2 * value for name, value in run.items()}
    twice = metrics.phase_figures(double, {name: 2 * value for name, value in base.items()}, decodes=2)
    assert twice == pytest.approx(got)
    # A level beneath the draft model (a cascade's lookup) is drafting time too: 0.02 s over the 4 rounds.
    cascade = metrics.phase_figures({**run, "inner_s": 0.02, "method_s": 1.17}, base)
    assert cascade["c_run"] == pytest.approx(0.1)  # still the draft model's forward alone
    assert cascade["predicted_speedup_run"] == pytest.approx((10 / 4) / ((0.08 + 0.02) / 4 / 0.1 + 1.2))


def test_noisy_forward_costs_are_called_out():
    from specbench.models.costs import noisy_costs

    steady = forward_costs({1: 1.0, 2: 1.1, 3: 1.2}, 0.1)
    assert noisy_costs(steady) == []
    shaky = ForwardCosts(100, {**steady.target, 3: Cost(1.2, 0.5, 0.4)}, steady.draft_single, repeats=10)
    (warning,) = noisy_costs(shaky)
    assert "[3] tokens" in warning and "--threads 1" in warning


def test_paired_change_is_the_change_of_the_summed_rates():
    base, cur = noisy_prompts(np.random.default_rng(0), 0.05)
    change, low, high = metrics.paired_change(base, cur)

    def rate(parts):
        return parts[:, 0].sum() / parts[:, 1].sum()

    assert change == pytest.approx((rate(cur) / rate(cur[:, 2:])) / (rate(base) / rate(base[:, 2:])) - 1)
    assert low < change < high
    assert metrics.paired_change(base[:, :2], cur[:, :2])[0] == pytest.approx(rate(cur) / rate(base) - 1)
    assert metrics.paired_change(base, cur) == (change, low, high)  # seeded: compare repeats exactly


def test_a_slowdown_is_outside_the_interval_and_noise_inside():
    base, cur = noisy_prompts(np.random.default_rng(1), 0.05, slowdown=1.3)
    change, low, high = metrics.paired_change(base, cur)
    assert high < -0.1 and change == pytest.approx(1 / 1.3 - 1, abs=0.05)
    base, cur = noisy_prompts(np.random.default_rng(1), 0.05)
    _, low, high = metrics.paired_change(base, cur)
    assert low < 0 < high


def test_less_noise_per_prompt_narrows_the_interval():
    # More repeats per prompt leave less noise in each prompt's median time.
    widths = {}
    for noise in (0.05, 0.01):
        base, cur = noisy_prompts(np.random.default_rng(2), noise)
        _, low, high = metrics.paired_change(base, cur)
        widths[noise] = high - low
    assert widths[0.01] < widths[0.05] / 3


def test_wins_from_is_the_start_of_the_run_of_wins_up_to_the_longest_context():
    assert metrics.wins_from({1024: 0.8, 2048: 0.95, 4096: 1.05, 8192: 1.3}) == 4096
    assert (
        metrics.wins_from({1024: 1.1, 2048: 0.9, 4096: 1.05, 8192: 1.3}) == 4096
    )  # a win that does not last is not one
    assert metrics.wins_from({1024: 1.2, 2048: 1.1}) == 1024
    assert metrics.wins_from({1024: 1.2, 2048: 0.99}) is None  # losing at the longest context: never
    assert metrics.wins_from({1024: 1.2, 2048: math.nan}) is None
    assert metrics.wins_from({1024: 1.02, 2048: 1.5}, threshold=1.1) == 2048


def test_bandwidth_utilisation_is_the_bytes_read_per_second_over_the_copy_bandwidth():
    # 20 tokens/s, 1 GB a step, against 40 GB/s: half the bandwidth.
    assert metrics.bandwidth_utilisation(20.0, 1e9, 40e9) == pytest.approx(0.5)
    assert math.isnan(metrics.bandwidth_utilisation(20.0, 1e9, 0.0))  # no bandwidth measured
    assert math.isnan(metrics.bandwidth_utilisation(20.0, 1e9, math.nan))


def test_decode_context_tokens_sums_each_steps_context():
    # A 10-token prompt and 4 new tokens: the prefill yields the first; the steps attend over 11, 12, 13.
    assert metrics.decode_context_tokens(10, 4) == 11 + 12 + 13
    assert metrics.decode_context_tokens(10, 1) == metrics.decode_context_tokens(10, 0) == 0
