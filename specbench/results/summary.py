"""A run's results: the row of each decode, the summary over prompts, and every file they go to.

Rows are appended and flushed as they complete (RunWriter), so an interrupted run keeps everything
it measured, and `--resume` reads them back. Every file's columns are schema.FILES'; results.json
holds the summary with its intervals for scripts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specbench.core import metrics, thinking
from specbench.core.options import FIXED
from specbench.core.thinking import Markers
from specbench.decoding.decode import DecodeResult
from specbench.decoding.timing import Phases
from specbench.engines.loop import Measurement
from specbench.methods.base import Decoder, method_label
from specbench.methods.online import Learned
from specbench.methods.registry import BASELINE
from specbench.models.costs import ForwardCosts, Roofline
from specbench.results import schema
from specbench.workloads.prompts import Turn

# What random weights make meaningless: how often random models agree, and what follows from it.
WEIGHT_DEPENDENT = (
    "alpha",
    "acceptance_rate",
    "tau",
    "predicted_speedup",
    "predicted_speedup_verify",
    *thinking.WEIGHT_DEPENDENT,
)


def _totals(m: Measurement) -> dict:
    """The figures of one decode that add up over prompts (metrics.phase_figures reads them)."""
    return {
        "new_tokens": len(m.result.tokens),
        "target_forwards": m.result.target_forwards,
        "draft_forwards": m.result.draft_forwards,
        "method_s": m.seconds,
        **{name: getattr(m.phases, name.removesuffix("_s")) for name in schema.PHASES},
    }


TOTALS = list(_totals(Measurement(DecodeResult([]), 0.0, Phases())))


@dataclass(frozen=True)
class RunColumns:
    """What every summary row repeats of its run: the models and device (``run_info``), the sampling
    options, each decoder's ``options`` column, whether the weights were random (the columns
    that depend on the weights are then left empty), and the target's ``roofline`` (None: not
    measured, the bandwidth columns left empty)."""

    run_info: dict
    sampling: dict  # temperature, top_k, top_p, eta, seed, max_new_tokens
    options: Callable[[Decoder], str]
    random_weights: bool
    roofline: Roofline | None = None

    @property
    def greedy(self) -> bool:
        return self.sampling["temperature"] == 0

    @property
    def weights_decide_acceptance(self) -> bool:
        """Whether the columns that depend on the weights (WEIGHT_DEPENDENT) are left empty: random
        weights whose drafts were verified. Under --synthetic-acceptance the rate decides them, weights or
        not (alpha is the rate), so they stay."""
        return self.random_weights and self.verified

    @property
    def verified(self) -> bool:
        """Whether drafts were verified (not kept at a --synthetic-acceptance rate): only then are a
        method's outputs the target's, to compare with the baseline's."""
        return self.sampling.get("synthetic_acceptance") is None


