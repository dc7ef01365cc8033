"""Compare two benchmark runs and flag regressions (`specbench compare`).

Rows of the two ``summary.csv`` files are matched on their configuration (the
same experiment), then each metric is judged against a tolerance:

* timing metrics are noisy, so they get a *relative* tolerance (default 10%);
* alpha, tau and acceptance rate are deterministic for a fixed seed, model and
  hardware, so they get a tight *absolute* tolerance (default 0.01).

Exit-code policy (what CI sees):

* 0: nothing regressed and every baseline row was found again;
* 1: a metric regressed, or a baseline row (or a metric value it had) is gone
  from the current run: a benchmark that silently stops measuring a
  configuration must not pass;
* 2: unusable input. ``run_compare`` raises ``SpecbenchError`` for that and the
  CLI turns it into one line on stderr and exit code 2.

Rows only in the current run are reported as "new" and never fail.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

from specbench.errors import SpecbenchError

EXIT_OK = 0
EXIT_REGRESSED = 1
EXIT_UNUSABLE = 2

# Always part of the row key; a file without them cannot be matched.
REQUIRED_KEYS = ["target", "draft", "dataset", "k", "temperature", "top_k", "top_p"]
# Files written before there were several methods have no `method` column.
DEFAULT_METHOD = "speculative"
# They change what is measured, but older or hand-made files may lack them, so
# they are keys only when both files have them.
OPTIONAL_KEYS = ["max_new_tokens", "num_prompts", "seed"]
# Not keys (CI and a laptop should still match on alpha), but worth a warning.
CONTEXT_COLUMNS = ["device", "dtype"]

RELATIVE_METRICS = ["speedup", "spec_tokens_per_s", "baseline_tokens_per_s"]
ABSOLUTE_METRICS = ["alpha", "tau", "acceptance_rate"]
KNOWN_METRICS = RELATIVE_METRICS + ABSOLUTE_METRICS

OK, REGRESSED, IMPROVED, MISSING, NEW, SKIPPED = (
    "ok", "regressed", "improved", "missing", "new", "skipped",
)
FAILING = {REGRESSED, MISSING}

# 1.1 * 0.9 is 0.9900000000000001 in floating point: without this slack a change
# of exactly the tolerance (1.1 -> 0.99) would count as a regression.
_EPS = 1e-9


@dataclass
class MetricVerdict:
    metric: str
    baseline: float | None
    current: float | None
    # Relative metrics: current / baseline - 1; absolute metrics: current - baseline.
    change: float | None
    status: str

    @property
    def relative(self) -> bool:
        return self.metric in RELATIVE_METRICS


@dataclass
class RowVerdict:
    key: dict
    label: str
    status: str
    metrics: list[MetricVerdict]


@dataclass
class Comparison:
    rows: list[RowVerdict]
    metrics: list[str]
    key_columns: list[str]
    tolerance: float
    abs_tolerance: float
    baseline: str = ""
    current: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[RowVerdict]:
        return [row for row in self.rows if row.status in FAILING]

    @property
    def exit_code(self) -> int:
        return EXIT_REGRESSED if self.failures else EXIT_OK


# ---------------------------------------------------------------- loading


def load_summary(path: str | Path) -> pd.DataFrame:
    """Read a run directory's ``summary.csv`` (or that file itself), checked and normalised."""
    p = Path(path)
    if not p.exists():
        raise SpecbenchError(
            f"{p} does not exist; pass a run directory containing summary.csv or a summary.csv file"
        )
    if p.is_dir():
        p = p / "summary.csv"
        if not p.is_file():
            raise SpecbenchError(
                f"{p.parent} has no summary.csv; pass a directory written by `specbench run` "
                "or the path of a summary.csv"
            )
    try:
        df = pd.read_csv(p)
    except pd.errors.EmptyDataError:
        raise SpecbenchError(f"{p} is empty; re-run `specbench run` to produce it") from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecbenchError(
            f"{p} is not a readable CSV ({reason}); pass a summary.csv written by `specbench run`"
        ) from None

    missing = [c for c in REQUIRED_KEYS if c not in df.columns]
    if missing:
        raise SpecbenchError(
            f"{p} lacks the columns {', '.join(missing)}; pass a summary.csv written by "
            "`specbench run`"
        )
    if df.empty:
        raise SpecbenchError(f"{p} has a header but no rows; re-run the benchmark")
    if "method" not in df.columns:
        df["method"] = DEFAULT_METHOD
    df["method"] = df["method"].fillna(DEFAULT_METHOD)

    for metric in KNOWN_METRICS:
        if metric in df.columns:
            try:
                df[metric] = pd.to_numeric(df[metric])
            except (ValueError, TypeError):
                raise SpecbenchError(
                    f"column {metric} in {p} holds non-numeric values; "
                    "fix or regenerate the file"
                ) from None
    return df


