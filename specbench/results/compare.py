"""Compare two benchmark runs and flag regressions (`specbench compare`).

A timing metric the summary sums over prompts (speedup, tokens/s) is judged on a paired-bootstrap
interval of its change when both runs kept their records.csv: it regresses only when the whole
interval lies beyond the tolerance. Timing metrics are judged only between runs whose meta.json holds
the same machine fingerprint; elsewhere they are "not comparable". (Without a fingerprint, in runs
older than it, ratios within a run such as speedup are still judged.) A baseline may be a directory of
runs, one per machine: the one measured on the current run's machine is used.

A metric of which no row was judged (ok, regressed or improved) is "not judged": a gate on it would
pass whatever the code did, so it fails with its own exit code unless allow_unjudged, and is shown
either way. Exit code 0: nothing regressed, every baseline row was found again (rows only in the
current run are "new") and every metric was judged, or allowed not to be; 1: a metric regressed or a
baseline row or value is gone, since a benchmark that stops measuring something must not pass (1
wins over 3); 2: unusable input (SpecbenchError, which the CLI prints as one line); 3: a metric
could not be judged on any row.
"""

import json
from collections import namedtuple

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from specbench.core.errors import SpecbenchError
from specbench.core.files import write_text
from specbench.core.metrics import paired_change, rate_of_sums
from specbench.results import schema
from specbench.results.rundir import (
    DECODER,
    METRICS,
    REQUIRED_KEYS,
    cell_text,
    has_categories,
    load_machine,
    load_records,
    load_summary,
    pick_baseline,
)

OPTIONAL_KEYS = [
    "engine",
    "concurrency",
    "request_rate",
    "tree",
    "k_policy",
    "options",
    "eta",
    "max_new_tokens",
    "num_prompts",
    "seed",
    *schema.GROUP_KEYS,  # the per-category rows, when both runs wrote categories.csv
]  # keys only when both files have them
CONTEXT = [
    "device",
    "dtype",
    "compile",
]  # not keys, so CI and a laptop still match on alpha; but timings become incomparable
RELATIVE = {c.name for c in schema.COLUMNS if c.kind == schema.TIMING}  # noisy, so judged with a relative tolerance
PER_PROMPT = schema.RATES  # rates whose change gets a paired-bootstrap interval over the prompts
# Seconds and tokens/s depend on the machine as much as on the code; ratios within a run do much less.
ABSOLUTE = set(schema.ABSOLUTE)
OK, REGRESSED, IMPROVED, MISSING, NEW, SKIPPED = "ok", "regressed", "improved", "missing", "new", "skipped"
NOT_COMPARABLE = "not comparable"
FAILING = {REGRESSED, MISSING}
JUDGED = [OK, REGRESSED, IMPROVED, NOT_COMPARABLE]  # the statuses that compared two values
VERDICTS = [OK, REGRESSED, IMPROVED]  # the statuses that held a value to the tolerance
PASSED, FAILED, UNJUDGED = 0, 1, 3  # exit codes (2, unusable input, is the CLI's for a SpecbenchError)
STATUS_STYLES = {
    OK: "green",
    REGRESSED: "bold red",
    IMPROVED: "cyan",
    MISSING: "bold red",
    NEW: "blue",
    SKIPPED: "dim",
    NOT_COMPARABLE: "yellow",
}
BOOTSTRAP, POINT = "paired bootstrap", "point"
EMPTY = pd.DataFrame(index=pd.Index([], name="prompt_index"))  # a decoder a run's records.csv does not hold
_EPS = 1e-9  # 0.99 / 1.1 - 1 is -0.10000000000000009: a change of exactly the tolerance must stay ok

# change: relative for timings; ci_low, ci_high: the interval of that change over `prompts` paired prompts.
MetricVerdict = namedtuple(
    "MetricVerdict",
    "metric baseline current change status ci_low ci_high prompts test",
    defaults=(None, None, None, None),
)
RowVerdict = namedtuple("RowVerdict", "key label status metrics")
# Metrics of which no row was judged, why, and what would let them be.
Unjudged = namedtuple("Unjudged", "metrics reason fix")
# Its fields come in the order of the JSON report.
Comparison = namedtuple(
    "Comparison",
    "baseline current tolerance abs_tolerance confidence metrics key_columns notes unjudged allow_unjudged rows "
    "exit_code",
)