def record(
    turn: Turn,
    index: int,
    ids: torch.Tensor,
    baseline: Measurement,
    decoder: Decoder,
    measured: Measurement,
    learned: Learned | None = None,
    markers: Markers | None = None,
) -> dict:
    """The per-turn, per-decoder row of records.csv (the baseline has its own row, too);
    ``learned`` is what a method that learns did after the prompt; ``markers`` split its thinking
    from its answer (None: not split)."""
    b, s = baseline.result, measured.result
    method, k = decoder.method, decoder.k
    divergence = metrics.first_divergence(b.tokens, s.tokens)
    drafts = method.drafts
    rate, base_rate = len(s.tokens) / measured.seconds, len(b.tokens) / baseline.seconds
    verifying = method.verify_forwards(s.target_forwards, 1)
    return {
        "engine": method.engine,
        "concurrency": 1,
        "request_rate": math.inf,
        "error": "",
        "divergence": "",
        "acceptance_source": "",
        "itl_ms": "",
        "e2e_ms": 1000 * measured.seconds,
        "method": method.name,
        "k": k,
        "tree": decoder.shape,
        "k_policy": decoder.policy,
        **prompt_columns(turn, index, len(ids)),
        "baseline_tokens": len(b.tokens),
        "baseline_s": baseline.seconds,
        "baseline_tokens_per_s": base_rate,
        "spec_tokens_per_s": rate,
        "speedup": rate / base_rate,
        "alpha": s.beta_sum / s.tested if s.tested else math.nan,
        "alpha_estimate": s.accepted / s.tested if s.tested else math.nan,
        "proposable": method.proposable(decoder, b.tokens),
        "acceptance_rate": s.accepted / s.drafted if s.drafted else math.nan,
        "tau": len(s.tokens) / s.target_forwards if drafts else math.nan,
        "nodes": s.drafted / verifying if drafts and verifying else math.nan,
        # The prefill forward yields the first token; the rest share the decode time.
        "ttft_ms": 1000 * measured.phases.prefill,
        "tpot_ms": 1000 * (measured.seconds - measured.phases.prefill) / (len(s.tokens) - 1)
        if len(s.tokens) > 1
        else math.nan,
        "start_s": math.nan,
        "end_s": math.nan,
        "drafted": s.drafted,
        "drafted_per_round": s.drafted / len(s.draft_counts) if s.draft_counts else math.nan,
        "accepted": s.accepted,
        "beta_sum": s.beta_sum,
        "tested": s.tested,
        **(_inner(s, method.inner_beside) if method.inner_level else dict.fromkeys(INNER, math.nan)),
        "train_s": learned.train_s if learned else math.nan,
        "peak_memory_mb": math.nan if measured.peak_memory is None else measured.peak_memory / 1e6,
        **_totals(measured),
        **metrics.phase_figures(_totals(measured), _totals(baseline)),
        "outputs_match": divergence is None,
        "first_divergence": -1 if divergence is None else divergence,
        "accept_hist": _hist(s.accept_counts, k),  # a heuristic K may accept more than K
        "draft_hist": _hist(s.draft_counts),
        "rank_hist": " ".join(map(str, s.rank_counts)) if method.takes_tree or method.shapes_tree else "",
        **thinking.record_columns(markers, ids.tolist(), answer(measured), answer(baseline)),
    }


def answer(m: Measurement) -> thinking.Emitted:
    """What specbench's loop knows of one answer: its forwards' counts, and when each forward ended."""
    steps, tokens = m.result.steps, len(m.result.tokens)
    times = thinking.arrivals(steps, m.forward_ends, m.seconds, tokens) if steps and m.forward_ends else None
    return thinking.Emitted(m.result.tokens, steps, times)


def prompt_columns(turn: Turn, index: int, prompt_tokens: int) -> dict:
    """The columns of a row that say which prompt and turn it decoded, of any engine."""
    return {
        "prompt_id": turn.prompt.id,
        "prompt_index": index,
        "turn": turn.turn,
        "category": turn.prompt.category,
        "sub_category": turn.prompt.sub_category,
        "input_length": turn.prompt.input_length or metrics.length_class(prompt_tokens),
        "prompt_tokens": prompt_tokens,
    }


def by_group(records: list[dict], column: str, summarize) -> list[dict]:
    """categories.csv: ``summarize``'s rows over the records of each value of ``column`` (category,
    sub_category, turn or input_length), in the order they first appear, each with ``group_by`` and its
    value as ``category``; none when no record has a value there."""
    rows = []
    for value in dict.fromkeys(r[column] for r in records if r[column]):
        rows += [
            {"group_by": column, "category": value, **row}
            for row in summarize([r for r in records if r[column] == value])
        ]
    return rows


def _hist(counts: list[int], least: int = 0) -> str:
    """How many of ``counts`` are 0, 1, ... up to the largest of them and at least ``least``,
    space-separated ("" for no counts)."""
    return " ".join(str(counts.count(n)) for n in range(max([least, *counts]) + 1)) if counts else ""