# ---------------------------------------------------------------- pure logic


def _key_value(value) -> str:
    """Canonical text for a key cell, so 4, 4.0 and "4" match and blanks match blanks."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value).strip()
    if math.isnan(number):
        return ""
    return str(int(number)) if number.is_integer() else repr(number)


def _plain(value):
    """A cell as a plain Python value (JSON-safe, NaN as None)."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _number(value) -> float | None:
    value = _plain(value)
    return None if value is None else float(value)


def _keyed_rows(df: pd.DataFrame, keys: list[str], source: str) -> dict[tuple, pd.Series]:
    rows: dict[tuple, pd.Series] = {}
    for _, row in df.iterrows():
        key = tuple(_key_value(row[c]) for c in keys)
        if key in rows:
            shown = ", ".join(f"{c}={v}" for c, v in zip(keys, key))
            raise SpecbenchError(
                f"{source or 'a summary'} has more than one row for {shown}; "
                "keep one row per configuration"
            )
        rows[key] = row
    return rows


def _labels(keys: list[str], all_keys: list[tuple]) -> dict[tuple, str]:
    """Short row names: only the key columns that vary, always with k and method."""
    shown = [
        i for i, c in enumerate(keys)
        if c in ("k", "method") or len({key[i] for key in all_keys}) > 1
    ]
    return {key: " ".join(f"{keys[i]}={key[i]}" for i in shown) for key in all_keys}


def _judge(metric: str, base: float | None, cur: float | None,
           tolerance: float, abs_tolerance: float) -> MetricVerdict:
    if base is None:
        # Nothing to hold the current run to (e.g. alpha on a baseline-method row).
        return MetricVerdict(metric, base, cur, None, SKIPPED)
    if cur is None:
        # The baseline measured it and the current run did not: treated like a missing row.
        return MetricVerdict(metric, base, cur, None, MISSING)
    if metric in RELATIVE_METRICS:
        change = cur / base - 1 if base != 0 else None
        low, high = base * (1 - tolerance), base * (1 + tolerance)
    else:
        change = cur - base
        low, high = base - abs_tolerance, base + abs_tolerance
    if cur < low - _EPS:
        status = REGRESSED
    elif cur > high + _EPS:
        status = IMPROVED
    else:
        status = OK
    return MetricVerdict(metric, base, cur, change, status)


def _row_status(metrics: list[MetricVerdict]) -> str:
    statuses = {m.status for m in metrics}
    if REGRESSED in statuses or MISSING in statuses:
        return REGRESSED
    return IMPROVED if IMPROVED in statuses else OK


def _choose_metrics(baseline: pd.DataFrame, current: pd.DataFrame,
                    metrics: list[str] | None) -> list[str]:
    if not metrics:
        chosen = [m for m in KNOWN_METRICS if m in baseline.columns and m in current.columns]
        if not chosen:
            raise SpecbenchError(
                f"the two summaries share none of the metrics {', '.join(KNOWN_METRICS)}; "
                "compare files written by `specbench run`"
            )
        return chosen
    chosen = list(dict.fromkeys(metrics))
    unknown = [m for m in chosen if m not in KNOWN_METRICS]
    if unknown:
        raise SpecbenchError(
            f"unknown metric {', '.join(unknown)}; choose from {', '.join(KNOWN_METRICS)}"
        )
    for name, df in (("baseline", baseline), ("current", current)):
        absent = [m for m in chosen if m not in df.columns]
        if absent:
            raise SpecbenchError(
                f"the {name} summary has no column {', '.join(absent)}; "
                "drop that --metric or regenerate the file"
            )
    return chosen


