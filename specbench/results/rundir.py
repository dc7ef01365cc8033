"""A run directory on disk: written row by row as a run measures (RunWriter), read back by
--resume (PreviousRun), and read by `specbench compare` (load_summary, load_records, load_machine,
pick_baseline). Every file's columns are schema.FILES'.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from specbench.core.errors import SpecbenchError, first_said
from specbench.core.files import replacing
from specbench.results import schema
from specbench.workloads.prompts import Turn

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


def kept(row: dict, done: set[int], blocks: set[tuple]) -> bool:
    """Whether a resumed run keeps a record or an outputs.jsonl line (older lines lack the engine)."""
    if row.get("engine", "torch") in schema.OWN_ENGINES:
        return row["prompt_index"] in done
    return block_key(row) in blocks


def block_key(row: dict) -> tuple:
    """Which served block a row belongs to: engine, method, K, concurrency and request rate (a server
    that is not started per K is one block whatever K it said: serve.finished_block)."""
    k = row.get("k")
    k = None if k is None or k != k else int(k)  # NaN: no K
    return (row.get("engine", "vllm"), row["method"], k, row["concurrency"], float(row.get("request_rate", math.inf)))


def _rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@dataclass
class PreviousRun:
    """What an interrupted run left in its directory."""

    records: list[dict]
    costs: list[dict]  # verify_cost.csv rows (empty if it never got that far)
    prompts_hash: str | None
    engine_costs: list[dict]  # engine_costs.csv rows (vLLM's one-token decode times)
    counters: list[dict] = field(default_factory=list)  # counters.csv rows (each served block's counters)
    copy_bandwidth: float | None = None  # bytes per second, as the run measured it (meta.json): its MBU's

    def complete_prompts(self, steps: int) -> set[int]:
        """Prompts with a record for every decoder of specbench's loop's plan."""
        counts: dict[int, int] = {}
        for r in self.records:
            if r["engine"] in schema.OWN_ENGINES:
                counts[r["prompt_index"]] = counts.get(r["prompt_index"], 0) + 1
        return {index for index, n in counts.items() if n == steps}

    def complete_blocks(self, prompts: int) -> set[tuple]:
        """The blocks (block_key) of the serving engines that finished every prompt without a failure:
        a block with a failed request is sent again whole."""
        counts: dict[tuple, int] = {}
        for r in self.records:
            if r["engine"] not in schema.OWN_ENGINES and not r.get("error"):
                key = block_key(r)
                counts[key] = counts.get(key, 0) + 1
        return {key for key, n in counts.items() if n == prompts}

    def kept(self, done: set[int], blocks: set[tuple]) -> list[dict]:
        """The records a resumed run keeps: its loop's complete prompts, vLLM's complete blocks."""
        return [r for r in self.records if kept(r, done, blocks)]


def refuse_to_replace(out: Path, resumable: bool = True) -> None:
    """Refuse to start a run in ``out`` where a run measured something (a record or an output): it would
    be overwritten file by file as the new run went, and one that stopped early would leave the two
    mixed. A run that measured nothing (it failed on its way) is no loss. ``resumable``: whether the
    run could go on with --resume (an online method's learning cannot)."""
    records, outputs = out / RECORDS, out / OUTPUTS
    if (records.is_file() and _rows(records)) or (outputs.is_file() and outputs.stat().st_size):
        go_on = "--resume continues it (with its options); " if resumable else ""
        raise SpecbenchError(f"{out} holds a run already: {go_on}to start over, remove it or give another --out")


class RunWriter:
    def __init__(self, out: Path):
        self.out = out
        self.created = not out.exists()  # made by this run: removed again if the run measures nothing
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
            [{k: _parse(k, v) for k, v in row.items()} for row in _rows(self.out / RECORDS)]
            if (self.out / RECORDS).is_file()
            else []
        )
        costs = _rows(self.out / "verify_cost.csv") if (self.out / "verify_cost.csv").is_file() else []
        engine_costs = _rows(self.out / "engine_costs.csv") if (self.out / "engine_costs.csv").is_file() else []
        counters = [
            {
                k: v if k in ("engine", "method", "num_accepted_tokens_per_pos") else float(v or "nan")
                for k, v in row.items()
            }
            for row in (_rows(self.out / "counters.csv") if (self.out / "counters.csv").is_file() else [])
        ]
        resolved = meta.get("resolved", {})
        return PreviousRun(
            records, costs, resolved.get("prompts_hash"), engine_costs, counters, resolved.get("copy_bandwidth")
        )

    def start_records(self, previous: PreviousRun | None, done: set[int], blocks: set[tuple]) -> list[dict]:
        """Begin records.csv and outputs.jsonl with the rows and outputs a resumed run keeps (the
        prompts in ``done``, vLLM's ``blocks``; nothing for a fresh run) and open both for appending.
        Returns the kept records."""
        outputs, kept_rows = [], previous.kept(done, blocks) if previous else []
        if kept_rows and (self.out / OUTPUTS).is_file():
            lines = (self.out / OUTPUTS).read_text(encoding="utf-8").splitlines()
            outputs = [line for line in lines if kept(json.loads(line), done, blocks)]
        with replacing(self.out / OUTPUTS) as tmp:
            tmp.write_text("".join(line + "\n" for line in outputs), encoding="utf-8")
        with replacing(self.out / RECORDS) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=schema.RECORDS)
            writer.writeheader()
            writer.writerows(kept_rows)
        self._files[OUTPUTS] = open(self.out / OUTPUTS, "a", encoding="utf-8")
        self._files[RECORDS] = open(self.out / RECORDS, "a", newline="", encoding="utf-8")
        self._records = csv.DictWriter(self._files[RECORDS], fieldnames=schema.RECORDS)
        return list(kept_rows)

    def rewrite_records(self, rows: list[dict]) -> None:
        """Replace records.csv with ``rows`` (after a pass that labels rows already written)."""
        self._files.pop(RECORDS).close()
        with replacing(self.out / RECORDS) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=schema.RECORDS)
            writer.writeheader()
            writer.writerows(rows)
        self._files[RECORDS] = open(self.out / RECORDS, "a", newline="", encoding="utf-8")
        self._records = csv.DictWriter(self._files[RECORDS], fieldnames=schema.RECORDS)

    def append_record(self, row: dict) -> None:
        self._records.writerow(row)
        self._files[RECORDS].flush()

    def output(
        self,
        turn: Turn,
        prompt_index: int,
        k: int | None,
        method: str,
        token_ids: list[int],
        text: str,
        tree: str = "",
        engine: str = "torch",
        concurrency: int = 1,
        k_policy: str = "",
        request_rate: float = math.inf,
    ) -> None:
        values = (turn.prompt.id, prompt_index, turn.turn, engine, concurrency, request_rate, method, k, tree, k_policy)
        obj = dict(zip(schema.OUTPUTS, (*values, token_ids, text), strict=True))
        self._files[OUTPUTS].write(json.dumps(obj) + "\n")
        self._files[OUTPUTS].flush()

    def outputs(self) -> list[dict]:
        """The outputs.jsonl lines written so far (a resumed run's kept ones first; each is flushed as written)."""
        return [json.loads(line) for line in (self.out / OUTPUTS).read_text(encoding="utf-8").splitlines()]

    def write_csv(self, name: str, rows: list[dict]) -> None:
        """Replace ``name`` with ``rows`` (for files rewritten whole, like summary.csv)."""
        if not rows:
            return
        with replacing(self.out / name) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=schema.FILES[name])
            writer.writeheader()
            writer.writerows(rows)

    def write_json(self, name: str, obj: dict) -> None:
        with replacing(self.out / name) as tmp:
            tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def discard_if_empty(self) -> bool:
        """Remove the run's folder when this run made it and it holds nothing measured: no record, no
        output, nothing but the files a run writes from its records (empty here) and meta.json. A run
        that failed before measuring leaves nothing behind. Whether it was removed."""
        self.close()
        if not self.created or not self.out.is_dir():
            return False
        if any(p.is_file() and p.relative_to(self.out).as_posix() not in FROM_RECORDS for p in self.out.rglob("*")):
            return False  # forward costs, a server's log, a figure: something to keep
        records, outputs = self.out / RECORDS, self.out / OUTPUTS
        if (records.is_file() and _rows(records)) or (outputs.is_file() and outputs.stat().st_size):
            return False
        shutil.rmtree(self.out)
        return True


