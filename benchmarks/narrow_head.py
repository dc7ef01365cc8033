"""An EAGLE head cut to a smaller vocabulary without training again: of the ids it scores, the N that
the target ranked first most often in a distill run's training data, each with its own LM head row.
The head's layer is untouched and its top token is unchanged wherever that token is kept, so the cut
head measures what the larger vocabulary itself buys (coverage, acceptance) against what it costs (c).

    python benchmarks/narrow_head.py HEAD DISTILL_DIR --vocab N --out DIR

DISTILL_DIR is the `specbench distill --kind eagle` directory the head was trained in (its stored
answers rank the ids, as distill ranked them). DIR gets the cut head in the published format, and a
distill.json: DISTILL_DIR's recipe, the cut head's vocabulary, held-out coverage and agreement, and
the same figures of the head it was cut from under ``cut_from``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import torch

from benchmarks.held_out_agreement import held_out_by_source
from benchmarks.vocabulary_coverage import vocabulary
from specbench.models.eagle_head import save_head
from specbench.models.load import load, speculator_dir
from specbench.training.distill import DistillConfig, coverage, head_tokens, load_examples
from specbench.training.distill_eagle import new_head, ttt_agreement


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
    examples, _ = load_examples(cfg)
    ids = head_tokens(examples, args.vocab, target.width)
    wide = speculator_dir(args.head)
    wide_ids = vocabulary(wide)  # the ids the head scores, read from its d2t
    if not set(ids) <= wide_ids:
        raise SystemExit(f"{args.head} does not score all of the {args.vocab} ids: give a vocabulary below its own")
    # new_head keeps the rows of the ids the head scored: all of them here, so nothing starts afresh.
    head = new_head(cfg, target, ids)
    save_head(head, args.out, target.model.config.num_hidden_layers)
    # distill's held-out answers, with their features
    held_out = [e for examples in held_out_by_source(args.distill_dir).values() for e in examples]
    agreement = list(ttt_agreement(head, held_out, cfg.batch, cfg.ttt_steps))
    cut_from = {
        "head": str(wide),
        "draft_vocab": len(wide_ids),
        "held_out_coverage": coverage(sorted(wide_ids), held_out),
        "held_out_agreement_by_step": recipe["held_out_agreement_by_step"],
        "by": "benchmarks/narrow_head.py",
    }
    figures = {
        "draft_vocab": len(ids),
        "held_out_coverage": coverage(ids, held_out),
        "held_out_greedy_agreement": agreement[0],
        "held_out_agreement_by_step": agreement,
    }
    (args.out / "distill.json").write_text(json.dumps({**recipe, **figures, "cut_from": cut_from}, indent=2) + "\n")
    for name, facts in ((wide, cut_from), (args.out, figures)):
        steps = " / ".join(f"{a:.3f}" for a in facts["held_out_agreement_by_step"])
        print(
            f"{name}: {facts['draft_vocab']} ids, held-out coverage {facts['held_out_coverage']:.4f}, agreement {steps}"
        )


if __name__ == "__main__":
    main()