def _inner(result: DecodeResult, beside: bool) -> dict:
    """The counts of a drafter's bottom level (a cascade's prompt lookup). A level ``beside`` the
    drafting model proposes to the target, so what it had accepted is what reached the output."""
    level = result.beneath
    accepted = level.kept if beside else level.accepted
    return dict(zip(INNER, (level.drafted, accepted, level.kept, level.forwards), strict=True))


INNER = ("inner_drafted", "inner_accepted", "from_inner", "inner_forwards")


def summarize(records: list[dict], costs: ForwardCosts, plan: list[Decoder], columns: RunColumns) -> list[dict]:
    """One summary row per (method, K) over the prompts measured so far, the baseline's first.

    Each row sums its prompts' totals and compares them with the baseline's on the same prompts.
    Only specbench's loop's rows (engines torch and hf): serving.summarize has vLLM's.
    """
    records = [r for r in records if r["engine"] in schema.OWN_ENGINES]
    by_method: dict[str, dict[int, dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], {})[r["prompt_index"]] = r
    rows = []
    for decoder in [Decoder(BASELINE), *plan]:
        method, k, tree, policy = decoder.method, decoder.k, decoder.shape, decoder.policy
        rs = [
            r
            for r in records
            if r["method"] == method.name and r["k"] == k and r["tree"] == tree and r["k_policy"] == policy
        ]
        if not rs:
            continue
        baselines = by_method[method.reference or BASELINE.name]  # the engine's own baseline
        own = by_method[BASELINE.name]
        run = {name: sum(r[name] for r in rs) for name in TOTALS}
        base = {name: sum(baselines[r["prompt_index"]][name] for r in rs) for name in TOTALS}
        specbench_rate = sum(own[r["prompt_index"]]["new_tokens"] for r in rs) / sum(
            own[r["prompt_index"]]["method_s"] for r in rs
        )
        tokens, seconds = run["new_tokens"], run["method_s"]
        base_tokens, base_s = base["new_tokens"], base["method_s"]
        drafts = method.drafts  # only drafting methods; the others' counts are left empty
        chain = method.chains and policy == FIXED  # the formulas of K drafts every round apply
        counted = ("drafted", "accepted", "beta_sum", "tested")
        totals = {name: sum(r[name] for r in rs) for name in counted}
        alpha = totals["beta_sum"] / totals["tested"] if totals["tested"] else math.nan
        c = method.c(costs)
        rounds = method.verify_forwards(run["target_forwards"], len(rs))
        nodes = totals["drafted"] / rounds if drafts and rounds else math.nan
        # A chain verifies K + 1 tokens a round, a tree its nodes + 1; under another policy the count varies.
        fits = not math.isnan(nodes) and (chain or bool(decoder.tree))
        verify_ratio = method.verify_ratio(costs, k if chain else round(nodes)) if fits else math.nan
        counted_rounds = sum(sum(map(int, r["draft_hist"].split())) for r in rs)
        divergences = [r["first_divergence"] for r in rs if r["first_divergence"] >= 0]
        trained = sum(r["train_s"] for r in rs) if method.learns else math.nan
        peaks = [r["peak_memory_mb"] for r in rs if not math.isnan(r["peak_memory_mb"])]
        speedup = (tokens / seconds) / (base_tokens / base_s)
        values = {
            **columns.run_info,
            **run,
            **metrics.latency_figures(rs),
            "engine": method.engine,
            "compile": columns.run_info["compile"] if method.engine == "torch" else "eager",  # hf-*: transformers' own
            "concurrency": 1,
            "request_rate": math.inf,
            "failed": 0,
            "structural": structural(rs) if columns.greedy and columns.verified else math.nan,
            "acceptance_source": "",
            "c_implied": math.nan,
            "throughput": tokens / seconds,  # one request at a time: its rate
            "throughput_speedup": speedup,
            "vs_specbench": (tokens / seconds) / specbench_rate,
            "alpha_estimate": totals["accepted"] / totals["tested"] if drafts and totals["tested"] else math.nan,
            # Over the baseline's tokens of every prompt: each prompt's share weighed by its tokens.
            "proposable": sum(r["proposable"] * r["baseline_tokens"] for r in rs)
            / sum(r["baseline_tokens"] for r in rs),
            **metrics.phase_figures(run, base, len(rs)),
            **{name: sum(r[name] for r in rs) if method.inner_level else math.nan for name in INNER},
            "method": method.name,
            "k": k,
            "tree": tree,
            "k_policy": policy,
            "options": columns.options(decoder),
            **columns.sampling,
            "num_prompts": len(rs),
            "baseline_tokens_per_s": base_tokens / base_s,
            "spec_tokens_per_s": tokens / seconds,
            "speedup": speedup,
            "train_s": trained,
            "peak_memory_mb": max(peaks, default=math.nan),
            "speedup_with_training": (tokens / (seconds + trained)) / (base_tokens / base_s),
            "alpha": alpha,
            "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else math.nan,
            "tau": tokens / run["target_forwards"] if drafts else math.nan,
            "nodes": nodes,
            "drafted_per_round": totals["drafted"] / counted_rounds if counted_rounds else math.nan,
            "c": c,
            "verify_ratio": verify_ratio,
            "predicted_speedup": metrics.predicted_speedup(alpha, c, k) if chain else math.nan,
            "predicted_speedup_verify": metrics.predicted_speedup_verify(alpha, c, k, verify_ratio)
            if chain
            else math.nan,
            **(totals if drafts else dict.fromkeys(totals, math.nan)),
            "outputs_match": sum(r["outputs_match"] for r in rs) if columns.verified else math.nan,
            "first_divergence": min(divergences, default=-1),
            **thinking.summary_columns(rs, [baselines[r["prompt_index"]] for r in rs]),
            **roofline_columns(columns.roofline, [baselines[r["prompt_index"]] for r in rs]),
        }
        if columns.weights_decide_acceptance:
            values.update(dict.fromkeys(WEIGHT_DEPENDENT, math.nan))
        rows.append({name: values[name] for name in schema.SUMMARY})
    return rows


