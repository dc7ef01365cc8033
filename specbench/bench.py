"""The benchmark: prompts x methods x K, timed, read top to bottom in ``benchmark``.

It loads the pair and the prompts, measures the forward costs, warms up, then decodes every
prompt with the baseline and each method, writing each row as it completes (rundir.RunWriter).
It yields what it is doing, then its Results; it never prints.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import serving
from .config import BenchConfig
from .costs import ForwardCosts, measure_costs, noisy_costs
from .engines import Sampling
from .engines.loop import Loop
from .engines.vllm import vllm_version
from .errors import SpecbenchError
from .machine import environment
from .method import Decoder
from .methods import BASELINE
from .models import placement
from .options import FIXED
from .pair import Conversations, Pair, encode_prompts, load_pair
from .plot import plot_categories, plot_concurrency, plot_online, plot_phases, plot_run
from .prompts import load_prompts
from .results import (
    WEIGHT_DEPENDENT,
    acceptance_rows,
    best_ks,
    by_group,
    draft_length_rows,
    online_row,
    predicted_rows,
    record,
    results_document,
    suggestions,
    summarize,
)
from .rundir import RunWriter
from .serve import Step, serve_all

log = logging.getLogger("specbench")
SUMMARY_EVERY_S = 10.0  # summary.csv is rewritten at most this often while decoding, and at the end


def prepare(cfg: BenchConfig) -> tuple[Pair, Conversations]:
    """Validate, load the pair and the prompts; every input error surfaces here, before timing."""
    cfg.validate()
    prompts = load_prompts(
        cfg.dataset,
        cfg.num_prompts,
        cfg.prompt_field,
        cfg.context_tokens,
        cfg.seed,
        path=cfg.dataset_path,
        categories=cfg.categories,
        per_category=cfg.per_category,
        max_turns=cfg.max_turns,
    )
    pair = load_pair(cfg.wanted, cfg.speculator if cfg.needs_speculator else None, cfg.compile, cfg.threads)
    for step in cfg.plan:
        step.method.check(pair)
    return pair, encode_prompts(pair, prompts, cfg.rendering)


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
    forward: str = ""  # what ran specbench's forwards, and what building them took
    categories: list[dict] = field(default_factory=list)  # categories.csv


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
    for line in cfg.policy_notes:
        log.info(line)
    if resume and cfg.learns:
        raise SpecbenchError(
            "--resume cannot restore what --method online learned before the interruption: run it again without --resume"
        )
    writer = RunWriter(out)  # fails on an unusable directory before anything is loaded
    previous = writer.previous_run(cfg.as_dict()) if resume else None
    yield Step("loading models and prompts")
    pair, conversations = prepare(cfg)
    turns, prompt_ids = conversations.turns, conversations.first
    for lm in (pair.target_lm, pair.draft_lm):
        if lm is not None:
            lm.prefill_chunk, lm.progress = cfg.prefill_chunk, prefill_progress
    run_hash = conversations.hash
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
        "compile": forward_route(pair.target_lm),
        "prompts_hash": run_hash,
    }
    resolved = {
        **run_info,
        "target_path": str(pair.target.path),
        "draft_path": str(pair.draft.path) if pair.draft else None,
        "weights": "random" if cfg.random_weights else "checkpoint",
        # Where accelerate put each module of the target (None: all on the device above).
        "device_map": placement(pair.target.model) if cfg.device_map else None,
        # What runs each model's forward in specbench's loop, and what building it took (packing, padding choice).
        "forward": {
            role: {"route": forward_route(lm), "build_s": lm.fast.build_seconds if lm.fast else 0.0}
            | ({"padded_rows": lm.fast.padding} if lm.fast and lm.fast.padding else {})
            for role, lm in (("target", pair.target_lm), ("draft", pair.draft_lm))
            if lm is not None
        },
    }
    if "vllm" in cfg.engines:
        resolved["vllm"] = vllm_version()
    meta = {**environment(pair.device), "config": cfg.as_dict(), "resolved": resolved}
    writer.write_json("meta.json", meta)

    plan = cfg.plan  # one plan for the run: a method that learns keeps its state in its decoder
    own = "torch" in cfg.engines
    for step in plan:
        step.method.begin_run(pair, cfg.settings_of(step.method), step)
    costs = None  # specbench's loop's forward costs; vLLM's are in engine_costs
    if own and previous is not None and previous.costs:
        costs = ForwardCosts.from_rows(previous.costs)
    elif own:
        yield Step("measuring forward costs (c, verify_ratio)")
        levels = {
            level.name: level.build(pair, cfg.settings_of(step.method)) for step in plan for level in step.method.levels
        }
        costs = measure_costs(pair, prompt_ids, levels, cfg.widest, cfg.max_new_tokens, cfg.cost_repeats)
        writer.write_csv("verify_cost.csv", costs.rows())
    done = previous.complete_prompts(1 + len(plan)) if previous is not None else set()
    # A conversation is decoded again whole unless every turn of it is done: a later turn needs the answers before it.
    done = {i for i in done if all(j in done for j, t in enumerate(turns) if t.conversation == turns[i].conversation)}
    blocks = previous.complete_blocks(len(turns)) if previous is not None else set()
    records = writer.start_records(previous, done, blocks)
    engine_costs = list(previous.engine_costs) if previous is not None else []
    counters = list(previous.counters) if previous is not None else []
    learning: list[dict] = []  # online.csv
    try:
        if own:
            loops = [
                Loop(pair, decoder, cfg.options_of(decoder.method), cfg.repeats)
                for decoder in [Decoder(BASELINE), *plan]
            ]
            sampling = cfg.requests(pair.stop_ids)
            yield from decode_all(loops, sampling, cfg, conversations, writer, records, done, learning, costs, run_info)
        if cfg.served_baseline is not None:
            if pair.target_lm is not None:  # vLLM loads the models again: free this process's copy first
                pair = pair.without_weights()
                gc.collect()
            yield from serve_all(pair, cfg, conversations, writer, records, blocks, engine_costs, counters)
    finally:
        summary, categories = write_summaries(writer, records, costs, cfg, run_info, plan, engine_costs, counters)
        writer.write_csv("acceptance.csv", acceptance_rows(records))
        writer.write_csv("draft_lengths.csv", draft_length_rows(records))
        writer.write_csv("engine_costs.csv", engine_costs)
        writer.write_csv("counters.csv", counters)
        writer.write_json("results.json", results_document(meta, summary, records, categories, cfg.group_by))
        writer.close()
        if cfg.save_draft:  # what was learned is kept, also when the run was interrupted
            learners = [step for step in plan if step.method.learns]
            for step in learners:
                row = f"k{step.k}" if step.k_policy == FIXED else f"k{step.k}-{step.k_policy}"
                step.method.save(step, Path(cfg.save_draft) / (row if len(learners) > 1 else ""))
    picks = {} if cfg.random_weights else best_ks(summary)
    if picks:
        writer.write_json("best_k.json", picks)
    predicted = predicted_rows(cfg.assume_alpha, costs) if own and costs.draft_single is not None else []
    if predicted:
        writer.write_csv("predicted.csv", predicted)
    plots = (
        [
            path
            for path in (plot_phases(out), plot_run(out), plot_online(out), plot_concurrency(out), plot_categories(out))
            if path is not None
        ]
        if summary
        else []
    )
    title = f"{cfg.target} <- {cfg.draft}" if pair.draft else cfg.target
    count = len(conversations.first)
    if cfg.random_weights:
        lengths = f"{cfg.prompt_tokens} tokens" if cfg.prompt_tokens else f"{cfg.dataset}'s lengths"
        title += f" with random weights ({count} random prompts of {lengths})"
    else:
        title += f" on {cfg.dataset} ({count} prompts" + (f", {len(turns)} turns)" if len(turns) > count else ")")
    notes = suggestions(summary, costs, cfg.ks) + noisy_costs(costs) if own else []
    built = [(role, lm.fast) for role, lm in (("target", pair.target_lm), ("draft", pair.draft_lm)) if lm and lm.fast]
    forward = ", ".join(f"{role} {fast.route} (built in {fast.build_seconds:.1f} s)" for role, fast in built)
    yield Results(out, title, summary, picks, notes, plots, cfg.sampling.greedy, predicted, forward, categories)


def write_summaries(
    writer, records, costs, cfg, run_info, plan, engine_costs, counters
) -> tuple[list[dict], list[dict]]:
    """summary.csv over every prompt, and categories.csv: the same rows over each category's prompts
    (or sub-category's, or input length's: --group-by). Returns both."""

    def over(rows: list[dict]) -> list[dict]:
        own = summarize(rows, costs, cfg, run_info, plan) if "torch" in cfg.engines else []
        return own + serving.summarize(rows, engine_costs, counters, cfg, run_info)

    summary, categories = over(records), by_group(records, cfg.group_by, over)
    writer.write_csv("summary.csv", summary)
    writer.write_csv("categories.csv", categories)
    return summary, categories


def forward_route(lm) -> str:
    """The compile column: what runs ``lm``'s forward in specbench's loop."""
    return "eager" if lm is None or lm.fast is None else lm.fast.route


def decode_all(
    loops, sampling: Sampling, cfg, conversations, writer, records, done, learning, costs, run_info
) -> Iterator[Step]:
    """specbench's loop: every turn not yet done, by the baseline (``loops[0]``) and each decoder of
    the plan, each a Loop engine of its own. A later turn of a conversation is rendered after the
    decoder's own answers to the turns before it (under greedy, the baseline's: the exact methods
    give the same)."""
    turns, tokenizer = conversations.turns, loops[0].pair.target.tokenizer
    todo = [i for i in range(len(turns)) if i not in done]
    if todo:  # a resumed run with nothing left to decode only writes its summary again
        yield Step("warming up")
        for _ in range(cfg.warmup):  # untimed, so allocation, kernel choice and caches settle first
            for loop in loops:  # a method that learns learns nothing here: it learns in after_prompt
                list(loop.run(conversations.first[:1], 1, sampling, indices=[0]))
    plan = [loop.decoder for loop in loops[1:]]
    total, finished, written = len(todo) * len(loops), 0, time.monotonic()
    answers: dict[tuple[int, str], list[str]] = {}  # (conversation, decoder) -> its answers so far
    for index in todo:
        turn = turns[index]
        baseline = None
        references = {}  # an engine's own baseline (hf-generate), for the methods it is the reference of
        for loop in loops:
            decoder = loop.decoder
            before = answers.setdefault((turn.conversation, decoder.label), [])
            ids = conversations.ids(turn, before)
            measured = next(loop.run([ids], 1, sampling, indices=[index])).measured
            baseline = baseline or measured
            references[decoder.method.name] = measured
            reference = references.get(decoder.method.reference, baseline)
            learned = decoder.method.after_prompt(decoder, ids, measured.result)
            tokens = measured.result.tokens
            text = tokenizer.decode(tokens) if tokenizer else ""
            if turn.turn < len(turn.prompt.turns):
                before.append(conversations.answer(tokens))
            writer.output(
                turn, index, decoder.k, decoder.method.name, tokens, text, decoder.shape, decoder.method.engine,
                k_policy=decoder.policy,
            )  # fmt: skip
            records.append(record(turn, index, ids, reference, decoder, measured, learned))
            if cfg.random_weights:
                records[-1].update((name, math.nan) for name in WEIGHT_DEPENDENT if name in records[-1])
            writer.append_record(records[-1])
            writer.write_csv("draft_lengths.csv", draft_length_rows(records))
            if learned is not None:
                learning.append(online_row(records[-1], learned))
                writer.write_csv("online.csv", learning)
            finished += 1
            yield Step("decoding", finished, total, decoder.label)
            if time.monotonic() - written > SUMMARY_EVERY_S:
                write_summaries(writer, records, costs, cfg, run_info, plan, [], [])
                written = time.monotonic()
