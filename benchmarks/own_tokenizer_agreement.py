"""Drafts with their own tokenizer beside drafts that share the target's, on prompts no draft trained
on: the first prompts of evaluation datasets (--dataset sharegpt's first conversations, which
distill never asks; HumanEval's problems), first turns rendered as `specbench run` renders them. The
target answers each greedily, and each draft is read against those answers, teacher-forced:

- a draft of the target's tokenizer: its greedy token is the target's next token (top-1 agreement,
  which estimates greedy acceptance; the full vocabulary, without the shipped shortlist);
- a draft of its own tokenizer (`specbench distill --tokenizer-vocab`): the answer re-tokenized with
  the draft's tokenizer, and at each of its positions the draft's greedy token's text begins the
  target's remaining text (text agreement) or is the answer's next token (token agreement), as
  distill's held-out figures; and the target's tokens per draft token.

    python benchmarks/own_tokenizer_agreement.py DRAFT_DIR [DRAFT_DIR ...] [--dataset sharegpt --dataset humaneval]
"""

from __future__ import annotations

import argparse

import torch

from specbench.models.load import load
from specbench.models.pair import encode_turn
from specbench.models.student import Example
from specbench.training.distill import agreement
from specbench.training.distill_own_tokenizer import StoredAnswer, answer_example, text_agreement
from specbench.training.draft_tokenizer import same_vocabulary, token_bytes
from specbench.training.teacher import torch_answers
from specbench.workloads.prompts import load_prompts


def answered(target, dataset: str, count: int, new_tokens: int, batch: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) of the target for the first ``count`` prompts of ``dataset``."""
    prompts = [encode_turn(target.tokenizer, p, [], chat=True).tolist() for p in load_prompts(dataset, count)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answer = torch_answers(target, new_tokens, 1)
    found = {}
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        for i, a in zip(rows, answer([prompts[i] for i in rows], False, 0), strict=True):
            found[i] = (prompts[i], a.tokens)
    return [found[i] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafts", nargs="+", help="draft checkpoint directories")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dataset", action="append", help="default: sharegpt and humaneval")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = load(args.target, torch.device("cpu"), torch.float32)
    tok = target.tokenizer
    for dataset in args.dataset or ["sharegpt", "humaneval"]:
        pairs = answered(target, dataset, args.prompts, args.max_new_tokens, args.batch)
        print(f"{dataset}: {len(pairs)} prompts, {sum(len(a) for _, a in pairs)} answer tokens of the target")
        for draft_dir in args.drafts:
            tokenizer = AutoTokenizer.from_pretrained(draft_dir)
            model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
            if same_vocabulary(tokenizer, tok):
                examples = [
                    Example(torch.tensor(p + a), len(p) - 1, torch.zeros(len(a), 1), torch.tensor(a)[:, None])
                    for p, a in pairs
                    if a
                ]
                top1 = agreement(model, examples, args.batch)
                print(f"  {draft_dir}: the target's tokenizer, top-1 agreement {top1:.3f}")
                continue

            def text(ids: list[int]) -> str:
                return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

            stored = [StoredAnswer(text(p), text(a), True, len(a)) for p, a in pairs]
            kept = [(s, e) for s, e in ((s, answer_example(tokenizer, s)) for s in stored) if e is not None]
            examples = [e for _, e in kept]
            special = set(tokenizer.added_tokens_decoder)
            by_text, by_token = text_agreement(model, examples, token_bytes(tokenizer), special, args.batch)
            per = sum(s.target_tokens for s, _ in kept) / sum(len(e.top_idx) for e in examples)
            print(
                f"  {draft_dir}: its own tokenizer ({len(tokenizer)} tokens), text agreement {by_text:.3f}, "
                f"token agreement {by_token:.3f}, {per:.3f} target tokens per draft token"
            )


if __name__ == "__main__":
    main()
