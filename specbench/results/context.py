"""The context sweep's files (`specbench sweep-context`): context.csv, a row per context length,
method and K with the cost of a target step there, and crossover.json, the length from which each
method beats the baseline and the rival."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pandas as pd

from specbench.core import metrics
from specbench.core.files import replacing
from specbench.core.options import FIXED
from specbench.methods.registry import BASELINE, DEFAULT
from specbench.results import schema
from specbench.results.summary import row_label

# What ties a summary row to its records (a decoder of one engine); blanks and NaN read alike.
DECODER_COLUMNS = ("engine", "method", "k", "tree", "k_policy")


def decoder_key(row) -> tuple[str, ...]:
    """A summary or records row's decoder (DECODER_COLUMNS), blanks and NaN alike."""
    return tuple("" if pd.isna(row[c]) else str(row[c]) for c in DECODER_COLUMNS)


def decode_parts(records: pd.DataFrame) -> dict[tuple[str, ...], pd.DataFrame]:
    """The decode proper of each decoder's prompts (records.csv's rows, by decoder_key, then by
    prompt_index): the tokens after the prefill's first, and the seconds after the prefill."""
    parts = pd.DataFrame(
        {"tokens": records["new_tokens"] - 1, "seconds": records["method_s"] - records["prefill_s"]}
    ).set_index(records["prompt_index"])
    return {key: mine for key, mine in parts.groupby(records.apply(decoder_key, axis=1).to_numpy())}


def decode_interval(base: pd.DataFrame, cur: pd.DataFrame, confidence: float = 0.95) -> tuple[float, float]:
    """The interval of the decode rate of ``cur`` over ``base`` (decode_parts of the same prompts): a
    paired bootstrap over the prompts. NaN for fewer than 2 prompts, where there is nothing to resample."""
    both = base.add_suffix("_base").join(cur, how="inner")
    if len(both) < 2:
        return math.nan, math.nan
    _, low, high = metrics.paired_change(
        both[["tokens_base", "seconds_base"]].to_numpy(), both[["tokens", "seconds"]].to_numpy(), confidence
    )
    return 1 + low, 1 + high


def context_rows(runs: dict[int, Path]) -> list[dict]:
    """context.csv: a row per context length, method and K of a context sweep (``runs``: context
    length -> its run directory), with the cost of a target step there and what each method got: its
    decode speedup with a 95% interval over the prompts, and over the rival's."""
    rows = []
    for context, run_dir in sorted(runs.items()):
        summary = pd.read_csv(run_dir / "summary.csv")
        costs = pd.read_csv(run_dir / "verify_cost.csv")
        records = pd.read_csv(run_dir / "records.csv")
        step = costs.loc[(costs["model"] == "target") & (costs["tokens"] == 1), "seconds"].iloc[0]
        parts = decode_parts(records)  # a row's decoder wrote records of every prompt it decoded
        # each engine's decoders against that engine's own baseline
        baselines = {key[0]: p for key, p in parts.items() if key[1] == BASELINE.name}
        for row in summary.to_dict("records"):
            mine = parts.get(decoder_key(row), pd.DataFrame(columns=["tokens", "seconds"]))  # none: no interval
            baseline = baselines.get(decoder_key(row)[0])
            inner = row.get("inner_drafted", math.nan)
            rows.append(
                {
                    "context_tokens": context,
                    "method": row["method"],
                    "k": row["k"],
                    "k_policy": row["k_policy"] if isinstance(row["k_policy"], str) else "",  # NaN: no K
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
                    "decode_speedup_low": math.nan if baseline is None else decode_interval(baseline, mine)[0],
                    "parts": mine,  # for the interval over the rival's, below; not written
                    "outputs_match": row["outputs_match"],
                    "structural": row["structural"],
                }
            )
    for row in rows:  # the method's decode speedup over the rival's at the same length and K
        same = [r for r in rows if is_rival(r) and r["context_tokens"] == row["context_tokens"]]
        same = [r for r in same if r["k"] == row["k"]] or same
        held = same and row["method"] != CONTENDERS[0] and not is_rival(row)
        row["vs_speculative"] = row["decode_speedup"] / same[0]["decode_speedup"] if held else math.nan
        row["vs_speculative_low"] = decode_interval(same[0]["parts"], row["parts"])[0] if held else math.nan
    for row in rows:
        del row["parts"]
    return rows


# The baseline, and the rival a context sweep holds every other method to: the default method (one
# draft model, one level; speculative) at a fixed K.
CONTENDERS = (BASELINE.name, DEFAULT[0])


def is_rival(row: dict) -> bool:
    """A row of the context sweep's rival: the default method with a fixed K (its other policies are held to it)."""
    return row["method"] == CONTENDERS[1] and row["k_policy"] == FIXED


def crossovers(rows: list[dict]) -> dict[str, dict]:
    """Per method and K of a context sweep: the shortest context from which its decode speedup stays
    above the baseline's, and above speculative's, by the lower end of its 95% interval over the
    prompts (None: not at the longest context measured). A sweep of fewer than 2 prompts has no
    interval and names no crossover ("judged": False)."""
    found: dict[str, dict] = {}
    rivals = {row_label(row) for row in rows if is_rival(row)}
    for row in rows:
        if row["method"] == CONTENDERS[0]:
            continue
        found.setdefault(row_label(row), {"speedup": {}, "vs_speculative": {}})
        found[row_label(row)]["speedup"][row["context_tokens"]] = row["decode_speedup_low"]
        found[row_label(row)]["vs_speculative"][row["context_tokens"]] = row["vs_speculative_low"]
    judged = all(row["num_prompts"] >= 2 for row in rows)
    return {
        label: {
            "beats_baseline_from": metrics.wins_from(by["speedup"]),
            "beats_speculative_from": None if label in rivals else metrics.wins_from(by["vs_speculative"]),
            "judged": judged,
        }
        for label, by in found.items()
    }


def write_context(out: Path, runs: dict[int, Path]) -> tuple[list[dict], dict]:
    """context.csv and crossover.json of a context sweep in ``out``; returns both."""
    rows = context_rows(runs)
    wins = crossovers(rows)
    with replacing(out / "context.csv") as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=schema.CONTEXT)
        writer.writeheader()
        writer.writerows(rows)
    with replacing(out / "crossover.json") as tmp:
        tmp.write_text(json.dumps(wins, indent=2) + "\n", encoding="utf-8")
    return rows, wins