def _differing(baseline: pd.DataFrame, current: pd.DataFrame, column: str) -> str | None:
    """ "a vs b" when both files have the column and its values differ; a blank is unknown, not different."""
    before, after = (", ".join(sorted({cell_text(v) for v in df.get(column, [])} - {""})) for df in (baseline, current))
    return f"{before} vs {after}" if before and after and before != after else None


def _decoder(df: pd.DataFrame, keys: list[str]) -> pd.Series:
    """Each row's method, k, tree and policy as text, of those in ``keys`` (the columns both runs
    have): what ties a summary row to its records."""
    labels = [" ".join(f"{c}={cell_text(row[c])}" for c in DECODER if c in keys) for row in df.to_dict("records")]
    return pd.Series(labels, index=df.index, dtype=object)


def _choose_metrics(baseline: pd.DataFrame, current: pd.DataFrame, metrics: list[str] | None) -> list[str]:
    shared = [m for m in schema.GATED if m in baseline.columns and m in current.columns]
    if not (chosen := list(dict.fromkeys(metrics or shared))):
        raise SpecbenchError(
            f"the two summaries share none of the metrics {', '.join(schema.GATED)}; compare files written by `specbench run`"
        )
    if unknown := [m for m in chosen if m not in METRICS]:
        raise SpecbenchError(f"unknown metric {', '.join(unknown)}; choose from {', '.join(METRICS)}")
    if absent := [
        (name, m) for name, df in (("baseline", baseline), ("current", current)) for m in chosen if m not in df
    ]:
        raise SpecbenchError(
            f"the {absent[0][0]} summary has no column {absent[0][1]}; drop that --metric or regenerate the file"
        )
    return chosen


def _normalised(baseline: pd.DataFrame, current: pd.DataFrame, keys: list[str]) -> list[pd.DataFrame]:
    """Both frames with keys that match across files: 4, 4.0 and "4" are equal, and blanks equal blanks."""
    both = pd.concat([baseline, current], keys=[0, 1])  # so that a column gets the same type in both files
    for column in keys:
        try:
            both[column] = pd.to_numeric(both[column])
        except (ValueError, TypeError):
            both[column] = both[column].map(cell_text)
    try:
        both["k"] = both["k"].astype("Int64")  # blank for methods without K (0 in hand-made files)
    except (ValueError, TypeError):
        raise SpecbenchError("column k holds values that are not whole numbers; fix or regenerate the file") from None
    return [both.loc[0], both.loc[1]]


def _interval(records: list, decoder: str, metric: str, values: list[float], confidence: float) -> tuple:
    """(ci_low, ci_high, prompts, why there is no interval: "" when there is one) of the relative
    change of ``metric`` on one summary row, whose values in the two summaries are ``values``.
    ``records``: each run's records by decoder, indexed by prompt (None: the run has no records.csv)."""
    if metric not in PER_PROMPT:
        return None, None, None, f"{metric} is not a rate summed over prompts"
    if absent := [name for name, df in zip(("baseline", "current"), records, strict=True) if df is None]:
        return None, None, None, f"no records.csv in the {' and '.join(absent)} run"
    base, cur = (by_decoder.get(decoder, EMPTY) for by_decoder in records)
    shared = base.index.intersection(cur.index).sort_values()
    if len(shared) < 2:
        return None, None, len(shared), f"{len(shared)} prompt(s) in both runs' records.csv, too few to resample"
    parts = [df.loc[shared, PER_PROMPT[metric]].to_numpy(float) for df in (base, cur)]
    # Stale or foreign records would lend the summary's values an interval that is not theirs.
    if not np.allclose([rate_of_sums(p) for p in parts], values, rtol=1e-6):
        return None, None, len(shared), "records.csv does not reproduce summary.csv over the shared prompts"
    _, low, high = paired_change(*parts, confidence)
    return low, high, len(shared), ""


def _intervals(merged: pd.DataFrame, metric: str, compared: pd.Series, records: list, confidence: float):
    """_interval on every compared row, as the columns "<metric> ci_low", "ci_high", "prompts", "why"."""
    values = merged[[f"{metric} base", f"{metric} cur"]].to_numpy(float)
    intervals = [
        _interval(records, decoder, metric, list(pair), confidence) if judge else (None, None, None, "")
        for decoder, judge, pair in zip(merged["_decoder"], compared, values, strict=True)
    ]
    columns = [f"{metric} {name}" for name in ("ci_low", "ci_high", "prompts", "why")]
    return pd.DataFrame(intervals, index=merged.index, columns=columns)


