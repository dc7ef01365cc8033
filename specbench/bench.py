"""The benchmark: prompts x methods x K, timed, read top to bottom in ``benchmark``.

It loads the pair and the prompts, measures the forward costs, warms up, then decodes every
prompt with the baseline and each method, writing each row as it completes (results.RunWriter).
It yields what it is doing, then its Results; it never prints.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import BenchConfig
from .costs import ForwardCosts, measure_costs, noisy_costs
from .errors import SpecbenchError
from .machine import environment
from .methods import BASELINE, Decoder
from .models import placement
from .pair import Pair, encode_prompts, load_pair, prompts_hash
from .plot import plot_online, plot_phases, plot_run
from .prompts import Prompt, load_prompts
from .results import (
    WEIGHT_DEPENDENT,
    Measurement,
    RunWriter,
    acceptance_rows,
    best_ks,
    online_row,
    predicted_rows,
    record,
    results_document,
    suggestions,
    summarize,
)
from .timing import PhaseClock, synchronize

SUMMARY_EVERY_S = 10.0  # summary.csv is rewritten at most this often while decoding, and at the end


def generator_for(device: torch.device, seed: int, prompt_index: int, method: str) -> torch.Generator:
    """An independent, reproducible random stream per (seed, prompt, method), from a stable hash of
    the three: adding, removing or reordering methods changes no other method's samples."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{method}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


