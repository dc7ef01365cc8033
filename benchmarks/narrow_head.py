"""An EAGLE head cut to a smaller vocabulary without training again: of the ids it scores, the N that
the target ranked first most often in a distill run's training data, each with its own LM head row.
The head's layer is untouched and its top token is unchanged wherever that token is kept, so the cut
head measures what the larger vocabulary itself buys (coverage, acceptance) against what it costs (c).

    python benchmarks/narrow_head.py HEAD DISTILL_DIR --vocab N --out DIR

DISTILL_DIR is the `specbench distill --kind eagle` directory the head was trained in (its stored
answers rank the ids, as distill ranked them). DIR gets the cut head in the published format.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import torch

from specbench.models.eagle_head import save_head
from specbench.models.load import load, speculator_dir
from specbench.training.distill import DistillConfig, coverage, head_tokens, load_examples
from specbench.training.distill_eagle import new_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("head", help="a head's directory or alias")
    parser.add_argument("distill_dir", type=Path)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    recipe = json.loads((args.distill_dir / "distill.json").read_text())
    known = {f.name for f in fields(DistillConfig)} - {"out", "init"}
    cfg = DistillConfig(out=args.distill_dir, init=args.head, **{k: v for k, v in recipe.items() if k in known})
    target = load(cfg.target, torch.device("cpu"), torch.float32)
    examples, held_out = load_examples(cfg)
    ids = head_tokens(examples, args.vocab, target.width)
    wide = speculator_dir(args.head)
    wide_ids = set(head_tokens(examples, recipe["draft_vocab"], target.width))
    if not set(ids) <= wide_ids:
        raise SystemExit(f"{args.head} does not score all of the {args.vocab} ids: give a vocabulary below its own")
    # new_head keeps the rows of the ids the head scored: all of them here, so nothing starts afresh.
    save_head(new_head(cfg, target, ids), args.out, target.model.config.num_hidden_layers)
    print(
        f"{wide}: {len(wide_ids)} ids, held-out coverage {coverage(sorted(wide_ids), held_out):.4f}; "
        f"{args.out}: {len(ids)} ids, held-out coverage {coverage(ids, held_out):.4f}"
    )


if __name__ == "__main__":
    main()
