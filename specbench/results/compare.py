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
import math
from collections import namedtuple
from pathlib import Path

import numpy as np
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
    Rows,
    cell_text,
    has_categories,
    load_config,
    load_machine,
    load_records,
    load_summary,
    number,
    pick_baseline,
    runs_in,
)

OPTIONAL_KEYS = [
    "engine",
    "concurrency",
    "request_rate",
    "tree",
    "k_policy",
    "options",
    "eta",
    "synthetic_acceptance",  # acceptance set by hand is another experiment than verification
    "max_new_tokens",
    "num_prompts",
    "seed",
    *schema.GROUP_KEYS,  # the per-category rows, when both runs wrote categories.csv
]  # keys only when both files have them, or one has them and ABSENT says what the other meant
# What a summary written before a key column existed meant by it: a column one file has and the other
# lacks is still a key where its absence has a meaning (a synthetic-acceptance run is another experiment
# than an older file's verification, a heuristic K than its fixed K). k_policy: fixed where a row has a K.
ABSENT = {
    "engine": "torch",
    "concurrency": 1,
    "request_rate": math.inf,
    "tree": None,
    "eta": 0,
    "synthetic_acceptance": None,
}
ABSENT_KEYS = [*ABSENT, "k_policy"]
CONTEXT = [
    "device",
    "dtype",
    "compile",
]  # not keys, so CI and a laptop still match on alpha; but timings are judged as if from another machine
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


def _columns(rows: Rows) -> dict:
    """The columns of ``rows``, in order: every key any row has."""
    return dict.fromkeys(column for row in rows for column in row)


def _differing(baseline: Rows, current: Rows, column: str) -> str | None:
    """ "a vs b" when both files have the column and its values differ; a blank is unknown, not different."""
    before, after = (", ".join(sorted({cell_text(r.get(column)) for r in rows} - {""})) for rows in (baseline, current))
    return f"{before} vs {after}" if before and after and before != after else None


# The options that decide which prompts a run decodes and how they encode (what prompts_hash hashes).
PROMPT_OPTIONS = ("target", "dataset", "dataset_path", "prompt_field", "num_prompts", "categories", "per_category",
                  "max_turns", "chat", "random_weights", "prompt_tokens", "context_tokens", "max_new_tokens", "seed")  # fmt: skip


def _settings(configs: tuple, names=None) -> str:
    """ "num_prompts 2 vs 3, ..." for the options two runs were made with (meta.json), where they differ
    (of ``names`` only, when given); "" when they agree or either is unknown."""
    if not all(configs):
        return ""
    base, cur = configs
    return ", ".join(
        f"{k} {_option(base.get(k))} vs {_option(cur.get(k))}"
        for k in sorted(base.keys() | cur.keys())
        if base.get(k) != cur.get(k) and (names is None or k in names)
    )