# What a run writes from its records, and its configuration: with no record, nothing measured.
FROM_RECORDS = {
    "meta.json",
    RECORDS,
    OUTPUTS,
    "summary.csv",
    "categories.csv",
    "acceptance.csv",
    "draft_lengths.csv",
    "engine_costs.csv",
    "counters.csv",
    "results.json",
}


# ---------------------------------------------------------------- reading a finished run (compare)

# k before method, so that rows are labelled "k=4 method=speculative".
REQUIRED_KEYS = ["target", "draft", "dataset", "k", "temperature", "top_k", "top_p", "method"]
METRICS = [c.name for c in schema.COLUMNS if c.name in schema.SUMMARY and c.kind != schema.CONFIG and c.better]
DECODER = ("method", "k", "tree", "k_policy", "group_by", "category")  # what a summary row is one of, and its records


def _run_dir(path: str | Path) -> Path:
    """The directory of a run given as its directory or its summary.csv."""
    given = Path(path)
    return given if given.is_dir() else given.parent


Rows = list[dict]  # a CSV file's rows, each a dict of its columns (compare reads runs without pandas: startup time)


def _read_csv(p: Path, hint: str) -> tuple[list[str], Rows]:
    """A CSV file's columns and its rows, every value as text ("" for a blank)."""
    try:
        with open(p, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows, columns = list(reader), list(reader.fieldnames or [])
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        reason = first_said(exc)
        raise SpecbenchError(f"{p} is not a readable CSV ({reason}); {hint}") from None
    if not columns:
        raise SpecbenchError(f"{p} is not a readable CSV (no header); {hint}")
    return columns, rows


def number(value) -> float | None:
    """A metric's cell as a float; None for a blank (or NaN). Raises ValueError for text."""
    if value is None or value == "":
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _numbers(rows: Rows, columns: list[str], p: Path, strict: bool) -> Rows:
    """The metric columns of ``rows`` as numbers: text in one refuses the file when ``strict``, else reads as blank."""
    metrics = [m for m in METRICS if m in columns]
    for row in rows:
        for metric in metrics:
            try:
                row[metric] = number(row[metric])
            except ValueError:
                if strict:
                    raise SpecbenchError(
                        f"column {metric} in {p} holds non-numeric values; fix or regenerate the file"
                    ) from None
                row[metric] = None
    return rows


def load_summary(path: str | Path, categories: bool = False) -> Rows:
    """Read a run directory's summary.csv (or that file itself), checked, its metrics as numbers; with
    ``categories`` its categories.csv rows follow (summary.csv's rows have an empty group_by and category)."""
    rows = _load_summary(path)
    if not categories:
        return rows
    p = _run_dir(path) / "categories.csv"
    columns, grouped = _read_csv(p, "pass a categories.csv written by `specbench run`")
    if missing := [c for c in (*REQUIRED_KEYS, "group_by", "category") if c not in columns]:
        raise SpecbenchError(f"{p} lacks the columns {', '.join(missing)}; pass a categories.csv from `specbench run`")
    return [{**row, "group_by": "", "category": ""} for row in rows] + _numbers(grouped, columns, p, strict=False)


def has_categories(path: str | Path) -> bool:
    return (_run_dir(path) / "categories.csv").is_file()


def _load_summary(path: str | Path) -> Rows:
    given = Path(path)
    p = given / "summary.csv" if given.is_dir() else given
    if not p.is_file():
        problem = "has no summary.csv" if given.is_dir() else "does not exist"
        raise SpecbenchError(f"{given} {problem}; pass a run directory containing summary.csv or a summary.csv file")
    columns, rows = _read_csv(p, "pass a summary.csv written by `specbench run`")
    if missing := [c for c in REQUIRED_KEYS if c not in columns]:
        raise SpecbenchError(f"{p} lacks the columns {', '.join(missing)}; pass a summary.csv from `specbench run`")
    if not rows:
        raise SpecbenchError(f"{p} has a header but no rows; re-run the benchmark")
    return _numbers(rows, columns, p, strict=True)


def load_records(path: str | Path, categories: bool = False) -> Rows | None:
    """The records.csv beside a run's summary, checked; None when the run has none. With
    ``categories`` every record also stands for its category's rows (group_by and category set
    as in the run's categories.csv), after a copy for summary.csv's (both empty)."""
    p = _run_dir(path) / "records.csv"
    if not p.is_file():
        return None
    hint = "regenerate the run, or delete records.csv to compare without confidence intervals"
    columns, rows = _read_csv(p, hint)
    if missing := [c for c in ["method", "k", "prompt_index", *schema.RATES["speedup"]] if c not in columns]:
        raise SpecbenchError(f"{p} lacks the columns {', '.join(missing)}; {hint}")
    identity = [c for c in (*DECODER, "prompt_index") if c in columns]
    if len({tuple(cell_text(row[c]) for c in identity) for row in rows}) < len(rows):
        raise SpecbenchError(f"{p} has more than one row for a prompt and method; {hint}")
    if not categories:
        return rows
    _, grouped = _read_csv(p.parent / "categories.csv", "pass a categories.csv written by `specbench run`")
    column = grouped[0]["group_by"] if grouped and "group_by" in grouped[0] else ""
    plain = [{**row, "group_by": "", "category": ""} for row in rows]
    if column not in columns:
        return plain
    by_category = [{**row, "group_by": column, "category": cell_text(row[column])} for row in rows]
    return plain + [row for row in by_category if row["category"] != ""]


def _meta(path: str | Path, key: str) -> dict | None:
    try:
        return json.loads((_run_dir(path) / "meta.json").read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
        return None


def load_machine(path: str | Path) -> dict | None:
    """The machine fingerprint in a run's meta.json; None without one (or without meta.json)."""
    return _meta(path, "machine")


def load_config(path: str | Path) -> dict | None:
    """The options a run was made with (meta.json's config); None without them."""
    return _meta(path, "config")


def cell_text(value) -> str:
    """A key cell as text: 4.0 shows as 4, a blank as nothing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value).strip()


def runs_in(path: Path) -> list[Path]:
    """The runs in a directory of runs, newest name first."""
    return sorted((d for d in path.iterdir() if (d / "summary.csv").is_file()), key=lambda d: d.name, reverse=True)


def pick_baseline(path: str | Path, machine: dict | None) -> tuple[Path, str]:
    """``path`` itself when it is a run; in a directory of runs (baselines of several machines) the
    newest measured on ``machine``, else the newest of all, with a note saying so."""
    path = Path(path)
    if path.is_file() or (path / "summary.csv").is_file() or not path.is_dir():
        return path, ""
    if not (runs := runs_in(path)):
        raise SpecbenchError(f"{path} holds no run (no summary.csv in it or its subdirectories): pass a run directory")
    same = [d for d in runs if machine is not None and load_machine(d) == machine]
    if same:
        return same[0], f"baseline: {same[0]} (measured on this machine)"
    return runs[0], (
        f"baseline: {runs[0]}; none of {path}'s runs was measured on this machine, so its timings are not judged "
        f"(`make baseline` records one)"
    )


def same_machine(baseline: str | Path, current: str | Path) -> bool:
    """Whether the baseline that compare takes for the run ``current`` (pick_baseline) was measured on
    its machine, so that its timings are judged: `make ci-bench` gates speedup only then."""
    machine = load_machine(current)
    try:
        return machine is not None and load_machine(pick_baseline(baseline, machine)[0]) == machine
    except SpecbenchError:  # no run there: the compare that follows says so
        return False
