"""Two-sample tests of a law over token sequences, for ``specbench audit``.

An audit asks whether speculative sampling leaves the law of the first L sampled tokens unchanged.
It draws N continuations from the target alone (the reference arm) and N from the engine under test
(the subject arm) and compares the two samples. Past a few tokens most sampled sequences are
distinct, so they cannot be compared sequence by sequence; they are compared on the prefix tree of
the pooled samples instead. At each prefix that both arms reach, the two arms' next tokens form a
2 x m table; tokens too rare for the chi-square approximation are pooled, and Pearson's statistic is
taken (in its N - 1 form). Sequences are drawn token by token, so under the null these statistics are asymptotically
independent chi-squares given the counts at each prefix: their sum, with the summed degrees of
freedom, tests the whole sequence law, and their sum at one depth tests that position given the
tokens before it. The tests check this by simulation.

The leaves of the same tree partition the sequence space; the plug-in total-variation distance on
that partition estimates how far apart the laws are, and ``detectable_tv`` says what distance the
test would catch at this N, so that a pass means something. ``holm`` corrects a family of p-values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2

END = -1  # the outcome at every position after a sequence ended: an early stop is an outcome too


@dataclass(frozen=True)
class PositionTest:
    """The test of token ``position`` (1-based) given the tokens before it, over all prefixes tested."""

    position: int
    statistic: float
    df: int
    p: float


@dataclass(frozen=True)
class LawTest:
    """The two-sample test of the law of the first L tokens, with the TV estimate on its partition.

    ``p`` is 1 when ``df`` is 0: no prefix had two outcomes frequent enough to compare (both arms
    deterministic and identical, or too few samples), so there was nothing to test, and a p of 1
    says no more than that. ``cells`` is the number of cells of the partition the TV is taken on;
    ``nodes`` the number of prefixes that contributed degrees of freedom.

    ``tv`` is the plug-in TV between the arms' empirical laws on the partition. The partition is a
    coarsening, so its TV is at most the sequence law's; but sampling noise alone makes the plug-in
    positive, and with many small cells large: ``tv_noise`` is its mean for two samples of these
    sizes from one law (the pooled one), what identical laws would read. ``tv_low`` and ``tv_high``
    are a 95% basic bootstrap interval for the partition's TV, and ``tv_corrected`` the bootstrap's
    bias-corrected estimate (2 ``tv`` minus the resamples' mean), which lies inside it: near the noise
    floor the interval lies below the plug-in, so it is the corrected estimate that is reported beside
    it, never the plug-in alone. The interval corrects the noise bias only to
    first order, so it covers less than 95% near the noise floor (in simulation about 90% at a TV
    of twice ``tv_noise``, 70% at 0.7 times it, and at a TV of 0 from 60% with 10 cells to almost
    never with 50 or more). There ``tv`` says little, and the reading that holds is
    ``detectable_tv``: ``detectable_tv(n_reference, n_subject, df, level, power)``.
    """

    statistic: float
    df: int
    p: float
    positions: tuple[PositionTest, ...]
    cells: int
    nodes: int
    n_reference: int
    n_subject: int
    tv: float
    tv_low: float
    tv_high: float
    tv_corrected: float
    tv_noise: float
    level: float
    power: float
    detectable_tv: float


def as_outcomes(sequences: Sequence[Sequence[int]] | np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` tokens of each sequence as the rows of an int64 array, a sequence that
    ended before ``length`` padded with END."""
    if isinstance(sequences, np.ndarray) and sequences.ndim == 2:
        rows = sequences[:, :length].astype(np.int64)
        return np.pad(rows, ((0, 0), (0, length - rows.shape[1])), constant_values=END)
    rows = np.full((len(sequences), length), END, dtype=np.int64)
    for i, sequence in enumerate(sequences):
        head = np.asarray(sequence[:length], dtype=np.int64)
        rows[i, : len(head)] = head
    return rows


def _tree_tables(outcomes: np.ndarray, subject: np.ndarray, min_expected: float):
    """Walk the prefix tree of the pooled samples a depth at a time (``subject``: True for a row of
    the subject arm). Returns the chi-square statistic and df summed at each depth, the number of
    prefixes with df > 0, and each sample's leaf cell."""
    n, length = outcomes.shape
    # An outcome seen c times in the pooled sample is expected c * n_arm / n times in an arm under the
    # null. Deciding what to keep from pooled counts alone makes the tree, its cells and its df a
    # function of the pooled sample: given that, under the null the arm labels are a random
    # assignment, so the test is conditional on a fixed tree and its df carries no information about
    # the statistic. (Keeping by each prefix's own arm totals would let a chance imbalance at a prefix,
    # which raises the statistic there, prune its children's cells and so lower the df.)
    share = min(subject.sum(), n - subject.sum()) / n
    statistics, dfs = np.zeros(length), np.zeros(length, dtype=np.int64)
    node = np.zeros(n, dtype=np.int64)  # the prefix each sample still in the tree has reached
    alive = np.ones(n, dtype=bool)
    leaf = np.full(n, -1, dtype=np.int64)
    leaves, nodes_tested = 0, 0
    for depth in range(length):
        rows = np.flatnonzero(alive)
        if rows.size == 0:
            break
        _, at = np.unique(node[rows], return_inverse=True)
        k = int(at.max()) + 1
        arm = subject[rows]
        a_node, b_node = np.bincount(at[~arm], minlength=k), np.bincount(at[arm], minlength=k)
        both = (a_node > 0) & (b_node > 0)  # a prefix one arm never reached is a leaf: nothing to compare
        token = outcomes[rows, depth] - END  # >= 0
        width = int(token.max()) + 1
        pairs, pair = np.unique(at * width + token, return_inverse=True)
        p_count, pair_node = len(pairs), pairs // width
        a, b = np.bincount(pair[~arm], minlength=p_count), np.bincount(pair[arm], minlength=p_count)
        c = a + b
        kept = (c * share >= min_expected) & both[pair_node]
        other = np.bincount(pair_node[~kept], weights=c[~kept], minlength=k)
        # A rare "other" cell joins the smallest kept cell of its prefix in the table.
        kept_pairs = np.flatnonzero(kept)
        by_size = kept_pairs[np.lexsort((c[kept_pairs], pair_node[kept_pairs]))]
        first_nodes, first = np.unique(pair_node[by_size], return_index=True)
        smallest = np.full(k, -1, dtype=np.int64)
        smallest[first_nodes] = by_size[first]
        into_other = (other * share >= min_expected)[pair_node] | (smallest[pair_node] < 0)
        cell = np.where(kept, np.arange(p_count), np.where(into_other, p_count + pair_node, smallest[pair_node]))
        a_cell = np.bincount(cell, weights=a, minlength=p_count + k)
        b_cell = np.bincount(cell, weights=b, minlength=p_count + k)
        cell_node = np.concatenate([pair_node, np.arange(k)])
        used = (a_cell + b_cell > 0) & both[cell_node]
        a_used, b_used, cn = a_cell[used], b_cell[used], cell_node[used]
        an, bn = a_node[cn], b_node[cn]
        tn = an + bn
        # Pearson's statistic of a 2 x m table, (a B - b A)^2 / (A B (a + b)) summed over cells, times
        # (T - 1) / T: given the table's margins its null mean is then exactly df, where Pearson's is
        # df T / (T - 1), and summed over many small prefixes that excess made a 5% test reject up to
        # 6.7% in the tests' simulations.
        statistics[depth] = np.sum((a_used * bn - b_used * an) ** 2 / (an * bn * (a_used + b_used)) * (tn - 1) / tn)
        node_df = np.maximum(np.bincount(cn, minlength=k) - 1, 0)
        dfs[depth], nodes_tested = node_df.sum(), nodes_tested + int(np.count_nonzero(node_df))
        # Rare outcomes end their branch as one leaf per prefix (kept apart from the cell they may
        # have joined in the table, which only makes the TV partition finer). Every kept outcome,
        # including one that took in the rare ones, is a prefix of its own at the next depth.
        pooled = ~kept[pair]
        leaf[rows[pooled]] = leaves + pair_node[pair[pooled]]
        leaves += k
        alive[rows[pooled]] = False
        node[rows[~pooled]] = pair[~pooled]
    still = np.flatnonzero(alive)  # full-length sequences: a leaf each
    leaf[still] = leaves + np.unique(node[still], return_inverse=True)[1]
    return statistics, dfs, nodes_tested, np.unique(leaf, return_inverse=True)[1]


def plugin_tv(reference_counts: np.ndarray, subject_counts: np.ndarray) -> np.ndarray:
    """0.5 * sum |r/n_r - s/n_s| over the last axis: the TV between two empirical laws on the same cells."""
    r = reference_counts / reference_counts.sum(axis=-1, keepdims=True)
    s = subject_counts / subject_counts.sum(axis=-1, keepdims=True)
    return 0.5 * np.abs(r - s).sum(axis=-1)


def sequence_law_test(
    reference: Sequence[Sequence[int]] | np.ndarray,
    subject: Sequence[Sequence[int]] | np.ndarray,
    length: int,
    *,
    min_expected: float = 5.0,
    level: float = 0.05,
    power: float = 0.8,
    resamples: int = 200,
    seed: int | np.random.Generator = 0,
) -> LawTest:
    """Test whether two samples of token sequences come from one law of their first ``length``
    tokens (sequences shorter than that ended: see END), by chi-square homogeneity on the prefix
    tree, with the outcomes expected fewer than ``min_expected`` times in the smaller arm pooled.
    The TV interval and ``tv_noise`` come from ``resamples`` multinomial resamples of each arm on
    the test's partition (NaN when ``resamples`` is 0), drawn from ``seed``. ``level`` and ``power``
    set only ``detectable_tv``: pass the level each test is judged at after the family's correction."""
    ref, sub = as_outcomes(reference, length), as_outcomes(subject, length)
    n_r, n_s = len(ref), len(sub)
    if n_r == 0 or n_s == 0:
        raise ValueError("each arm needs at least one sequence")
    arm = np.repeat([False, True], [n_r, n_s])
    statistics, dfs, nodes, leaf = _tree_tables(np.concatenate([ref, sub]), arm, min_expected)
    positions = tuple(
        PositionTest(depth + 1, float(x), int(df), float(chi2.sf(x, df)) if df else 1.0)
        for depth, (x, df) in enumerate(zip(statistics, dfs, strict=True))
    )
    statistic, df = float(statistics.sum()), int(dfs.sum())
    cells = int(leaf.max()) + 1
    r_counts, s_counts = np.bincount(leaf[~arm], minlength=cells), np.bincount(leaf[arm], minlength=cells)
    tv = float(plugin_tv(r_counts, s_counts))
    tv_low = tv_high = tv_corrected = tv_noise = math.nan
    if resamples:
        rng = np.random.default_rng(seed)
        boot = plugin_tv(
            rng.multinomial(n_r, r_counts / n_r, resamples), rng.multinomial(n_s, s_counts / n_s, resamples)
        )
        # The basic (reverse percentile) interval: the plug-in's upward noise bias is about as large
        # again in the resamples, so the percentile interval sits above the plug-in's, which sits
        # above the TV, and misses a small TV nearly always. Reflecting about the plug-in removes the
        # bias to first order.
        low, high = np.quantile(boot, [0.025, 0.975])
        tv_low, tv_high = max(0.0, 2 * tv - high), min(1.0, 2 * tv - low)
        # The same correction for the point estimate. The resamples' mean lies between their 2.5% and
        # 97.5% quantiles except for a skewed few, so the clip only guards the interval's promise.
        tv_corrected = min(max(2 * tv - float(boot.mean()), tv_low), tv_high)
        pooled = (r_counts + s_counts) / (n_r + n_s)
        tv_noise = float(
            plugin_tv(rng.multinomial(n_r, pooled, resamples), rng.multinomial(n_s, pooled, resamples)).mean()
        )
    return LawTest(
        statistic=statistic,
        df=df,
        p=float(chi2.sf(statistic, df)) if df else 1.0,
        positions=positions,
        cells=cells,
        nodes=nodes,
        n_reference=n_r,
        n_subject=n_s,
        tv=tv,
        tv_low=tv_low,
        tv_high=tv_high,
        tv_corrected=tv_corrected,
        tv_noise=tv_noise,
        level=level,
        power=power,
        detectable_tv=detectable_tv(n_r, n_s, df, level, power),
    )


def detectable_tv(n_reference: int, n_subject: int, df: int, level: float, power: float = 0.8) -> float:
    """The smallest TV distance delta that the chi-square test with ``df`` degrees of freedom at
    ``level`` rejects with probability ``power`` (asymptotically), when the subject's law differs
    from the reference's by moving delta of probability between two halves of the outcome space:
    the halves have pooled probability 1/2 each, the reference puts (1 + delta)/2 on the first and
    the subject (1 - delta)/2, each spread in proportion to the pooled law within the half. Its
    noncentrality is lambda = 4 delta^2 n_r n_s / (n_r + n_s), and the power is
    P(ncx2(df, lambda) > chi2.isf(level, df)). A difference that makes the same noncentrality
    however it is spread (over tokens or positions) is detected as often. NaN when df is 0 (nothing
    tested) or when not even delta = 1 reaches the power."""
    if df < 1 or n_reference < 1 or n_subject < 1:
        return math.nan
    if not 0 < level < power < 1:
        raise ValueError(f"need 0 < level < power < 1, got level {level}, power {power}")
    critical = chi2.isf(level, df)
    effective = n_reference * n_subject / (n_reference + n_subject)

    def shortfall(delta: float) -> float:
        return ncx2.sf(critical, df, 4 * delta**2 * effective) - power

    if shortfall(1.0) < 0:
        return math.nan
    return float(brentq(shortfall, 0.0, 1.0, xtol=1e-6))


def holm(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values, in the order given: the i-th smallest is multiplied by
    (m - i + 1), made non-decreasing in that order, and capped at 1. Rejecting where an adjusted p is
    below alpha controls the family-wise error rate at alpha under any dependence."""
    p = np.asarray(pvalues, dtype=float)
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order]))
    result = np.empty_like(p)
    result[order] = adjusted
    return result