def _judge(
    merged: pd.DataFrame, side: pd.Series, incomparable: pd.Series, metric: str, tolerance: float, abs_tolerance: float
):
    """The status and change of one metric on every merged row (``side``: MISSING, NEW or "" per row;
    ``incomparable``: rows whose values measure different machines)."""
    base, cur = merged[f"{metric} base"].astype(float), merged[f"{metric} cur"].astype(float)
    if metric in RELATIVE:
        change, width = (cur / base - 1).where(base != 0), tolerance
        # Where the prompts gave an interval, all of it must lie beyond the tolerance: noise that
        # might explain the change does not fail a build.
        low, high = merged[f"{metric} ci_low"].fillna(change), merged[f"{metric} ci_high"].fillna(change)
    else:
        change = low = high = cur - base
        width = abs_tolerance
    below, above = high < -width - _EPS, low > width + _EPS
    worse, better = (below, above) if schema.BY_NAME[metric].better == schema.HIGHER else (above, below)
    # The first true condition wins: a row gone from the current run is missing whatever its baseline held,
    # and a baseline without a value (alpha of the baseline method) holds the current run to nothing.
    status = np.select(
        [side != "", base.isna(), cur.isna(), incomparable, worse, better],
        [side, SKIPPED, MISSING, NOT_COMPARABLE, REGRESSED, IMPROVED],
        OK,
    )
    return status, change.where(np.isin(status, JUDGED))


def _machine_difference(machines: tuple) -> str:
    """Why the absolute timings of two runs cannot be compared; "" when their fingerprints are equal."""
    if absent := [name for name, m in zip(("baseline", "current"), machines, strict=True) if not m]:
        return f"no machine fingerprint in the {' and '.join(absent)} run's meta.json"
    base, cur = machines
    differ = [
        f"{k} {base.get(k)} vs {cur.get(k)}" for k in sorted(base.keys() | cur.keys()) if base.get(k) != cur.get(k)
    ]
    return f"the machines differ: {', '.join(differ)}" if differ else ""


def _unjudged(merged: pd.DataFrame, chosen: list[str], elsewhere: str, unlike: set) -> list[Unjudged]:
    """The chosen metrics of which no row was held to the tolerance, grouped by why."""
    causes = {}
    for m in chosen:
        if merged[f"{m} status"].isin(VERDICTS).any():
            continue
        if elsewhere.startswith("no machine") and m in unlike:  # runs older than the fingerprint
            cause = elsewhere, "record that run again with this specbench, or pass --allow-unjudged"
        elif elsewhere and m in unlike:
            cause = (
                f"no baseline from this machine ({elsewhere})",
                "run `make baseline` on this machine, or pass --allow-unjudged",
            )
        else:
            cause = (
                "no row holds a value in both runs",
                "compare runs that measure it, drop that --metric, or pass --allow-unjudged",
            )
        causes.setdefault(cause, []).append(m)
    return [Unjudged(ms, *cause) for cause, ms in causes.items()]