ROOFLINE = ("copy_bandwidth_gbs", "weight_bytes", "kv_read_bytes", "baseline_mbu")


def roofline_columns(roofline: Roofline | None, baselines: list[dict]) -> dict:
    """The bandwidth columns of a summary row whose prompts the ``baselines`` records decoded: the
    bytes the baseline's decode steps read (the target's weights and the KV cache over each step's
    context) per second of its decode (prefill left out), over the copy bandwidth. Empty without a
    ``roofline``."""
    if roofline is None:
        return dict.fromkeys(ROOFLINE, math.nan)
    steps = sum(r["new_tokens"] - 1 for r in baselines if r["new_tokens"] > 0)
    seconds = sum(r["method_s"] - r["prefill_s"] for r in baselines)
    context = sum(metrics.decode_context_tokens(r["prompt_tokens"], r["new_tokens"]) for r in baselines)
    kv = metrics.ratio(roofline.kv_bytes_per_token * context, steps)
    return {
        "copy_bandwidth_gbs": roofline.bandwidth / 1e9,
        "weight_bytes": roofline.weight_bytes,
        "kv_read_bytes": kv,
        "baseline_mbu": metrics.bandwidth_utilisation(
            metrics.ratio(steps, seconds), roofline.weight_bytes + kv, roofline.bandwidth
        ),
    }


def structural(records: list[dict]) -> float:
    """How many of ``records`` diverged from their baseline where no near-tie explains it (their
    divergence column says structural); NaN when a divergence has no label (no margin was taken)."""
    diverged = [r for r in records if r["first_divergence"] >= 0]
    if any(not r["divergence"] for r in diverged):
        return math.nan
    return sum(r["divergence"] == "structural" for r in diverged)


