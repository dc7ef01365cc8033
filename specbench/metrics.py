"""The speedup theory and the summary statistics, as pure functions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens per target forward with lookahead k: (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return k + 1.0  # the limit as alpha -> 1
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, c: float, k: int) -> float:
    """The classic prediction, which assumes verifying k+1 tokens costs one target step."""
    return expected_tokens(alpha, k) / (k * c + 1.0)


def predicted_speedup_verify(alpha: float, c: float, k: int, verify_ratio: float) -> float:
    """The prediction with the measured cost of a (k+1)-token target forward (in target steps)."""
    return expected_tokens(alpha, k) / (k * c + verify_ratio)


def best_k(speedups: dict[int, float]) -> int:
    """The K with the highest speedup (the smaller K on a tie: it wastes fewer draft steps)."""
    return max(sorted(speedups), key=lambda k: speedups[k])


def optimal_k(alpha: float, c: float, ks: Iterable[int]) -> tuple[int, float]:
    speedups = {k: predicted_speedup(alpha, c, k) for k in ks}
    k = best_k(speedups)
    return k, speedups[k]


def max_useful_c(alpha: float, ks: Iterable[int]) -> float:
    """The largest cost ratio c for which some K still gives a predicted speedup above 1.

    speedup > 1  <=>  c < (E[tokens] - 1) / K = (alpha + ... + alpha^K) / K, which is largest at
    the smallest K (at K = 1 it is alpha itself).
    """
    return max((expected_tokens(alpha, k) - 1.0) / k for k in ks)


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def phase_figures(run: Mapping[str, float], base: Mapping[str, float], decodes: int = 1) -> dict[str, float]:
    """How a run's decode time compares with the baseline's on the same prompts, forward by forward.

    ``run`` and ``base`` hold totals over ``decodes`` decodes: new_tokens, target_forwards,
    draft_forwards, method_s, prefill_s, draft_s, verify_s. Each decode's prefill forward yields
    its first token, so decoding proper is the other tokens and the other target forwards (rounds).
    The baseline's mean one-token forward is the unit of cost. ``predicted_speedup_run`` is what
    the run would reach if only its forwards took time; ``efficiency`` is the share of it reached.
    """
    step = _ratio(base["verify_s"], base["target_forwards"] - decodes)
    rounds = run["target_forwards"] - decodes
    c_run = _ratio(_ratio(run["draft_s"], run["draft_forwards"]), step)
    verify_ratio = _ratio(_ratio(run["verify_s"], rounds), step)
    drafting = _ratio(run["draft_forwards"], rounds) * c_run if run["draft_forwards"] else 0.0
    predicted = _ratio(_ratio(run["new_tokens"] - decodes, rounds), drafting + verify_ratio)
    rate = _ratio(run["new_tokens"] - decodes, run["method_s"] - run["prefill_s"])
    base_rate = _ratio(base["new_tokens"] - decodes, base["method_s"] - base["prefill_s"])
    decode_speedup = _ratio(rate, base_rate)
    return {
        "decode_speedup": decode_speedup,
        "c_run": c_run,
        "verify_ratio_run": verify_ratio,
        "predicted_speedup_run": predicted,
        "efficiency": _ratio(decode_speedup, predicted),
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def iqr(values: Sequence[float]) -> float:
    """Interquartile range (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def acceptance_by_position(hist: Sequence[int]) -> list[float]:
    """How often draft position i (0-based) was accepted per verify step, from ``hist[n]`` =
    number of verify steps that accepted exactly n drafts (n = 0..K): P(accepted > i)."""
    steps = sum(hist)
    if not steps:
        return [float("nan")] * (len(hist) - 1)
    return [sum(hist[i + 1 :]) / steps for i in range(len(hist) - 1)]