def decode(pair: Pair, cfg: BenchConfig, ids: torch.Tensor, index: int, decoder: Decoder) -> Measurement:
    """Time one prompt's decode cfg.repeats times (each from the same seed, so identical work) and
    keep the median run, phases and all.

    A decode's wall time is its phase clock's span, from the synchronised start to the last lap,
    so its phases add up to it exactly: nothing done outside the clock (the generator's creation, a
    garbage collection there) is counted in the time but in no phase."""
    clock = PhaseClock(pair.device)
    timed = pair.timed(clock)
    runs = []
    for _ in range(cfg.repeats):
        generator = generator_for(pair.device, cfg.seed, index, decoder.method.name)
        synchronize(pair.device)
        clock.start()
        result = decoder.method.decode(timed, cfg, decoder, ids, generator)
        runs.append((result, clock.stop()))  # stop waits for the device
    result, phases = sorted(runs, key=lambda run: run[1].total)[(len(runs) - 1) // 2]
    return Measurement(result, phases.total, phases)


def warm_up(pair: Pair, cfg: BenchConfig, prompt_ids: list[torch.Tensor], plan: list[Decoder]) -> None:
    """Untimed runs of every decoder, so allocation, kernel selection and caches settle first (a
    method that learns learns nothing from them: it learns in after_prompt)."""
    for _ in range(cfg.warmup):
        for decoder in [Decoder(BASELINE), *plan]:
            decode(pair, cfg, prompt_ids[0], 0, decoder)


def prepare(cfg: BenchConfig) -> tuple[Pair, list[Prompt], list[torch.Tensor]]:
    """Validate, load the pair and the prompts; every input error surfaces here, before timing."""
    cfg.validate()
    prompts = load_prompts(cfg.dataset, cfg.num_prompts, cfg.prompt_field, cfg.context_tokens, cfg.seed)
    pair = load_pair(cfg)
    for step in cfg.plan:
        step.method.check(pair)
    return pair, prompts, encode_prompts(pair, prompts, cfg)


@dataclass
class Step:
    """What the benchmark is doing: a stage, and for decoding how far it got."""

    stage: str
    done: int = 0
    total: int = 0
    label: str = ""


@dataclass
class Results:
    out: Path
    title: str
    summary: list[dict]
    best_ks: dict
    suggestions: list[str]
    plots: list[Path]
    greedy: bool
    predicted: list[dict] = field(default_factory=list)  # predicted.csv


def benchmark(
    cfg: BenchConfig,
    out: Path,
    resume: bool = False,
    prefill_progress: Callable[[int, int], None] | None = None,
) -> Iterator[Step | Results]:
    """Run ``cfg`` into the run directory ``out``, yielding Steps as it goes and Results at the end.

    With ``resume``, a run interrupted in ``out`` with the same configuration continues: prompts
    complete in records.csv keep their rows and outputs; the others are decoded now.
    ``prefill_progress`` is told (tokens done, tokens) as a prompt longer than --prefill-chunk is read.
    """
    cfg.validate()
    if resume and cfg.learns:
        raise SpecbenchError(
            "--resume cannot restore what --method online learned before the interruption: run it again without --resume"
        )
    writer = RunWriter(out)  # fails on an unusable directory before anything is loaded
    previous = writer.previous_run(cfg.as_dict()) if resume else None
    yield Step("loading models and prompts")
    pair, prompts, prompt_ids = prepare(cfg)
    for lm in (pair.target_lm, pair.draft_lm):
        if lm is not None:
            lm.prefill_chunk, lm.progress = cfg.prefill_chunk, prefill_progress
    run_hash = prompts_hash(prompt_ids)
    if previous is not None and previous.prompts_hash != run_hash:
        raise SpecbenchError(
            f"--resume: the prompts now encode differently from the run in {out} (a changed dataset, template or tokenizer): run without --resume"
        )
    run_info = {
        "target": cfg.target,
        "draft": cfg.draft,
        "dataset": cfg.dataset,
        "device": str(pair.device),
        "dtype": str(pair.dtype).removeprefix("torch."),
        "prompts_hash": run_hash,
    }
    resolved = {
        **run_info,
        "target_path": str(pair.target.path),
        "draft_path": str(pair.draft.path) if pair.draft else None,
        "weights": "random" if cfg.random_weights else "checkpoint",
        # Where accelerate put each module of the target (None: all on the device above).
        "device_map": placement(pair.target.model) if cfg.device_map else None,
    }
    meta = {**environment(pair.device), "config": cfg.as_dict(), "resolved": resolved}
    writer.write_json("meta.json", meta)

    plan = cfg.plan  # one plan for the run: a method that learns keeps its state in its decoder
    for step in plan:
        step.method.begin_run(pair, cfg, step)
    if previous is not None and previous.costs:
        costs = ForwardCosts.from_rows(previous.costs)
    else:
        yield Step("measuring forward costs (c, verify_ratio)")
        costs = measure_costs(pair, prompt_ids, cfg, plan)
        writer.write_csv("verify_cost.csv", costs.rows())
    done = previous.complete_prompts(1 + len(plan)) if previous is not None else set()
    records = writer.start_records([r for r in previous.records if r["prompt_index"] in done] if previous else [], done)
    todo = [i for i in range(len(prompts)) if i not in done]
    if todo:  # a resumed run with nothing left to decode only writes its summary again
        yield Step("warming up")
        warm_up(pair, cfg, prompt_ids, plan)
    total, finished, written = len(todo) * (1 + len(plan)), 0, time.monotonic()
    learning: list[dict] = []  # online.csv
    try:
        for index in todo:
            prompt, ids = prompts[index], prompt_ids[index]
            baseline = decode(pair, cfg, ids, index, Decoder(BASELINE))
            for decoder in [Decoder(BASELINE), *plan]:
                measured = baseline if decoder.method is BASELINE else decode(pair, cfg, ids, index, decoder)
                learned = decoder.method.after_prompt(decoder, ids, measured.result)
                tokens = measured.result.tokens
                text = pair.target.tokenizer.decode(tokens) if pair.target.tokenizer else ""
                writer.output(prompt.id, index, decoder.k, decoder.method.name, tokens, text, decoder.shape)
                records.append(record(prompt, index, ids, baseline, decoder, measured, learned))
                if cfg.random_weights:
                    records[-1].update((name, math.nan) for name in WEIGHT_DEPENDENT if name in records[-1])
                writer.append_record(records[-1])
                if learned is not None:
                    learning.append(online_row(records[-1], learned))
                    writer.write_csv("online.csv", learning)
                finished += 1
                yield Step("decoding", finished, total, decoder.label)
                if time.monotonic() - written > SUMMARY_EVERY_S:
                    writer.write_csv("summary.csv", summarize(records, costs, cfg, run_info, plan))
                    written = time.monotonic()
    finally:
        summary = summarize(records, costs, cfg, run_info, plan)
        writer.write_csv("summary.csv", summary)
        writer.write_csv("acceptance.csv", acceptance_rows(records))
        writer.write_json("results.json", results_document(meta, summary, records))
        writer.close()
        if cfg.save_draft:  # what was learned is kept, also when the run was interrupted
            learners = [step for step in plan if step.method.learns]
            for step in learners:
                step.method.save(step, Path(cfg.save_draft) / (f"k{step.k}" if len(learners) > 1 else ""))
    picks = {} if cfg.random_weights else best_ks(summary)
    if picks:
        writer.write_json("best_k.json", picks)
    predicted = predicted_rows(cfg.assume_alpha, costs) if costs.draft_single is not None else []
    if predicted:
        writer.write_csv("predicted.csv", predicted)
    plots = (
        [path for path in (plot_phases(out), plot_run(out), plot_online(out)) if path is not None] if summary else []
    )
    title = f"{cfg.target} <- {cfg.draft}" if pair.draft else cfg.target
    if cfg.random_weights:
        lengths = f"{cfg.prompt_tokens} tokens" if cfg.prompt_tokens else f"{cfg.dataset}'s lengths"
        title += f" with random weights ({len(prompts)} random prompts of {lengths})"
    else:
        title += f" on {cfg.dataset} ({len(prompts)} prompts)"
    notes = suggestions(summary, costs, cfg.ks) + noisy_costs(costs)
    yield Results(out, title, summary, picks, notes, plots, cfg.sampling.greedy, predicted)