def online_row(rec: dict, learned: Learned) -> dict:
    """online.csv: after each prompt of a method that learns, how its draft did and what it learned."""
    return {
        **{
            name: rec[name]
            for name in ("method", "k", "k_policy", "prompt_index", "prompt_id", "alpha", "acceptance_rate")
        },
        "lessons": learned.lessons,
        "updates": learned.updates,
        "train_s": learned.train_s,
    }


def acceptance_rows(records: list[dict]) -> list[dict]:
    """acceptance.csv: per method, K and tree, how often each draft depth was accepted per verify
    step (``by`` depth), and for trees which sibling an accepted node was (``by`` rank: the share of
    accepted nodes that were the 1st, 2nd, ... child of their parent)."""
    depths: dict[tuple, list[int]] = {}
    ranks: dict[tuple, list[int]] = {}
    for r in records:
        key = tuple(r[name] for name in schema.BLOCK)
        _add(depths, key, r["accept_hist"])
        _add(ranks, key, r["rank_hist"])
    rows = []
    for key, hist in sorted(depths.items(), key=str):
        row = {**dict(zip(schema.BLOCK, key, strict=True)), "verify_steps": sum(hist)}
        for i, rate in enumerate(metrics.acceptance_by_position(hist) if hist else []):
            rows.append({**row, "by": "depth", "position": i + 1, "acceptance": rate})
        for i, count in enumerate(ranks[key]):
            rows.append({**row, "by": "rank", "position": i + 1, "acceptance": count / sum(ranks[key])})
    return rows


def draft_length_rows(records: list[dict]) -> list[dict]:
    """draft_lengths.csv: per method, K, tree and policy of specbench's loop, how many verification
    rounds drafted each number of tokens (a number no round drafted has no row)."""
    hists: dict[tuple, list[int]] = {}
    for r in records:
        if r["draft_hist"]:  # the rows that drafted in specbench's loop
            _add(hists, tuple(r[name] for name in DRAFT_KEY), r["draft_hist"])
    return [
        {**dict(zip(DRAFT_KEY, key, strict=True)), "drafted": drafted, "rounds": rounds}
        for key, hist in hists.items()
        for drafted, rounds in enumerate(hist)
        if rounds
    ]


DRAFT_KEY = ("method", "k", "tree", "k_policy")


def _add(hists: dict[tuple, list[int]], key: tuple, cell: str) -> None:
    """Add a records.csv histogram cell ("3 0 2": counts of 0, 1, 2) to ``hists[key]``."""
    counts = [int(x) for x in cell.split()] if cell else []
    total = hists.setdefault(key, [])
    total += [0] * (len(counts) - len(total))
    for n, count in enumerate(counts):
        total[n] += count


def predicted_by_k(alpha: float, c: float, costs: ForwardCosts) -> dict[int, float]:
    """predicted_speedup_verify at every K whose verification cost was measured (1..max K), so a
    one-K run can say whether a smaller K would have done better."""
    return {
        k: metrics.predicted_speedup_verify(alpha, c, k, costs.verify_ratio(k)) for k in range(1, max(costs.target))
    }


def predicted_rows(alphas: list[float], costs: ForwardCosts) -> list[dict]:
    """predicted.csv: the speedup an assumed alpha would give at each K whose verification cost was
    measured, from the measured forward costs (for random weights, where alpha means nothing)."""
    return [
        {
            "alpha": alpha,
            "k": k,
            "c": costs.c,
            "verify_ratio": costs.verify_ratio(k),
            "predicted_speedup": metrics.predicted_speedup(alpha, costs.c, k),
            "predicted_speedup_verify": metrics.predicted_speedup_verify(alpha, costs.c, k, costs.verify_ratio(k)),
        }
        for alpha in alphas
        for k in range(1, max(costs.target))
    ]


def _chain(row: dict) -> bool:
    """A summary row of a method that takes K (not a tree, and not one without a lookahead)."""
    return row["k"] is not None and not row["tree"]


