"""EAGLE heads side by side on one distill run's held-out answers: each head's top-1 agreement with
the target at training-time test steps 0, 1 and 2, by the source of the prompt (sharegpt, humaneval
or a file).

    python benchmarks/held_out_agreement.py DISTILL_DIR HEAD [HEAD ...] [--target T]

DISTILL_DIR is a `specbench distill --kind eagle` output directory with its generated/ answers and
features/ (what the run stored). Its held-out answers are the ones distill held out (every 16th
greedy answer), so a head trained in DISTILL_DIR never saw them; another head may have been trained
on other data. Agreement at step 0 estimates greedy acceptance of the first drafted token.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from specbench.models.eagle_head import load_head
from specbench.models.load import load, speculator_dir
from specbench.models.student import Example
from specbench.training.distill import DistillConfig, is_sampled
from specbench.training.distill_eagle import FEATURES, ttt_agreement


def held_out_by_source(out: Path) -> dict[str, list[Example]]:
    """The answers distill held out in ``out``, with their stored features, by prompt source."""
    recipe = json.loads((out / "distill.json").read_text())
    cfg = DistillConfig(out=out, sampled_fraction=recipe["sampled_fraction"])
    by_source, seen = defaultdict(list), 0
    for path in sorted((out / "generated").glob("*.pt")):
        greedy = not is_sampled(cfg, int(path.stem))
        features = torch.load(out / FEATURES / "generated" / path.name)
        for doc, f in zip(torch.load(path), features, strict=True):
            if greedy and seen % 16 == 0:  # load_examples' rule, counted over all answers as it counts
                example = Example(doc["ids"], doc["prompt_len"] - 1, doc["top_logp"], doc["top_idx"], features=f)
                by_source[doc.get("source", "humaneval")].append(example)
            seen += 1
    return dict(by_source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("distill_dir", type=Path)
    parser.add_argument("heads", nargs="+", help="heads: directories or aliases")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    target = load(args.target, torch.device("cpu"), torch.float32)
    held = held_out_by_source(args.distill_dir)
    print("held out:", {source: len(examples) for source, examples in held.items()})
    for head_dir in args.heads:
        head = load_head(speculator_dir(head_dir), target.model, pack=False).float()
        for source, examples in sorted(held.items()):
            agreement = ttt_agreement(head, examples, 8, args.steps)
            print(f"{head_dir}  {source:10s}  " + " / ".join(f"{a:.3f}" for a in agreement))


if __name__ == "__main__":
    main()
