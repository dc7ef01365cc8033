"""The three ``specbench distill --teacher-engine`` choices side by side on the same chat prompts:
how long each takes to start, how fast it then writes the target's answers (with their top-k
log-probabilities, as distill stores them), and how many of its greedy answers equal torch's.

    .venv-vllm/bin/python benchmarks/teacher_engines.py --prompts 128 --batch 64

Run it from the vLLM environment (make install-vllm) with llama-server built (make
install-llama-cpp), on a quiet machine: the engines run one after another, each on the same prompts
(ShareGPT first turns through the target's chat template, distill's --data sharegpt), in distill's
batches, greedy. Each engine's start is timed apart from its answers. torch's batched generate
and each engine's own arithmetic may tie-break differently, so an answer that differs is not wrong;
distill checks the log-probabilities themselves (teacher.json).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from specbench.models.load import load
from specbench.training.distill import DistillConfig, answering
from specbench.training.distill_data import answered_prompts
from specbench.training.teacher import ENGINES


def timed_engine(cfg: DistillConfig, target, batches: list[list[list[int]]]) -> tuple[dict, list[list[int]]]:
    """One engine's start and answer seconds over ``batches``, and its answers' tokens."""
    longest = max(len(p) for batch in batches for p in batch)
    started = time.perf_counter()
    with answering(cfg, target, longest) as answer:
        start_s = time.perf_counter() - started
        answered = time.perf_counter()
        tokens = [a.tokens for batch in batches for a in answer(batch, False, cfg.seed)]
        answer_s = time.perf_counter() - answered
    written = sum(map(len, tokens))
    row = {"engine": cfg.teacher_engine, "start_s": round(start_s, 1), "answer_s": round(answer_s, 1)}
    return row | {"answer_tokens": written, "tokens_per_s": round(written / answer_s, 1)}, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, torch first")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64, help="distill's --generate-batch")
    parser.add_argument("--new-tokens", type=int, default=128, help="distill's --generate-new-tokens")
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--out", type=Path, help="write the rows here as JSON too")
    args = parser.parse_args()

    target = load(args.target, torch.device("cpu"), torch.float32)  # as distill loads it
    _, prompts = answered_prompts(target.tokenizer, "sharegpt", args.prompts, [], 0, 1024)
    prompts.sort(key=len)  # as distill batches them: similar lengths together
    batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    rows, first = [], None
    with tempfile.TemporaryDirectory() as scratch:
        for engine in args.engines.split(","):
            cfg = DistillConfig(
                out=Path(scratch),
                target=args.target,
                teacher_engine=engine,
                generate_batch=args.batch,
                generate_new_tokens=args.new_tokens,
                top_k=args.top_k,
            )
            row, tokens = timed_engine(cfg, target, batches)
            first = first or tokens
            row["answers_equal_to_first"] = sum(a == b for a, b in zip(tokens, first, strict=True)) / len(tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{len(prompts)} ShareGPT prompts, batches of {args.batch}, {args.new_tokens} new tokens, greedy\n")
    print("| engine | start s | answer s | answer tokens | tokens/s | answers equal to " + rows[0]["engine"] + "'s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['start_s']} | {r['answer_s']} | {r['answer_tokens']} | {r['tokens_per_s']} "
            f"| {r['answers_equal_to_first']:.0%} |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":  # vLLM starts its workers by spawning this module again
    main()