def compare_frames(baseline: pd.DataFrame, current: pd.DataFrame, tolerance: float = 0.10,
                   abs_tolerance: float = 0.01, metrics: list[str] | None = None,
                   baseline_name: str = "", current_name: str = "") -> Comparison:
    """Match rows on configuration and judge each metric. No I/O."""
    if not 0 <= tolerance < 1:
        raise SpecbenchError(f"--tolerance {tolerance} is out of range; use a fraction in [0, 1)")
    if abs_tolerance < 0:
        raise SpecbenchError(f"--abs-tolerance {abs_tolerance} is negative; use a value >= 0")
    chosen = _choose_metrics(baseline, current, metrics)
    keys = REQUIRED_KEYS + ["method"] + [
        c for c in OPTIONAL_KEYS if c in baseline.columns and c in current.columns
    ]
    base_rows = _keyed_rows(baseline, keys, baseline_name)
    cur_rows = _keyed_rows(current, keys, current_name)
    if not base_rows.keys() & cur_rows.keys():
        raise SpecbenchError(
            f"no row of the current run matches a baseline row on {', '.join(keys)}; "
            "run the same configuration as the baseline"
        )

    all_keys = list(base_rows) + [k for k in cur_rows if k not in base_rows]
    labels = _labels(keys, all_keys)
    verdicts = []
    for key in all_keys:
        base, cur = base_rows.get(key), cur_rows.get(key)
        source = base if base is not None else cur
        key_dict = {c: _plain(source[c]) for c in keys}
        if cur is None:
            row_metrics = [MetricVerdict(m, _number(base[m]), None, None, MISSING) for m in chosen]
            verdicts.append(RowVerdict(key_dict, labels[key], MISSING, row_metrics))
        elif base is None:
            row_metrics = [MetricVerdict(m, None, _number(cur[m]), None, NEW) for m in chosen]
            verdicts.append(RowVerdict(key_dict, labels[key], NEW, row_metrics))
        else:
            row_metrics = [
                _judge(m, _number(base[m]), _number(cur[m]), tolerance, abs_tolerance)
                for m in chosen
            ]
            verdicts.append(RowVerdict(key_dict, labels[key], _row_status(row_metrics), row_metrics))

    notes = []
    for column in CONTEXT_COLUMNS:
        if column in baseline.columns and column in current.columns:
            before = sorted({_key_value(v) for v in baseline[column]})
            after = sorted({_key_value(v) for v in current[column]})
            if before != after:
                notes.append(
                    f"{column} differs ({', '.join(before)} vs {', '.join(after)}): timing "
                    "metrics are not comparable; restrict with --metric alpha --metric tau"
                )
    return Comparison(verdicts, chosen, keys, tolerance, abs_tolerance,
                      baseline_name, current_name, notes)


# ---------------------------------------------------------------- formatting


