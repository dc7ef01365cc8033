"""EAGLE heads side by side on one distill run's held-out answers: each head's top-1 agreement with
the target at training-time test steps 0, 1 and 2, by the source of the prompt (sharegpt, humaneval
or a file).

    python benchmarks/held_out_agreement.py DISTILL_DIR HEAD [HEAD ...] [--trained-on DIR ...] [--target T]

DISTILL_DIR is a `specbench distill --kind eagle` output directory with its generated/ answers and
features/ (what the run stored). Its held-out answers are the ones distill held out (every 16th
greedy answer), so a head trained in DISTILL_DIR never saw them. A head trained in another run may
have: runs with other seeds draw from the same prompts (on the default pair's ShareGPT, two draws of
3,072 prompts shared 842), and the greedy answer to a prompt is the same answer. --trained-on names
those runs, and held-out answers to their prompts are left out. Agreement at step 0 estimates greedy
acceptance of the first drafted token.
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
from specbench.training.distill import answer_shards, feature_path, prompt_of
from specbench.training.distill_eagle import ttt_agreement


def answers(out: Path, features: bool = False):
    """Each answer distill stored in ``out``, in load_examples' order: (held out, prompt ids, doc, features or None)."""
    recipe = json.loads((out / "distill.json").read_text())
    for path, docs, held in answer_shards(out, recipe["sampled_fraction"]):
        stored = torch.load(feature_path(path)) if features else [None] * len(docs)
        for doc, h, f in zip(docs, held, stored, strict=True):
            yield h, prompt_of(doc), doc, f


def held_out_by_source(out: Path, trained_on: list[Path] = ()) -> tuple[dict[str, list[Example]], int]:
    """The answers distill held out in ``out``, with their stored features, by prompt source; less
    those whose prompt some run in ``trained_on`` trained on (two runs' seeds may draw the same
    prompt, and a greedy answer to it is the same answer). Also returns how many were left out."""
    seen_prompts = {prompt for run in trained_on for held, prompt, _, _ in answers(run) if not held}
    by_source, left_out = defaultdict(list), 0
    for held, prompt, doc, f in answers(out, features=True):
        if not held:
            continue
        if prompt in seen_prompts:
            left_out += 1
            continue
        example = Example(doc["ids"], doc["prompt_len"] - 1, doc["top_logp"], doc["top_idx"], features=f)
        by_source[doc.get("source", "humaneval")].append(example)
    return dict(by_source), left_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("distill_dir", type=Path)
    parser.add_argument("heads", nargs="+", help="heads: directories or aliases")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--trained-on",
        type=Path,
        nargs="*",
        default=[],
        help="other distill directories whose answers a compared head trained on: held-out answers to their prompts are left out",
    )
    args = parser.parse_args()
    target = load(args.target, torch.device("cpu"), torch.float32)
    held, left_out = held_out_by_source(args.distill_dir, args.trained_on)
    print(
        "held out:", {source: len(examples) for source, examples in held.items()}, f"({left_out} left out: trained on)"
    )
    for head_dir in args.heads:
        head = load_head(speculator_dir(head_dir), target.model, pack=False).float()
        for source, examples in sorted(held.items()):
            agreement = ttt_agreement(head, examples, 8, args.steps)
            print(f"{head_dir}  {source:10s}  " + " / ".join(f"{a:.3f}" for a in agreement))


if __name__ == "__main__":
    main()
