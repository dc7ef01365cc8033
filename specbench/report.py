"""Results on disk (CSV, JSONL, JSON) and on screen (rich tables). Rows are appended and
flushed as they complete, so an interrupted run keeps everything it measured."""

from __future__ import annotations

import csv
import json
import math
import platform
import subprocess
from pathlib import Path

from rich.table import Table

from . import __version__


class RunWriter:
    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self._writers: dict[str, tuple[object, csv.DictWriter]] = {}
        self._outputs = open(out / "outputs.jsonl", "w", encoding="utf-8")

    def append(self, name: str, row: dict) -> None:
        """Append a row to ``name`` (a CSV in the run directory), writing the header first."""
        if name not in self._writers:
            f = open(self.out / name, "w", newline="", encoding="utf-8")
            self._writers[name] = (f, csv.DictWriter(f, fieldnames=list(row)))
            self._writers[name][1].writeheader()
        f, writer = self._writers[name]
        writer.writerow(row)
        f.flush()

    def output(self, prompt_id: str, k: int | None, method: str, token_ids: list[int], text: str) -> None:
        obj = {"prompt_id": prompt_id, "k": k, "method": method, "token_ids": token_ids, "text": text}
        self._outputs.write(json.dumps(obj) + "\n")
        self._outputs.flush()

    def write_csv(self, name: str, rows: list[dict]) -> None:
        """Replace ``name`` with ``rows`` (for files rewritten whole, like summary.csv)."""
        if not rows:
            return
        tmp = self.out / (name + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(self.out / name)

    def write_json(self, name: str, obj: dict) -> None:
        (self.out / name).write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")

    def close(self) -> None:
        for f, _ in self._writers.values():
            f.close()
        self._outputs.close()


def environment(device_name: str) -> dict:
    import torch
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "specbench": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "device_name": device_name,
        "git_commit": commit,
    }


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


SUMMARY_COLUMNS = [
    ("k", "K"),
    ("method", "method"),
    ("alpha", "alpha"),
    ("acceptance_rate", "accepted"),
    ("tau", "tau"),
    ("c", "c"),
    ("verify_ratio", "verify"),
    ("baseline_tokens_per_s", "base tok/s"),
    ("spec_tokens_per_s", "tok/s"),
    ("speedup", "speedup"),
    ("predicted_speedup", "pred"),
    ("predicted_speedup_verify", "pred+verify"),
    ("outputs_match", "= base"),
]


def summary_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for _, header in SUMMARY_COLUMNS:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(_fmt(row.get(key, "")) for key, _ in SUMMARY_COLUMNS))
    return table