def _fmt_value(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _fmt_change(m: MetricVerdict) -> str:
    if m.change is None:
        return ""
    return f"{m.change:+.1%}" if m.relative else f"{m.change:+.3f}"


def _cell_text(m: MetricVerdict) -> str:
    if m.status == MISSING and m.current is None and m.baseline is not None:
        return f"{_fmt_value(m.baseline)} -> -"
    if m.status == NEW:
        return _fmt_value(m.current)
    if m.status == SKIPPED:
        return _fmt_value(m.current) if m.current is not None else "-"
    text = f"{_fmt_value(m.baseline)} -> {_fmt_value(m.current)}"
    change = _fmt_change(m)
    return f"{text} ({change})" if change else text


def _problem(row: RowVerdict) -> str:
    if row.status == MISSING:
        return f"{row.label}: missing from the current run"
    parts = []
    for m in row.metrics:
        if m.status == REGRESSED:
            parts.append(f"{m.metric} {_fmt_value(m.baseline)} -> {_fmt_value(m.current)} "
                         f"({_fmt_change(m)})")
        elif m.status == MISSING:
            parts.append(f"{m.metric} no longer measured")
    return f"{row.label}: {', '.join(parts)}"


def verdict_line(comparison: Comparison) -> str:
    """One line for logs: PASS/FAIL and, on failure, each failing row and metric."""
    tol = f"tolerance {comparison.tolerance:.0%} relative, {comparison.abs_tolerance:g} absolute"
    failures = comparison.failures
    if failures:
        return f"FAIL ({tol}): " + "; ".join(_problem(row) for row in failures)
    counts = {s: sum(r.status == s for r in comparison.rows) for s in (OK, IMPROVED, NEW)}
    compared = counts[OK] + counts[IMPROVED]
    extra = "".join(f", {counts[s]} {s}" for s in (IMPROVED, NEW) if counts[s])
    return f"PASS ({tol}): {compared} rows within tolerance{extra}"


def to_json(comparison: Comparison, path: str | Path | None = None) -> dict:
    """The verdict as a JSON-ready dict; also written to ``path`` when given."""
    data = {
        "verdict": "fail" if comparison.failures else "pass",
        "exit_code": comparison.exit_code,
        "summary": verdict_line(comparison),
        "baseline": comparison.baseline,
        "current": comparison.current,
        "tolerance": comparison.tolerance,
        "abs_tolerance": comparison.abs_tolerance,
        "metrics": comparison.metrics,
        "key_columns": comparison.key_columns,
        "notes": comparison.notes,
        "rows": [
            {
                "key": row.key,
                "label": row.label,
                "status": row.status,
                "metrics": {
                    m.metric: {
                        "baseline": m.baseline,
                        "current": m.current,
                        "change": m.change,
                        "change_kind": "relative" if m.relative else "absolute",
                        "status": m.status,
                    }
                    for m in row.metrics
                },
            }
            for row in comparison.rows
        ],
    }
    if path is not None:
        _write(path, json.dumps(data, indent=2) + "\n")
    return data


def to_markdown(comparison: Comparison) -> str:
    """A Markdown table plus the verdict line, for CI logs and step summaries."""
    header = ["row", "status"] + comparison.metrics
    lines = [
        "### specbench compare",
        "",
        f"**{verdict_line(comparison)}**",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in comparison.rows:
        cells = [row.label.replace("|", "\\|"), _md_status(row.status)]
        for m in row.metrics:
            text = _cell_text(m)
            # A missing row is already flagged once in its status cell.
            marked = m.status in FAILING | {IMPROVED} and row.status != MISSING
            cells.append(f"{text} {_md_status(m.status)}" if marked else text)
        lines.append("| " + " | ".join(cells) + " |")
    for note in comparison.notes:
        lines += ["", f"> note: {note}"]
    return "\n".join(lines) + "\n"


def _md_status(status: str) -> str:
    return f"**{status}**" if status in FAILING else status


_STYLES = {OK: "green", REGRESSED: "bold red", IMPROVED: "cyan", MISSING: "bold red",
           NEW: "blue", SKIPPED: "dim"}


def render_table(comparison: Comparison) -> Table:
    """A rich table: one line per row, one column per metric, coloured by status."""
    table = Table(title="specbench compare: baseline -> current")
    table.add_column("row")
    table.add_column("status")
    for metric in comparison.metrics:
        kind = f"±{comparison.tolerance:.0%}" if metric in RELATIVE_METRICS \
            else f"±{comparison.abs_tolerance:g}"
        table.add_column(f"{metric} ({kind})", justify="right")
    for row in comparison.rows:
        cells = [row.label, f"[{_STYLES[row.status]}]{row.status}[/]"]
        for m in row.metrics:
            cells.append(f"[{_STYLES[m.status]}]{_cell_text(m)}[/]")
        table.add_row(*cells)
    return table


def _write(path: str | Path, text: str) -> None:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise SpecbenchError(f"cannot write {p} ({exc.strerror}); choose a writable path") from None


# ---------------------------------------------------------------- entry point


def run_compare(baseline: str, current: str, tolerance: float = 0.10,
                abs_tolerance: float = 0.01, metrics: list[str] | None = None,
                json_path: str | None = None, markdown_path: str | None = None,
                console: Console | None = None) -> int:
    """Compare two runs, print the table and verdict, write reports; return 0 or 1.

    Raises SpecbenchError for unusable input (the CLI maps it to exit code 2).
    """
    console = console or Console()
    comparison = compare_frames(
        load_summary(baseline), load_summary(current), tolerance, abs_tolerance, metrics,
        baseline_name=str(baseline), current_name=str(current),
    )
    if json_path:
        to_json(comparison, json_path)
    if markdown_path:
        _write(markdown_path, to_markdown(comparison))
    console.print(render_table(comparison))
    for note in comparison.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    style = "bold red" if comparison.failures else "bold green"
    # soft_wrap keeps the verdict on one line however narrow the terminal is.
    console.print(verdict_line(comparison), style=style, highlight=False, markup=False,
                  soft_wrap=True)
    return comparison.exit_code
