"""How much of what the target wrote a drafter could have proposed at all: per category of a run,
the share of the baseline's output tokens that lie in the drafter's vocabulary.

    python benchmarks/vocabulary_coverage.py RUN_DIR DRAFTER_DIR [DRAFTER_DIR ...]

A drafter scores a reduced vocabulary: an EAGLE head the ids its ``d2t`` maps to, a distilled draft
the ids of its ``head_tokens.json`` (with every id it has read in the sequence, which this leaves
out). A token outside is rejected for sure, so the share bounds what the drafter can accept. The
baseline's tokens are the ``token_ids`` of its rows in RUN_DIR/outputs.jsonl; each turn's category
is its row's in RUN_DIR/records.csv.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file


def vocabulary(drafter: Path) -> set[int]:
    """The target ids a drafter's checkpoint scores."""
    shortlist = drafter / "head_tokens.json"
    if shortlist.is_file():
        return set(json.loads(shortlist.read_text()))
    d2t = load_file(drafter / "model.safetensors")["d2t"].long()
    return set((torch.arange(len(d2t)) + d2t).tolist())


def coverage(run: Path, vocabularies: dict[str, set[int]]) -> pd.DataFrame:
    records = pd.read_csv(run / "records.csv")
    baseline = records[records["method"] == "baseline"].drop_duplicates(["prompt_index", "turn"])
    categories = baseline.set_index(["prompt_index", "turn"])["category"]
    rows = []
    for line in (run / "outputs.jsonl").read_text().splitlines():
        out = json.loads(line)
        if out["method"] != "baseline":
            continue
        category = categories.get((out["prompt_index"], out["turn"]), "")
        for name, ids in vocabularies.items():
            inside = sum(t in ids for t in out["token_ids"])
            rows.append({"category": category, "drafter": name, "inside": inside, "tokens": len(out["token_ids"])})
    df = pd.DataFrame(rows)
    overall = df.assign(category="all")
    table = pd.concat([df, overall]).groupby(["category", "drafter"], sort=False)[["inside", "tokens"]].sum()
    return (table["inside"] / table["tokens"]).unstack("drafter").round(3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("drafters", type=Path, nargs="+")
    args = parser.parse_args()
    vocabularies = {str(d): vocabulary(d) for d in args.drafters}
    for name, ids in vocabularies.items():
        print(f"{name}: {len(ids)} ids")
    print(coverage(args.run, vocabularies).to_string())


if __name__ == "__main__":
    main()
