"""The speedup theory and the summary statistics, as pure functions."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

import numpy as np


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


def unbounded_optimal_k(alpha: float, c: float, limit: int = 10_000) -> tuple[int, float] | None:
    """The K with the highest predicted_speedup over every K >= 1, or None when the speedup grows
    without end (c = 0, or alpha = 1 with c < 1) or peaks beyond ``limit``.

    E[tokens] is concave in K and K c + 1 affine, so their ratio rises to one peak and then falls:
    the first K whose successor is no better is the optimum (the smaller K on a tie)."""
    if c == 0 or (alpha == 1 and c < 1):
        return None
    for k in range(1, limit + 1):
        if predicted_speedup(alpha, c, k + 1) <= predicted_speedup(alpha, c, k):
            return k, predicted_speedup(alpha, c, k)
    return None


def max_useful_c(alpha: float, ks: Iterable[int]) -> float:
    """The largest cost ratio c for which some K still gives a predicted speedup above 1.

    speedup > 1  <=>  c < (E[tokens] - 1) / K = (alpha + ... + alpha^K) / K, which is largest at
    the smallest K (at K = 1 it is alpha itself).
    """
    return max((expected_tokens(alpha, k) - 1.0) / k for k in ks)


def ratio(a: float, b: float) -> float:
    """a / b, NaN where b is 0 (or where either is NaN)."""
    return a / b if b else math.nan


def decode_context_tokens(prompt_tokens: int, new_tokens: int) -> int:
    """The tokens of KV cache a decode's one-token steps attend over, summed over its steps: the step
    that yields token j (j = 2..N; the prefill yields the first) attends over the prompt's P tokens
    and the j - 1 after them, its own input included: (N - 1) P + N (N - 1) / 2 in all."""
    steps = max(new_tokens - 1, 0)
    return steps * prompt_tokens + steps * (steps + 1) // 2


def bandwidth_utilisation(tokens_per_s: float, bytes_per_token: float, bandwidth: float) -> float:
    """Model bandwidth utilisation (MBU): the bytes a decode reads per second, tokens/s x the bytes
    each token's step reads, over the bytes per second a copy moves on the same device. NaN where
    the bandwidth is 0 or unknown."""
    return ratio(tokens_per_s * bytes_per_token, bandwidth)


def phase_figures(run: Mapping[str, float], base: Mapping[str, float], decodes: int = 1) -> dict[str, float]:
    """How a run's decode time compares with the baseline's on the same prompts, forward by forward.

    ``run`` and ``base`` hold totals over ``decodes`` decodes: new_tokens, target_forwards,
    draft_forwards, method_s, prefill_s, draft_s, inner_s, retokenize_s, verify_s. Each decode's prefill forward
    yields its first token, so decoding proper is the other tokens and the other target forwards
    (rounds). The baseline's mean one-token forward is the unit of cost. ``predicted_speedup_run``
    is what the run would reach if only its drafting levels and forwards took time; ``efficiency``
    is the share of it reached.
    """
    step = ratio(base["verify_s"], base["target_forwards"] - decodes)
    rounds = run["target_forwards"] - decodes
    c_run = ratio(ratio(run["draft_s"], run["draft_forwards"]), step)
    verify_ratio = ratio(ratio(run["verify_s"], rounds), step)
    # Drafting per round, in target steps: the draft model's forwards, any level beneath it, and the
    # conversions of a draft with its own vocabulary.
    spent = run["draft_s"] + run["inner_s"] + run.get("retokenize_s", 0.0)
    drafting = ratio(ratio(spent, rounds), step) if run["draft_forwards"] else 0.0
    predicted = ratio(ratio(run["new_tokens"] - decodes, rounds), drafting + verify_ratio)
    rate = ratio(run["new_tokens"] - decodes, run["method_s"] - run["prefill_s"])
    base_rate = ratio(base["new_tokens"] - decodes, base["method_s"] - base["prefill_s"])
    decode_speedup = ratio(rate, base_rate)
    return {
        "decode_speedup": decode_speedup,
        "c_run": c_run,
        "verify_ratio_run": verify_ratio,
        "predicted_speedup_run": predicted,
        "efficiency": ratio(decode_speedup, predicted),
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


def first_divergence(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """The first index where two outputs differ, counting a length difference; None when equal."""
    found = next((i for i, (x, y) in enumerate(zip(reference, tokens, strict=False)) if x != y), None)
    if found is None and len(reference) != len(tokens):
        found = min(len(reference), len(tokens))
    return found


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of the values, NaN for none (linear interpolation, as numpy)."""
    kept = [v for v in values if v == v]
    return float(np.percentile(kept, q)) if kept else float("nan")