def compare_frames(
    baseline,
    current,
    tolerance=0.10,
    abs_tolerance=0.01,
    metrics=None,
    baseline_name="",
    current_name="",
    records=(None, None),
    machines=(None, None),
    confidence=0.95,
    allow_unjudged=False,
):
    """Match the rows of two summary frames on configuration and judge each metric (a list of names,
    default schema.GATED); the names label the files in messages. ``records``: the runs' records.csv
    frames (load_records), which give timing changes a ``confidence`` interval; ``machines``: their
    fingerprints (load_machine), without which absolute timings are not judged. A metric judged on no
    row sets exit code 3 unless ``allow_unjudged``. Returns a Comparison. No I/O."""
    if not (0 <= tolerance < 1 and abs_tolerance >= 0 and 0 < confidence < 1):
        raise SpecbenchError(
            f"--tolerance {tolerance} must lie in [0, 1), --abs-tolerance {abs_tolerance} be >= 0 "
            f"and --confidence {confidence} lie in (0, 1)"
        )
    if hashes := _differing(baseline, current, "prompts_hash"):
        raise SpecbenchError(
            f"the two runs decoded different prompts (prompts_hash {hashes}): a changed dataset, "
            "template or tokenizer makes them incomparable; rerun the baseline"
        )
    chosen = _choose_metrics(baseline, current, metrics)
    keys = REQUIRED_KEYS + [c for c in OPTIONAL_KEYS if c in baseline.columns and c in current.columns]
    base, cur = _normalised(baseline[keys + chosen], current[keys + chosen], keys)
    for df, name in ((base, baseline_name), (cur, current_name)):
        if len(twice := df[df.duplicated(keys)]):
            shown = ", ".join(f"{c}={cell_text(twice[c].iloc[0])}" for c in keys)
            raise SpecbenchError(f"{name or 'a summary'} has more than one row for {shown}; keep one per configuration")
    ordered = base.assign(_base_order=range(len(base))), cur.assign(_cur_order=range(len(cur)))
    merged = pd.merge(*ordered, how="outer", on=keys, validate="one_to_one", indicator=True, suffixes=(" base", " cur"))
    if not (merged["_merge"] == "both").any():
        raise SpecbenchError(
            f"no row of the current run matches a baseline row on {', '.join(keys)}; "
            "run the same configuration as the baseline"
        )
    merged = merged.sort_values(["_base_order", "_cur_order"], ignore_index=True)  # baseline rows, then new ones
    merged["_decoder"] = _decoder(merged, keys)
    side = merged["_merge"].map({"left_only": MISSING, "right_only": NEW, "both": ""}).astype(str)
    note = "{} differs ({}): timing metrics are not comparable; restrict with --metric alpha --metric tau"
    notes = [note.format(c, values) for c in CONTEXT if (values := _differing(baseline, current, c))]
    elsewhere = _machine_difference(machines)
    # Known to be other machines: every timing moves with the hardware, ratios too (speedup at K=2 was
    # 1.57 on a 2-core Intel Xeon and 0.89 on a 2-core AMD EPYC, whose 3-row matrix products cost more).
    # Not known (no fingerprint): ratios within a run are still judged, absolute timings not.
    # Efficiency, the run's speedup over what its own forwards predict, is judged anywhere: the machine's
    # speed cancels out of it, so a loop that got slower fails it on any runner.
    unlike = (ABSOLUTE if elsewhere.startswith("no machine fingerprint") else RELATIVE) - set(schema.PORTABLE)
    # Each run's records split by decoder once: every row and metric's interval reads its own.
    records = [
        None
        if df is None
        else {d: rows.set_index("prompt_index") for d, rows in df.assign(decoder=_decoder(df, keys)).groupby("decoder")}
        for df in records
    ]
    gaps = {}  # (why, rows without an interval, rows compared) -> the metrics without one
    for m in chosen:
        incomparable = pd.Series(bool(elsewhere) and m in unlike, index=merged.index)
        compared = (side == "") & merged[f"{m} base"].notna() & merged[f"{m} cur"].notna() & ~incomparable
        if m in RELATIVE:
            merged = merged.join(_intervals(merged, m, compared, records, confidence))
            for why, n in merged.loc[merged[f"{m} why"] != "", f"{m} why"].value_counts(sort=False).items():
                gaps.setdefault((why, n, compared.sum()), []).append(m)
        merged[f"{m} status"], merged[f"{m} change"] = _judge(merged, side, incomparable, m, tolerance, abs_tolerance)
    notes += [
        f"{', '.join(ms)}: no {confidence * 100:g}% interval{'' if n == total else f' on {n} of {total} rows'} "
        f"({why}); judged on the point values with the ±{tolerance:.0%} tolerance"
        for (why, n, total), ms in gaps.items()
    ]
    statuses = merged[[f"{m} status" for m in chosen]]
    failing, improved = statuses.isin(FAILING).any(axis=1), (statuses == IMPROVED).any(axis=1)
    merged["_status"] = np.select([side != "", failing, improved], [side, REGRESSED, IMPROVED], OK)
    # Short row labels: only the key columns that vary, always with k and method.
    shown = [c for c in keys if c in ("k", "method") or merged[c].nunique(dropna=False) > 1]
    rows = [
        RowVerdict(
            {c: r[c] for c in keys},
            " ".join(f"{c}={cell_text(r[c])}" for c in shown),
            r["_status"],
            [_metric_verdict(m, r) for m in chosen],
        )
        for r in merged.astype(object).where(merged.notna(), None).to_dict("records")
    ]
    unjudged = _unjudged(merged, chosen, elsewhere, unlike)
    failed = any(row.status in FAILING for row in rows)
    exit_code = FAILED if failed else UNJUDGED if unjudged and not allow_unjudged else PASSED
    return Comparison(
        baseline_name,
        current_name,
        tolerance,
        abs_tolerance,
        confidence,
        chosen,
        keys,
        notes,
        unjudged,
        allow_unjudged,
        rows,
        exit_code,
    )