def best_ks(summary: list[dict]) -> dict:
    """Per method with K: the best K by measured speedup and by each prediction."""
    picks: dict[str, dict] = {}
    for row in summary:
        # A server is one deployment with one K: there is no K of its to choose.
        if not _chain(row) or row["concurrency"] != 1 or row["engine"] == "server":
            continue
        if row["engine"] not in schema.OWN_ENGINES:
            row = {**row, "method": f"{row['engine']} {row['method']}"}
        if row["k_policy"] != FIXED:  # each policy has a best K of its own (heuristic: the first round's)
            row = {**row, "method": f"{row['method']} {row['k_policy']}"}
        for label, column in [
            ("measured", "speedup"),
            ("predicted", "predicted_speedup"),
            ("predicted_verify", "predicted_speedup_verify"),
        ]:
            if not math.isnan(row[column]):
                picks.setdefault(row["method"], {}).setdefault(label, {"by_k": {}})["by_k"][row["k"]] = row[column]
    for by_label in picks.values():
        for pick in by_label.values():
            pick["k"] = metrics.best_k(pick["by_k"])
            pick["speedup"] = pick["by_k"][pick["k"]]
    return picks


def suggestions(summary: list[dict], costs: ForwardCosts, ks: list[int]) -> list[str]:
    """After a one-K run: where the measured alpha and costs predict a better K, say so, with the run
    that measures both; where they predict no K above the baseline, say that instead."""
    if len(ks) != 1:
        return []
    lines = []
    for row in summary:
        if math.isnan(row["predicted_speedup"]) or math.isnan(row["c"]):  # no fixed chain, or nothing to predict from
            continue
        by_k = predicted_by_k(row["alpha"], row["c"], costs)
        best = metrics.best_k(by_k)
        said = f"{row['method']}: at this alpha and the measured forward costs"
        if by_k[best] < 1:
            lines.append(f"{said}, no K predicts a speedup: the best, K={best}, predicts {by_k[best]:.2f}x")
        elif best != ks[0]:
            lines.append(
                f"{said}, K={best} predicts {by_k[best]:.2f}x against {by_k[ks[0]]:.2f}x at K={ks[0]}: "
                f"`specbench run --k {','.join(map(str, sorted({ks[0], best})))}` measures both"
            )
    return lines


MBU_FLOOR = 0.5  # below this share of the copy bandwidth the baseline's steps are not bound by memory


def bandwidth_notes(summary: list[dict], graphs_option: bool) -> list[str]:
    """A line when the baseline of specbench's loop reads its weights at under MBU_FLOOR of the copy
    bandwidth: its speedups are then those of a loop bound by launches and Python, not of the pair.
    On CUDA, where the run's forward was not graphed, it points at --graphs (``graphs_option``: the
    option exists). Another above 100%, which most often means the copy was timed slow."""
    row = next((r for r in summary if r.get("engine") == "torch" and r["method"] == BASELINE.name), None)
    if row is None or missing(row.get("baseline_mbu")):
        return []
    if row["baseline_mbu"] > 1:  # faster than a copy: most often the copy was timed while the cores were busy
        return [
            f"the baseline read the target's weights and KV cache at {row['baseline_mbu']:.1%} of the copy bandwidth "
            f"measured in this run ({row['copy_bandwidth_gbs']:.1f} GB/s), faster than a copy: most often that copy "
            "was timed slow (a busy machine, or more torch threads than free cores), and baseline_mbu overstates; "
            "measure it on a quiet machine"
        ]
    if row["baseline_mbu"] >= MBU_FLOOR:
        return []
    line = (
        f"the baseline reads the target's weights and KV cache at {row['baseline_mbu']:.1%} of the copy bandwidth "
        f"measured in this run ({row['copy_bandwidth_gbs']:.1f} GB/s): its steps are bound by what each operation "
        "costs beside the bytes (kernel launches, dispatch, Python, kernels short of the memory's speed), so c, the "
        "verify ratio and the speedups are those of a launch-bound loop, not of the pair"
    )
    if graphs_option and str(row.get("device", "")).startswith("cuda") and row.get("compile") != "graphs":
        line += "; on CUDA, --graphs replays the forwards as CUDA graphs, without a launch per operation"
    return [line]


