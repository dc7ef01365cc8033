"""Results on disk (CSV, JSONL, JSON) and on screen (rich tables). Rows are appended and
flushed as they complete, so an interrupted run keeps everything it measured, and `--resume`
reads them back."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from . import schema
from .errors import SpecbenchError
from .files import replacing

RECORDS, OUTPUTS = "records.csv", "outputs.jsonl"


def _parse(name: str, text: str):
    """A records.csv cell back to the value written (schema formats: d = integer, empty = text)."""
    spec = schema.BY_NAME[name].fmt
    if text in ("True", "False"):
        return text == "True"
    if spec == "":
        return text
    if text == "":
        return None if name == "k" else float("nan")
    value = float(text)
    return int(value) if spec == "d" and not math.isnan(value) else value  # a count a method does not have is NaN


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@dataclass
class PreviousRun:
    """What an interrupted run left in its directory."""

    records: list[dict]
    costs: list[dict]  # verify_cost.csv rows (empty if it never got that far)
    prompts_hash: str | None

    def complete_prompts(self, steps: int) -> set[int]:
        """Prompts with a record for every decoder of the plan."""
        counts: dict[int, int] = {}
        for r in self.records:
            counts[r["prompt_index"]] = counts.get(r["prompt_index"], 0) + 1
        return {index for index, n in counts.items() if n == steps}


class RunWriter:
    def __init__(self, out: Path):
        self.out = out
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / ".specbench-write-check"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise SpecbenchError(f"cannot write results to {out} ({e.strerror or e}): choose another --out") from None
        self._files: dict[str, object] = {}
        self._records: csv.DictWriter | None = None

    def previous_run(self, config: dict) -> PreviousRun:
        """The state of an interrupted run in this directory, which must have the same configuration."""
        meta_path = self.out / "meta.json"
        if not meta_path.is_file():
            raise SpecbenchError(f"--resume: {self.out} holds no run to resume (no meta.json): drop --resume")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        config = json.loads(json.dumps(config))  # tuples and lists compare alike after a round trip
        changed = [
            key
            for key in sorted(set(config) | set(meta.get("config", {})))
            if config.get(key) != meta["config"].get(key)
        ]
        if changed:
            was = ", ".join(f"{key} {meta['config'].get(key)!r} -> {config.get(key)!r}" for key in changed)
            raise SpecbenchError(
                f"--resume: the run in {self.out} has another configuration ({was}): use the same options or another --out"
            )
        records = (
            [{k: _parse(k, v) for k, v in row.items()} for row in _read_csv(self.out / RECORDS)]
            if (self.out / RECORDS).is_file()
            else []
        )
        costs = _read_csv(self.out / "verify_cost.csv") if (self.out / "verify_cost.csv").is_file() else []
        return PreviousRun(records, costs, meta.get("resolved", {}).get("prompts_hash"))

    def start_records(self, kept: list[dict], done: set[int]) -> list[dict]:
        """Begin records.csv and outputs.jsonl with the rows and outputs of the prompts in ``done``
        (none for a fresh run) and open both for appending. Returns the kept records."""
        outputs = []
        if done and (self.out / OUTPUTS).is_file():
            lines = (self.out / OUTPUTS).read_text(encoding="utf-8").splitlines()
            outputs = [line for line in lines if json.loads(line).get("prompt_index") in done]
        with replacing(self.out / OUTPUTS) as tmp:
            tmp.write_text("".join(line + "\n" for line in outputs), encoding="utf-8")
        with replacing(self.out / RECORDS) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=schema.RECORDS)
            writer.writeheader()
            writer.writerows(kept)
        self._files[OUTPUTS] = open(self.out / OUTPUTS, "a", encoding="utf-8")
        self._files[RECORDS] = open(self.out / RECORDS, "a", newline="", encoding="utf-8")
        self._records = csv.DictWriter(self._files[RECORDS], fieldnames=schema.RECORDS)
        return list(kept)

    def append_record(self, row: dict) -> None:
        self._records.writerow(row)
        self._files[RECORDS].flush()

    def output(
        self,
        prompt_id: str,
        prompt_index: int,
        k: int | None,
        method: str,
        token_ids: list[int],
        text: str,
        tree: str = "",
    ) -> None:
        obj = {
            "prompt_id": prompt_id,
            "prompt_index": prompt_index,
            "k": k,
            "tree": tree,
            "method": method,
            "token_ids": token_ids,
            "text": text,
        }
        self._files[OUTPUTS].write(json.dumps(obj) + "\n")
        self._files[OUTPUTS].flush()

    def write_csv(self, name: str, rows: list[dict]) -> None:
        """Replace ``name`` with ``rows`` (for files rewritten whole, like summary.csv)."""
        if not rows:
            return
        with replacing(self.out / name) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    def write_json(self, name: str, obj: dict) -> None:
        with replacing(self.out / name) as tmp:
            tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def summary_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for column in schema.TABLE:
        table.add_column(column.header, justify="right")
    for row in rows:
        table.add_row(*(schema.fmt(column.name, row.get(column.name)) for column in schema.TABLE))
    return table


PHASE_COLUMNS = ("prefill_s", "draft_s", "inner_s", "verify_s", "other_s")


def phase_table(rows: list[dict]) -> Table:
    """Where each method's time went: milliseconds per generated token, phase by phase (inner only
    when a method has a level beneath its draft model)."""
    phases = [name for name in PHASE_COLUMNS if name != "inner_s" or any(row[name] for row in rows)]
    names = (f"{name.removesuffix('_s')} ms" for name in phases)
    table = Table("method", "K", "tree", *names, "total ms", "other %")
    table.title = "time per generated token"
    for column in table.columns:
        column.justify = "right"
    for row in rows:
        per_token = [1000 * row[name] / row["new_tokens"] for name in phases]
        cells = [f"{ms:.2f}" for ms in per_token]
        other = row["other_s"] / (row["method_s"] - row["prefill_s"])  # of the decode proper
        key = (row["method"], schema.fmt("k", row["k"]), schema.fmt("tree", row.get("tree")))
        table.add_row(*key, *cells, f"{sum(per_token):.2f}", f"{other:.1%}")
    return table


def levels_table(rows: list[dict]) -> Table | None:
    """For methods of several levels (cascade, triforce), a row per level, top down: its forwards,
    the tokens it proposed to the level above and how many that level accepted, the output tokens it
    chose, and its time per output token. None when no row has a level beneath its drafting model."""
    from .methods import METHODS

    nested = [row for row in rows if not math.isnan(row["inner_drafted"])]  # NaN for one-level methods
    if not nested:
        return None
    table = Table(
        "method",
        "K",
        "options",
        "level",
        "forwards",
        "proposed",
        "accepted",
        "acceptance",
        "output tokens",
        "ms/token",
        title="levels: what each level ran, proposed, had accepted and chose, and its time",
        caption="accepted: by the level above; output tokens: the tokens of the output the level chose (the target "
        "adds one of its own per forward); ms/token: the level's time over every output token. With --cascade-split, "
        "lookup's tokens after the split go to the target unchecked: output tokens count them, proposed does not",
    )
    for column in table.columns:
        column.justify = "right"
    for row in nested:
        method, tokens = METHODS[row["method"]], row["new_tokens"]
        levels = [
            (
                "target",
                row["target_forwards"],
                None,
                None,
                tokens - row["accepted"],
                row["prefill_s"] + row["verify_s"],
            ),
            (
                method.draft_level,
                row["draft_forwards"],
                row["drafted"],
                row["accepted"],
                row["accepted"] - row["from_inner"],
                row["draft_s"],
            ),
            (
                method.inner_level,
                row["inner_forwards"],
                row["inner_drafted"],
                row["inner_accepted"],
                row["from_inner"],
                row["inner_s"],
            ),
        ]
        for depth, (level, forwards, proposed, accepted, chosen, seconds) in enumerate(levels):
            table.add_row(
                row["method"] if depth == 0 else "",
                schema.fmt("k", row["k"]) if depth == 0 else "",
                (row.get("options") or "-") if depth == 0 else "",
                level,
                f"{forwards:.0f}",
                "-" if proposed is None else f"{proposed:.0f}",
                "-" if accepted is None else f"{accepted:.0f}",
                f"{accepted / proposed:.3f}" if proposed else "-",
                f"{chosen:.0f}",
                f"{1000 * seconds / tokens:.2f}",
            )
    return table


def context_rows(runs: dict[int, Path]) -> list[dict]:
    """context.csv: a row per context length, method and K of a context sweep (``runs``: context
    length -> its run directory), with the cost of a target step there and what each method got."""
    import pandas as pd

    rows = []
    for context, run_dir in sorted(runs.items()):
        summary = pd.read_csv(run_dir / "summary.csv")
        costs = pd.read_csv(run_dir / "verify_cost.csv")
        step = costs.loc[(costs["model"] == "target") & (costs["tokens"] == 1), "seconds"].iloc[0]
        for row in summary.to_dict("records"):
            inner = row.get("inner_drafted", math.nan)
            rows.append(
                {
                    "context_tokens": context,
                    "method": row["method"],
                    "k": row["k"],
                    "options": row["options"],
                    "num_prompts": row["num_prompts"],
                    "target_step_ms": 1000 * step,
                    "c": row["c"],
                    "c_run": row["c_run"],
                    "alpha": row["alpha"],
                    "acceptance_rate": row["acceptance_rate"],
                    "inner_acceptance": row["inner_accepted"] / inner if inner and not math.isnan(inner) else math.nan,
                    "tau": row["tau"],
                    "speedup": row["speedup"],
                    "decode_speedup": row["decode_speedup"],
                    "outputs_match": row["outputs_match"],
                }
            )
    baseline, rival = _contenders()
    for row in rows:  # the method's decode speedup over the rival's at the same length and K
        same = [r for r in rows if r["method"] == rival and r["context_tokens"] == row["context_tokens"]]
        same = [r for r in same if r["k"] == row["k"]] or same
        row["vs_speculative"] = (
            row["decode_speedup"] / same[0]["decode_speedup"]
            if same and row["method"] not in (rival, baseline)
            else math.nan
        )
    return rows


def _contenders() -> tuple[str, str]:
    """The baseline, and the rival a context sweep holds every other method to: the default method
    (one draft model, one level; speculative)."""
    from .methods import BASELINE, DEFAULT

    return BASELINE.name, DEFAULT[0]


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _label(row: dict) -> str:
    return row["method"] if _missing(row["k"]) else f"{row['method']} K={int(row['k'])}"


def crossovers(rows: list[dict]) -> dict[str, dict]:
    """Per method and K of a context sweep: the shortest context from which its decode speedup stays
    above the baseline's, and above speculative's (None: not at the longest context measured)."""
    from .metrics import wins_from

    baseline, rival = _contenders()
    found: dict[str, dict] = {}
    for row in rows:
        if row["method"] == baseline:
            continue
        found.setdefault(_label(row), {"speedup": {}, "vs_speculative": {}})
        found[_label(row)]["speedup"][row["context_tokens"]] = row["decode_speedup"]
        found[_label(row)]["vs_speculative"][row["context_tokens"]] = row["vs_speculative"]
    return {
        label: {
            "beats_baseline_from": wins_from(by["speedup"]),
            "beats_speculative_from": None if label.split()[0] == rival else wins_from(by["vs_speculative"]),
        }
        for label, by in found.items()
    }


def context_table(rows: list[dict], wins: dict[str, dict]) -> Table:
    """context.csv on screen: per context length, the target's step and each method's c, acceptance
    at each level and speedups; the crossovers in the caption."""
    table = Table(
        "context",
        "method",
        "target step ms",
        "c",
        "alpha",
        "acceptance",
        "lower acc.",
        "speedup",
        "decode x",
        "vs spec.",
        title="by context length (decode x: speedup with both prefills left out)",
    )
    for column in table.columns:
        column.justify = "right"

    def cell(value, spec=".3f"):
        return "-" if _missing(value) else format(value, spec)

    for row in rows:
        table.add_row(
            str(row["context_tokens"]),
            _label(row),
            cell(row["target_step_ms"], ".1f"),
            cell(row["c"]),
            cell(row["alpha"]),
            cell(row["acceptance_rate"]),
            cell(row["inner_acceptance"]),
            cell(row["speedup"]),
            cell(row["decode_speedup"]),
            cell(row["vs_speculative"]),
        )

    def since(length):
        return "never" if length is None else f"from {length} tokens"

    lines = ["wins (decode speedup above the rival's at that length and every longer one measured):"]
    for label, found in wins.items():
        text = f"{label}: over the baseline {since(found['beats_baseline_from'])}"
        if label.split()[0] != _contenders()[1]:
            text += f", over speculative {since(found['beats_speculative_from'])}"
        lines.append(text)
    table.caption = "\n".join(lines)
    return table


def predicted_table(rows: list[dict]) -> Table:
    """predicted.csv on screen: a row per assumed alpha, a column per K, the speedup with the measured
    verification cost (the classic formula's, which counts it as one step, in brackets); the best K
    of each alpha in bold."""
    ks = sorted({row["k"] for row in rows})
    table = Table("alpha", *(f"K={k}" for k in ks), title="predicted speedup at an assumed alpha")
    table.caption = (
        f"c = {rows[0]['c']:.3f}, verify_ratio = "
        + " ".join(f"{r['verify_ratio']:.2f}" for r in rows if r["alpha"] == rows[0]["alpha"])
        + " (K=1..) measured; in brackets the classic formula, which counts a verification as one step"
    )
    for column in table.columns:
        column.justify = "right"
    for alpha in dict.fromkeys(row["alpha"] for row in rows):
        by_k = {row["k"]: row for row in rows if row["alpha"] == alpha}
        best = max(by_k, key=lambda k: by_k[k]["predicted_speedup_verify"])
        cells = [
            f"{'[bold]' if k == best else ''}{by_k[k]['predicted_speedup_verify']:.2f}{'[/]' if k == best else ''}"
            f" \\[{by_k[k]['predicted_speedup']:.2f}]"
            for k in ks
        ]
        table.add_row(f"{alpha:g}", *cells)
    return table


STATUS_STYLES = {
    "ok": "green",
    "regressed": "bold red",
    "improved": "cyan",
    "missing": "bold red",
    "new": "blue",
    "skipped": "dim",
    "not comparable": "yellow",
}


def comparison_table(comparison) -> Table:
    """`specbench compare` on screen: a row per configuration, a column per metric, coloured by status."""
    from .compare import RELATIVE, cells

    table = Table("row", "status", title="specbench compare: baseline -> current")
    for m in comparison.metrics:
        band = f"±{comparison.tolerance:.0%}" if m in RELATIVE else f"±{comparison.abs_tolerance:g}"
        table.add_column(f"{m} ({band})", justify="right")
    for row in comparison.rows:
        statuses = [row.status, row.status, *(m.status for m in row.metrics)]
        styled = zip(cells(row, lambda text, _: text, comparison.confidence), statuses, strict=True)
        table.add_row(*(f"[{STATUS_STYLES[status]}]{cell}[/]" for cell, status in styled))
    return table


def print_comparison(console, comparison, verdict: str) -> None:
    console.print(comparison_table(comparison))
    for note in comparison.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    # soft_wrap keeps the verdict on one line however narrow the terminal is.
    console.print(
        verdict,
        style="bold red" if comparison.exit_code else "bold green",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