def _option(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _incomplete(base: dict, cur: dict, keys: list[str]) -> str:
    """Why one run holds fewer prompts than the other in a row of the same configuration: the run cut
    short, as an interrupted run's summary counts the prompts decoded so far. "" when none does. A row
    with failed requests (a served engine's) is not cut short: its prompts are missing, judged as such."""
    if "num_prompts" not in keys:
        return ""
    at = keys.index("num_prompts")
    decoders = [i for i, c in enumerate(keys) if c in DECODER]
    counts = {key[:at] + key[at + 1 :]: key for key in base}
    for key in cur:
        other = counts.get(key[:at] + key[at + 1 :])
        n, m = key[at], None if other is None else other[at]
        if any(number(row.get("failed")) for row in (cur[key], base.get(other, {}))):
            continue
        if key not in base and None not in (n, m) and n != m:
            which = "current" if n < m else "baseline"
            label = " ".join(f"{keys[i]}={cell_text(key[i])}" for i in decoders if cell_text(key[i]))
            return f"the {which} run is incomplete: {label} decoded {min(n, m)} of {max(n, m)} prompts"
    return ""


def _decoder(row: dict, keys: list[str]) -> str:
    """A row's method, k, tree and policy as text, of those in ``keys`` (the columns both runs
    have): what ties a summary row to its records."""
    return " ".join(f"{c}={cell_text(_key_cell(row, c))}" for c in DECODER if c in keys)


def _choose_metrics(baseline: Rows, current: Rows, metrics: list[str] | None) -> list[str]:
    columns = _columns(baseline), _columns(current)
    shared = [m for m in schema.GATED if all(m in c for c in columns)]
    if not (chosen := list(dict.fromkeys(metrics or shared))):
        raise SpecbenchError(
            f"the two summaries share none of the metrics {', '.join(schema.GATED)}; compare files written by `specbench run`"
        )
    if unknown := [m for m in chosen if m not in METRICS]:
        raise SpecbenchError(f"unknown metric {', '.join(unknown)}; choose from {', '.join(METRICS)}")
    if absent := [
        (name, m) for name, c in zip(("baseline", "current"), columns, strict=True) for m in chosen if m not in c
    ]:
        raise SpecbenchError(
            f"the {absent[0][0]} summary has no column {absent[0][1]}; drop that --metric or regenerate the file"
        )
    return chosen


def _key_value(value):
    """A key cell that matches across files: 4, 4.0 and "4" are equal (numbers compare by value, and
    4 == 4.0 in a dict), and every blank is None."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                return text
    return None if isinstance(value, float) and math.isnan(value) else value


def _absent(column: str, row: dict):
    """What a summary without ``column`` meant by it in ``row`` (ABSENT)."""
    if column == "k_policy":  # a K of 0 is a hand-made file's blank
        return "fixed" if _key_value(row.get("k")) not in (None, 0) else None
    return ABSENT.get(column)


def _key_cell(row: dict, column: str):
    """``row``'s cell of the key ``column`` as _key_value reads it; where its file lacks the column,
    what the file meant by it (_absent)."""
    return _key_value(row[column] if column in row else _absent(column, row))


def _normalised(rows: Rows, keys: list[str], chosen: list[str]) -> Rows:
    """The key and metric cells of ``rows``, and failed: keys as _key_cell, k a whole number, metrics
    floats or None."""
    out = []
    for row in rows:
        kept = {c: _key_cell(row, c) for c in keys}
        k = kept["k"]
        if k is not None and (isinstance(k, str) or float(k) != int(k)):
            raise SpecbenchError("column k holds values that are not whole numbers; fix or regenerate the file")
        kept["k"] = None if k is None else int(k)  # blank for methods without K (0 in hand-made files)
        # failed: whether a row's prompts are missing because requests failed (_incomplete reads it)
        out.append(kept | {m: number(row.get(m)) for m in chosen} | {"failed": number(row.get("failed"))})
    return out


def _interval(records: list, decoder: str, metric: str, values: list[float], confidence: float) -> tuple:
    """(ci_low, ci_high, prompts, why there is no interval: "" when there is one) of the relative
    change of ``metric`` on one summary row, whose values in the two summaries are ``values``.
    ``records``: each run's records by decoder, then by prompt (None: the run has no records.csv)."""
    if metric not in PER_PROMPT:
        return None, None, None, f"{metric} is not a rate summed over prompts"
    if absent := [
        name for name, by_decoder in zip(("baseline", "current"), records, strict=True) if by_decoder is None
    ]:
        return None, None, None, f"no records.csv in the {' and '.join(absent)} run"
    base, cur = (by_decoder.get(decoder, {}) for by_decoder in records)
    shared = sorted(base.keys() & cur.keys())
    if len(shared) < 2:
        return None, None, len(shared), f"{len(shared)} prompt(s) in both runs' records.csv, too few to resample"
    parts = [
        np.array([[number(by_prompt[i][c]) for c in PER_PROMPT[metric]] for i in shared], dtype=float)  # blank: NaN
        for by_prompt in (base, cur)
    ]
    # Stale or foreign records would lend the summary's values an interval that is not theirs.
    if not np.allclose([rate_of_sums(p) for p in parts], values, rtol=1e-6):
        return None, None, len(shared), "records.csv does not reproduce summary.csv over the shared prompts"
    _, low, high = paired_change(*parts, confidence)
    return low, high, len(shared), ""


def _by_decoder(records: Rows | None, keys: list[str]) -> dict | None:
    """A run's records by decoder, then by prompt index: what every row and metric's interval reads."""
    if records is None:
        return None
    split = {}
    for row in records:
        split.setdefault(_decoder(row, keys), {})[int(float(row["prompt_index"]))] = row
    return split


def _judge(row: dict, metric: str, incomparable: bool, tolerance: float, abs_tolerance: float) -> tuple:
    """The status and change of one metric on a merged row (its "side": MISSING, NEW or "";
    ``incomparable``: its values measure different machines)."""
    base, cur = row[f"{metric} base"], row[f"{metric} cur"]
    change = low = high = None
    if base is not None and cur is not None:
        if metric in RELATIVE:
            change = cur / base - 1 if base != 0 else None
            # Where the prompts gave an interval, all of it must lie beyond the tolerance: noise that
            # might explain the change does not fail a build.
            low, high = (
                change if row.get(f"{metric} {b}") is None else row[f"{metric} {b}"] for b in ("ci_low", "ci_high")
            )
        else:
            change = low = high = cur - base
    width = tolerance if metric in RELATIVE else abs_tolerance
    below = high is not None and high < -width - _EPS
    above = low is not None and low > width + _EPS
    worse, better = (below, above) if schema.BY_NAME[metric].better == schema.HIGHER else (above, below)
    # The first true condition wins: a row gone from the current run is missing whatever its baseline held,
    # and a baseline without a value (alpha of the baseline method) holds the current run to nothing.
    conditions = [row["_side"] != "", base is None, cur is None, incomparable, worse, better]
    statuses = [row["_side"], SKIPPED, MISSING, NOT_COMPARABLE, REGRESSED, IMPROVED]
    status = next((s for c, s in zip(conditions, statuses, strict=True) if c), OK)
    return status, change if status in JUDGED else None


def _machine_difference(machines: tuple) -> str:
    """Why the absolute timings of two runs cannot be compared; "" when their fingerprints are equal."""
    if absent := [name for name, m in zip(("baseline", "current"), machines, strict=True) if not m]:
        return f"no machine fingerprint in the {' and '.join(absent)} run's meta.json"
    base, cur = machines
    differ = [
        f"{k} {base.get(k)} vs {cur.get(k)}" for k in sorted(base.keys() | cur.keys()) if base.get(k) != cur.get(k)
    ]
    return f"the machines differ: {', '.join(differ)}" if differ else ""


def _unjudged(merged: Rows, chosen: list[str], setup: str, elsewhere: str, unlike: set) -> list[Unjudged]:
    """The chosen metrics of which no row was held to the tolerance, grouped by why."""
    causes = {}
    for m in chosen:
        if any(row[f"{m} status"] in VERDICTS for row in merged):
            continue
        if setup and m in unlike:  # a baseline of this machine would not help: the setting must match
            cause = (
                f"the runs differ in {setup}",
                "compare runs of the same device, dtype and compile, or pass --allow-unjudged",
            )
        elif elsewhere.startswith("no machine") and m in unlike:  # runs older than the fingerprint
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


def compare_rows(
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
    configs=(None, None),
):
    """Match the rows of two summaries (load_summary: lists of dicts) on configuration and judge each
    metric (a list of names, default schema.GATED); the names label the files in messages. ``records``:
    the runs' records.csv rows (load_records), which give timing changes a ``confidence`` interval; ``machines``: their
    fingerprints (load_machine), without which absolute timings are not judged; ``configs``: their options
    (load_config), which name what differs when the runs cannot be compared. A metric judged on no row
    sets exit code 3 unless ``allow_unjudged``. Returns a Comparison. No I/O."""
    if not (0 <= tolerance < 1 and abs_tolerance >= 0 and 0 < confidence < 1):
        raise SpecbenchError(
            f"--tolerance {tolerance} must lie in [0, 1), --abs-tolerance {abs_tolerance} be >= 0 "
            f"and --confidence {confidence} lie in (0, 1)"
        )
    settings = _settings(configs)
    if hashes := _differing(baseline, current, "prompts_hash"):
        if shaping := _settings(configs, PROMPT_OPTIONS):  # not --threads or the methods: they move no prompt
            raise SpecbenchError(
                f"the two runs decoded different prompts (prompts_hash {hashes}): their options differ in "
                f"{shaping}; run the current one with the baseline's options"
            )
        raise SpecbenchError(
            f"the two runs decoded different prompts (prompts_hash {hashes}): a changed dataset, "
            "template or tokenizer makes them incomparable; rerun the baseline"
        )
    chosen = _choose_metrics(baseline, current, metrics)
    columns = _columns(baseline), _columns(current)
    keys = REQUIRED_KEYS + [
        c
        for c in OPTIONAL_KEYS
        if all(c in cs for cs in columns) or (c in ABSENT_KEYS and any(c in cs for cs in columns))
    ]
    sides, contexts = [], []  # each run's rows by key, and their CONTEXT cells by key
    for rows, name in ((baseline, baseline_name), (current, current_name)):
        by_key, context = {}, {}
        for raw, row in zip(rows, _normalised(rows, keys, chosen), strict=True):
            if (key := tuple(row[c] for c in keys)) in by_key:
                shown = ", ".join(f"{c}={cell_text(row[c])}" for c in keys)
                raise SpecbenchError(
                    f"{name or 'a summary'} has more than one row for {shown}; keep one per configuration"
                )
            by_key[key], context[key] = row, {c: cell_text(raw.get(c)) for c in CONTEXT}
        sides.append(by_key)
        contexts.append(context)
    base, cur = sides
    # The same prompts (or options) and fewer of them in a row: a run cut short, not another experiment.
    hashed = all({cell_text(r.get("prompts_hash")) for r in rows} - {""} for rows in (baseline, current))
    if (hashed or (all(configs) and not settings)) and (short := _incomplete(base, cur, keys)):
        raise SpecbenchError(f"{short}; finish it (`specbench run` with its options, --out and --resume)")
    if not base.keys() & cur.keys():
        if settings:
            raise SpecbenchError(
                f"no row of the current run matches a baseline row: their options differ in {settings}; "
                "run the current one with the baseline's options"
            )
        raise SpecbenchError(
            f"no row of the current run matches a baseline row on {', '.join(keys)}; "
            "run the same configuration as the baseline"
        )

    # Where a row and its match differ in device, dtype or compile (a blank is unknown, not different).
    # Row by row: an hf-* row is compile=eager and a served one its engine's name, beside torch's rows.
    differ: dict[str, set] = {}
    unlike_rows = set()
    for key in base.keys() & cur.keys():
        for c in CONTEXT:
            before, after = contexts[0][key][c], contexts[1][key][c]
            if before and after and before != after:
                differ.setdefault(c, set()).add(f"{before} vs {after}")
                unlike_rows.add(key)

    def merged_row(key: tuple, side: str) -> dict:
        b, c = base.get(key, {}), cur.get(key, {})
        values = {f"{m} {name}": row.get(m) for m in chosen for name, row in (("base", b), ("cur", c))}
        row = dict(zip(keys, key, strict=True)) | values | {"_side": side, "_unlike": key in unlike_rows}
        return row | {"_decoder": _decoder(row, keys)}

    # The baseline's rows in its order, then the current run's new ones in theirs.
    merged = [merged_row(key, "" if key in cur else MISSING) for key in base]
    merged += [merged_row(key, NEW) for key in cur if key not in base]
    differ = {c: ", ".join(sorted(values)) for c, values in differ.items()}
    notes = [
        f"{c} differs ({v}): timings other than efficiency are not judged on those rows" for c, v in differ.items()
    ]
    setup, elsewhere = ", ".join(f"{c} {v}" for c, v in differ.items()), _machine_difference(machines)
    # Known to be other machines: every timing moves with the hardware, ratios too (speedup at K=2 was
    # 1.57 on a 2-core Intel Xeon and 0.89 on a 2-core AMD EPYC, whose 3-row matrix products cost more).
    # Another device, dtype or compile times other forwards just as another machine does.
    # Not known (no fingerprint): ratios within a run are still judged, absolute timings not.
    # Efficiency, the run's speedup over what its own forwards predict, is judged anywhere: the machine's
    # speed cancels out of it, so a loop that got slower fails it on any runner.
    older = elsewhere.startswith("no machine fingerprint") and not setup
    unlike = (ABSOLUTE if older else RELATIVE) - set(schema.PORTABLE)
    records = [_by_decoder(rows, keys) for rows in records]
    gaps = {}  # (why, rows without an interval, rows compared) -> the metrics without one
    for m in chosen:

        def incomparable(row: dict, m: str = m) -> bool:
            return bool(row["_unlike"] or elsewhere) and m in unlike

        if m in RELATIVE:
            compared, whys = 0, {}
            for row in merged:
                judge = row["_side"] == "" and None not in (row[f"{m} base"], row[f"{m} cur"]) and not incomparable(row)
                values = [row[f"{m} base"], row[f"{m} cur"]]
                interval = _interval(records, row["_decoder"], m, values, confidence) if judge else (None,) * 3 + ("",)
                row.update(
                    zip([f"{m} {name}" for name in ("ci_low", "ci_high", "prompts", "why")], interval, strict=True)
                )
                compared += judge
                if why := interval[3]:
                    whys[why] = whys.get(why, 0) + 1
            for why, n in whys.items():
                gaps.setdefault((why, n, compared), []).append(m)
        for row in merged:
            row[f"{m} status"], row[f"{m} change"] = _judge(row, m, incomparable(row), tolerance, abs_tolerance)
    notes += [
        f"{', '.join(ms)}: no {confidence * 100:g}% interval{'' if n == total else f' on {n} of {total} rows'} "
        f"({why}); judged on the point values with the ±{tolerance:.0%} tolerance"
        for (why, n, total), ms in gaps.items()
    ]
    for row in merged:
        statuses = [row[f"{m} status"] for m in chosen]
        failing, improved = any(s in FAILING for s in statuses), IMPROVED in statuses
        row["_status"] = row["_side"] or (REGRESSED if failing else IMPROVED if improved else OK)
    # Short row labels: only the key columns that vary, always with k and method.
    shown = [c for c in keys if c in ("k", "method") or len({row[c] for row in merged}) > 1]
    rows = [
        RowVerdict(
            {c: r[c] for c in keys},
            " ".join(f"{c}={cell_text(r[c])}" for c in shown),
            r["_status"],
            [_metric_verdict(m, r) for m in chosen],
        )
        for r in merged
    ]
    unjudged = _unjudged(merged, chosen, setup, elsewhere, unlike)
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


def _picked(shelf: Path, baseline: Path, current, problem: str) -> str:
    """A refusal of the baseline compare took from a directory of runs: which run it took, and
    another there that was made with the current run's options, if one was."""
    mine = load_machine(current) is not None and load_machine(baseline) == load_machine(current)
    said = f"baseline {baseline} (the newest run in {shelf}{' measured on this machine' if mine else ''}): {problem}"
    wanted = load_config(current)
    if match := next((d for d in runs_in(shelf) if d != baseline and wanted and load_config(d) == wanted), None):
        said += f"; {match} has the current run's options: pass it as the baseline"
    return said


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
    shelf = baseline
    baseline, note = pick_baseline(shelf, load_machine(current))
    grouped = has_categories(baseline) and has_categories(current)  # per-category rows are judged too
    summaries = load_summary(baseline, grouped), load_summary(current, grouped)
    try:
        comparison = compare_rows(
            *summaries,
            tolerance,
            abs_tolerance,
            metrics,
            str(baseline),
            str(current),
            records=(load_records(baseline, grouped), load_records(current, grouped)),
            machines=(load_machine(baseline), load_machine(current)),
            confidence=confidence,
            allow_unjudged=allow_unjudged,
            configs=(load_config(baseline), load_config(current)),
        )
    except SpecbenchError as e:
        if not note:
            raise
        raise SpecbenchError(_picked(Path(shelf), baseline, current, str(e))) from None
    if json_path:
        write_text(json_path, json.dumps(to_json(comparison), indent=2) + "\n")
    if markdown_path:
        write_text(markdown_path, to_markdown(comparison))
    console = console or Console()
    if note:
        console.print(note)
    print_comparison(console, comparison)
    return comparison.exit_code