# The latencies a summary row gives percentiles of (metrics.latency_figures), and the percentiles.
LATENCIES = {
    "ttft": "time to first token",
    "tpot": "time per output token",
    "itl": "the gaps between chunks (pooled over the requests)",
    "e2e": "end-to-end latency",
}
PERCENTILES = (50, 90, 99)


def latency_figures(rs: list[dict]) -> dict:
    """Percentiles of each latency over the requests (schema.LATENCIES); the chunk gaps pooled over
    every request, as serving benchmarks report them."""
    figures = {}
    for name in LATENCIES:
        if name == "itl":
            values = [float(v) for r in rs for v in str(r.get("itl_ms") or "").split()]
        else:
            values = [r.get(f"{name}_ms", float("nan")) for r in rs]
        figures.update({f"{name}_p{q}_ms": percentile(values, q) for q in PERCENTILES})
    return figures


def implied_c(tau: float, speedup: float, k: int) -> float:
    """The cost ratio c that, with the measured tau as the tokens per round, makes the formula
    tau / (K c + 1) give the measured speedup: (tau / speedup - 1) / K."""
    return (tau / speedup - 1) / k if k and speedup > 0 else float("nan")


def rate_of_sums(parts: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """sum(numerator) / sum(denominator) over prompts, as the summary sums tokens/s; with four columns
    (numerator, denominator, reference numerator, reference denominator) that rate over the
    reference's, as the summary sums speedup. ``parts`` has a row per prompt; ``weights`` a row per
    bootstrap resample, how many times each prompt was drawn (default: each once)."""
    sums = (np.ones(len(parts)) if weights is None else weights) @ parts
    rate = sums[..., 0] / sums[..., 1]
    return rate / (sums[..., 2] / sums[..., 3]) if parts.shape[1] == 4 else rate


@functools.lru_cache(maxsize=16)
def _resampled(n: int, resamples: int, seed: int) -> np.ndarray:
    """Bootstrap weights: per resample, how many times each of ``n`` prompts was drawn. Kept, read-only:
    every row and metric of a comparison over the same prompts draws the same resamples."""
    weights = np.random.default_rng(seed).multinomial(n, np.full(n, 1 / n), size=resamples)
    weights.flags.writeable = False
    return weights


def rate_interval(
    parts: np.ndarray, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """The percentile bootstrap interval over prompts of rate_of_sums(parts) (a row per prompt)."""
    parts = np.asarray(parts, dtype=float)
    rates = rate_of_sums(parts, _resampled(len(parts), resamples, seed))
    low, high = np.quantile(rates, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def paired_change(
    base: np.ndarray, cur: np.ndarray, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """The relative change cur / base - 1 of rate_of_sums between two runs, with the percentile
    interval of a paired bootstrap. Row i of ``base`` and ``cur`` is the same prompt. Each resample
    draws prompts with replacement, the same draw for both runs, so a prompt that is slow in both
    (a long answer) moves both sums alike and what spreads the interval is how the runs differ."""
    base, cur = np.asarray(base, dtype=float), np.asarray(cur, dtype=float)
    weights = _resampled(len(base), resamples, seed)
    changes = rate_of_sums(cur, weights) / rate_of_sums(base, weights) - 1
    low, high = np.quantile(changes, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(rate_of_sums(cur) / rate_of_sums(base) - 1), float(low), float(high)


def wins_from(by_context: Mapping[int, float], threshold: float = 1.0) -> int | None:
    """The shortest context length from which a speedup (context -> speedup) stays above
    ``threshold`` at every longer context measured; None when it is not above it at the longest."""
    shortest = None
    for context in sorted(by_context, reverse=True):
        if not by_context[context] > threshold:  # NaN never wins
            break
        shortest = context
    return shortest


def length_class(tokens: int, least: int = 128) -> str:
    """A prompt length's class: the power of two it fits in (at least ``least``), as 128, 256, 512,
    1k, 2k, ...; prompts of one class compare with SPEED-Bench's configured input lengths."""
    bound = max(least, 1 << max(tokens - 1, 0).bit_length())
    return f"{bound // 1024}k" if bound >= 1024 else str(bound)