def _metric_verdict(metric: str, row: dict) -> MetricVerdict:
    """One metric of a merged row (NaN already None), with the test that judged it."""
    low, prompts, status = row.get(f"{metric} ci_low"), row.get(f"{metric} prompts"), row[f"{metric} status"]
    test = None if status not in (OK, REGRESSED, IMPROVED) else POINT if low is None else BOOTSTRAP
    return MetricVerdict(
        metric,
        row[f"{metric} base"],
        row[f"{metric} cur"],
        row[f"{metric} change"],
        status,
        low,
        row.get(f"{metric} ci_high"),
        None if prompts is None else int(prompts),
        test,
    )


def _cell_text(m: MetricVerdict, confidence: float) -> str:
    def number(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"

    if m.status in (NEW, SKIPPED):
        return number(m.current)
    if m.change is None:
        change = ""
    elif m.metric not in RELATIVE:
        change = f" ({m.change:+.3f})"
    elif m.status == NOT_COMPARABLE:
        change = f" ({m.change:+.1%}, {NOT_COMPARABLE})"
    elif m.ci_low is None:
        change = f" ({m.change:+.1%})"
    else:
        verdict = ", no significant change" if m.ci_low <= 0 <= m.ci_high else ""
        interval = f"{confidence * 100:g}% CI {m.ci_low:+.1%} .. {m.ci_high:+.1%}"
        change = f" ({m.change:+.1%}, {interval}{verdict})"
    return f"{number(m.baseline)} -> {number(m.current)}{change}"


def _problem(row: RowVerdict, confidence: float) -> str:
    if row.status == MISSING:
        return f"{row.label}: missing from the current run"
    failing = [m for m in row.metrics if m.status in FAILING]
    return f"{row.label}: " + ", ".join(
        f"{m.metric} {_cell_text(m, confidence) if m.status == REGRESSED else 'no longer measured'}" for m in failing
    )


def _unjudged_line(u: Unjudged) -> str:
    return f"{', '.join(u.metrics)} NOT JUDGED: {u.reason}"


def _unjudged_notes(comparison: Comparison) -> list[Unjudged]:
    """The unjudged metrics to show beside the table: all of them, unless the verdict line is about them."""
    return [] if comparison.exit_code == UNJUDGED else comparison.unjudged


def verdict_line(comparison: Comparison) -> str:
    """One line for logs: PASS/FAIL and, on failure, each failing row and metric; when a metric was not
    judged and that fails, why and what to do."""
    if comparison.exit_code == UNJUDGED:
        return "; ".join(f"{_unjudged_line(u)}: {u.fix}" for u in comparison.unjudged)
    tol = f"tolerance {comparison.tolerance:.0%} relative, {comparison.abs_tolerance:g} absolute"
    # A verdict that is silent about an unjudged metric would read as if it had been judged.
    names = ", ".join(m for u in comparison.unjudged for m in u.metrics)
    unjudged = f"; {names} NOT JUDGED" + (" (--allow-unjudged)" if comparison.allow_unjudged else "") if names else ""
    if failures := [row for row in comparison.rows if row.status in FAILING]:
        return f"FAIL ({tol}): " + "; ".join(_problem(row, comparison.confidence) for row in failures) + unjudged
    counts = {s: sum(r.status == s for r in comparison.rows) for s in (OK, IMPROVED, NEW)}
    extra = "".join(f", {counts[s]} {s}" for s in (IMPROVED, NEW) if counts[s])
    return f"PASS ({tol}): {counts[OK] + counts[IMPROVED]} rows within tolerance{extra}{unjudged}"


def to_json(comparison: Comparison) -> dict:
    """The verdict as a JSON-ready dict."""

    def metric(m: MetricVerdict) -> dict:
        return {**m._asdict(), "change_kind": "relative" if m.metric in RELATIVE else "absolute"}

    rows = [{**row._asdict(), "metrics": {m.metric: metric(m) for m in row.metrics}} for row in comparison.rows]
    word = {PASSED: "pass", FAILED: "fail", UNJUDGED: "unjudged"}[comparison.exit_code]
    verdict = {"verdict": word, "exit_code": comparison.exit_code}
    unjudged = [u._asdict() for u in comparison.unjudged]
    return {**verdict, "summary": verdict_line(comparison), **comparison._asdict(), "unjudged": unjudged, "rows": rows}


def cells(row: RowVerdict, style, confidence: float) -> list[str]:
    """A row's label, status and metric cells, each status shown through ``style(text, status)``."""
    # A missing row is flagged once, in its status cell.
    flagged = [m.status in FAILING | {IMPROVED} and row.status != MISSING for m in row.metrics]
    metrics = [
        style(_cell_text(m, confidence), m.status if flag else None)
        for m, flag in zip(row.metrics, flagged, strict=True)
    ]
    return [style(row.label, None), style(row.status, row.status), *metrics]


def to_markdown(comparison: Comparison) -> str:
    """A Markdown table plus the verdict line, for CI logs and step summaries."""

    def style(text: str, status: str | None) -> str:
        shown = f"**{status}**" if status in FAILING else status
        return text.replace("|", "\\|") if status is None else shown if text == status else f"{text} {shown}"

    header = ["row", "status", *comparison.metrics]
    lines = ["### specbench compare", "", f"**{verdict_line(comparison)}**", "", "| " + " | ".join(header) + " |"]
    lines += ["|" + "---|" * len(header)] + [
        "| " + " | ".join(cells(row, style, comparison.confidence)) + " |" for row in comparison.rows
    ]
    lines += [line for note in comparison.notes for line in ("", f"> note: {note}")]
    lines += [line for u in _unjudged_notes(comparison) for line in ("", f"> **{_unjudged_line(u)}**")]
    return "\n".join(lines) + "\n"


def comparison_table(comparison: Comparison) -> Table:
    """The comparison on screen: a row per configuration, a column per metric, coloured by status."""
    table = Table("row", "status", title="specbench compare: baseline -> current")
    for m in comparison.metrics:
        band = f"±{comparison.tolerance:.0%}" if m in RELATIVE else f"±{comparison.abs_tolerance:g}"
        table.add_column(f"{m} ({band})", justify="right")
    for row in comparison.rows:
        statuses = [row.status, row.status, *(m.status for m in row.metrics)]
        styled = zip(cells(row, lambda text, _: text, comparison.confidence), statuses, strict=True)
        table.add_row(*(f"[{STATUS_STYLES[status]}]{cell}[/]" for cell, status in styled))
    return table


def print_comparison(console: Console, comparison: Comparison) -> None:
    """The table, its notes, any metric not judged, and the verdict line."""
    console.print(comparison_table(comparison))
    for note in comparison.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    for u in _unjudged_notes(comparison):
        console.print(_unjudged_line(u), style="bold yellow", highlight=False, markup=False, soft_wrap=True)
    # soft_wrap keeps the verdict on one line however narrow the terminal is.
    console.print(
        verdict_line(comparison),
        style="bold green" if comparison.exit_code == PASSED else "bold red",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


def run_compare(
    baseline,
    current,
    tolerance=0.1,
    abs_tolerance=0.01,
    metrics=None,
    json_path=None,
    markdown_path=None,
    console=None,
    confidence=0.95,
    allow_unjudged=False,
):
    """Compare two run directories (or summary.csv paths), print the table and verdict, write the
    JSON and Markdown reports where paths are given; return the exit code, 0, 1 or 3 (unusable input:
    SpecbenchError)."""
    baseline, note = pick_baseline(baseline, load_machine(current))
    grouped = has_categories(baseline) and has_categories(current)  # per-category rows are judged too
    frames = load_summary(baseline, grouped), load_summary(current, grouped)
    comparison = compare_frames(
        *frames,
        tolerance,
        abs_tolerance,
        metrics,
        str(baseline),
        str(current),
        records=(load_records(baseline, grouped), load_records(current, grouped)),
        machines=(load_machine(baseline), load_machine(current)),
        confidence=confidence,
        allow_unjudged=allow_unjudged,
    )
    if json_path:
        write_text(json_path, json.dumps(to_json(comparison), indent=2) + "\n")
    if markdown_path:
        write_text(markdown_path, to_markdown(comparison))
    console = console or Console()
    if note:
        console.print(note)
    print_comparison(console, comparison)
    return comparison.exit_code