DRIFT = 2.0  # the baseline's steps this many times the forward measured before them, or a part of it


def drift_notes(summary: list[dict], costs: ForwardCosts) -> list[str]:
    """A line when the baseline's decode of specbench's loop took a token in over DRIFT times the
    one-token forward that the forward costs measured before it, or under 1/DRIFT of it: c, the verify
    ratio and the predictions rest on that forward, so one of the two was timed on a machine that
    changed (or, much slower in the run, the loop pays more around each forward than the forward)."""
    row = next((r for r in summary if r.get("engine") == "torch" and r["method"] == BASELINE.name), None)
    if row is None or missing(row.get("tpot_p50_ms")) or costs is None:
        return []
    measured = costs.target[1].seconds * 1e3
    drift = row["tpot_p50_ms"] / measured
    said = (
        f"the baseline's decode took {row['tpot_p50_ms']:.1f} ms a token (median over prompts), {{}} the one-token "
        f"forward measured before it ({measured:.1f} ms, verify_cost.csv), on which c, the verify ratio and the "
        "predictions rest: "
    )
    if drift > DRIFT:
        return [
            said.format(f"{drift:.1f}x")
            + "the machine got busier while it ran, or the loop pays more around each forward than the forward "
            "(a very small model); c_run and verify_ratio_run (--wide) are timed in the run itself"
        ]
    if drift < 1 / DRIFT:
        return [
            said.format(f"1/{1 / drift:.1f} of")
            + "the machine was busier while the costs were measured; rerun on a quiet machine"
        ]
    return []


def missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def row_label(row: dict) -> str:
    """The label of the decoder that wrote a row (methods.base.method_label), its empty cells read as NaN or None."""
    tree, policy = row.get("tree"), row.get("k_policy")
    return method_label(
        row["method"],
        None if missing(row["k"]) else int(row["k"]),
        tree if isinstance(tree, str) else "",
        policy if isinstance(policy, str) else "",
    )


def decoder_label(row: dict) -> str:
    """A summary row's decoder in one label: the engine when not specbench's own, the method with
    its K, tree and policy, and the requests in flight when more than one."""
    label = row_label(row)
    if row.get("engine") not in (None, *schema.OWN_ENGINES):
        label = f"{row['engine']} {label}"
    return f"{label} x{int(row['concurrency'])}" if (row.get("concurrency") or 1) > 1 else label


def results_document(
    meta: dict,
    summary: list[dict],
    records: list[dict],
    categories: list[dict] = (),
    group_by: str = "category",
    confidence: float = 0.95,
) -> dict:
    """results.json: the run's configuration, machine and versions (meta.json's), its summary rows
    and its per-category rows (categories.csv's), each rate with a bootstrap interval over the
    prompts (``<metric>_ci``: [low, high])."""

    def with_intervals(row: dict, rows: list[dict]) -> dict:
        same = [r for r in rows if all(r[key] == row[key] for key in schema.BLOCK)]
        intervals = {}
        if len(same) > 1:
            for metric, parts in schema.RATES.items():
                intervals[f"{metric}_ci"] = list(
                    metrics.rate_interval(np.array([[r[c] for c in parts] for r in same]), confidence)
                )
        return {**{name: _json_value(v) for name, v in row.items()}, **intervals}

    grouped = [with_intervals(row, [r for r in records if r[group_by] == row["category"]]) for row in categories]
    return {
        "format": schema.RESULTS_FORMAT,
        "specbench": meta["specbench"],
        "versions": {name: meta[name] for name in ("python", "torch", "transformers")},
        "machine": meta["machine"],
        "config": meta["config"],
        "resolved": meta["resolved"],
        "confidence": confidence,
        "summary": [with_intervals(row, records) for row in summary],
        "categories": grouped,
    }


def _json_value(value):
    """NaN, which JSON lacks, as null."""
    return None if isinstance(value, float) and math.isnan(value) else value
