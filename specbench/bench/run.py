"""The benchmark: prompts x methods x K, timed, read top to bottom in ``benchmark``.

It is the one module that reads the run's configuration (config.BenchConfig) and the one that
writes the run directory (rundir.RunWriter): each stage below it is handed only what it needs
(results.RunColumns, serve.ServingRun, decoding.sampling.Sampling, the prompts). It loads the pair and the
prompts, measures the copy bandwidth and the forward costs, warms up, decodes every prompt with the baseline and each
method in specbench's loop (decode_all) and, untimed, labels each greedy output that parted from the
baseline's (label_divergences), then sends every turn to the serving engines (bench/serve.py, whose
answers serve_rows turns into rows), writing each row as it completes. It yields what it is doing,
then its Results; it never prints.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from specbench.bench.config import OPTIONS, BenchConfig
from specbench.bench.serve import Answer, Counters, Progress, ServingRun, draft_alone, margins, serve_all
from specbench.core.environment import cache_dir
from specbench.core.errors import SpecbenchError
from specbench.core.machine import environment
from specbench.core.options import FIXED
from specbench.core.thinking import Markers
from specbench.decoding.sampling import Sampling, synthetic_rates
from specbench.decoding.timing import MEMORY_SOURCES, PeakMemory
from specbench.engines import llamacpp
from specbench.engines.loop import Loop
from specbench.engines.server import unreachable
from specbench.engines.vllm import EngineSpec, vllm_version
from specbench.methods.base import Decoder
from specbench.methods.registry import BASELINE, check_vocabularies
from specbench.methods.served import HTTP_ENGINES
from specbench.models.costs import ForwardCosts, Roofline, measure_costs, noisy_costs, roofline
from specbench.models.load import model_dir, placement
from specbench.models.names import resolve, speculator_dir
from specbench.models.pair import Conversations, Pair, encode_prompts, load_pair
from specbench.models.vocab import check_share
from specbench.results import schema, serving
from specbench.results.plot import plot_categories, plot_concurrency, plot_online, plot_pareto, plot_phases, plot_run
from specbench.results.rundir import RunWriter, refuse_to_replace
from specbench.results.schema import OWN_ENGINES
from specbench.results.summary import (
    WEIGHT_DEPENDENT,
    RunColumns,
    acceptance_rows,
    bandwidth_notes,
    best_ks,
    by_group,
    draft_length_rows,
    drift_notes,
    online_row,
    predicted_rows,
    record,
    results_document,
    suggestions,
    summarize,
)
from specbench.workloads.prompts import load_prompts

log = logging.getLogger("specbench")
SUMMARY_EVERY_S = 10.0  # summary.csv is rewritten at most this often while decoding, and at the end


def prepare(cfg: BenchConfig) -> tuple[Pair, Conversations]:
    """Validate, load the pair and the prompts; every input error surfaces here, before timing."""
    pair, prompts = load_inputs(cfg)
    conversations = encode_prompts(pair, prompts, cfg.rendering)
    if pair.bridge is not None:
        share = check_share(pair.bridge, conversations.user_ids(), pair.target.name, pair.draft.name)
        log.info("%s holds %.1f%% of the prompts' tokens of %s", pair.draft.name, 100 * share, pair.target.name)
    return pair, conversations


def load_inputs(cfg: BenchConfig) -> tuple[Pair, list]:
    """Validate, load the prompts and the pair, and check each method against it; the prompts are
    not yet encoded (the audit fits its answers' length to the pair's context window first)."""
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
    pair = load_pair(cfg.wanted, cfg.compile, cfg.threads, cfg.graphs)
    for decoder in cfg.plan:
        check_vocabularies(decoder.method, pair)
        decoder.method.check(pair)
    return pair, prompts


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

    @classmethod
    def read(cls, out: Path) -> Results:
        """A finished run's Results read back from its directory, for `specbench show`: results.json's
        rows (each speedup with its interval), best_k.json, predicted.csv and the figures."""
        try:
            document = json.loads((out / "results.json").read_text())
            rows = [_typed(row) for row in document["summary"]]
            first = rows[0]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            raise SpecbenchError(
                f"{out} holds no results.json with summary rows: give the directory of a finished `specbench run`"
            ) from None
        title = document.get("resolved", {}).get("title")  # the run's own caption; a run before it had none
        if title is None:
            title = f"{first['target']} <- {first['draft']}" if first.get("draft") else first["target"]
            title += f" on {first['dataset']} ({first['num_prompts']} prompts)"
        picks = json.loads((out / "best_k.json").read_text()) if (out / "best_k.json").is_file() else {}
        predicted = []
        if (out / "predicted.csv").is_file():
            with open(out / "predicted.csv", newline="") as f:
                predicted = [
                    {name: int(v) if name == "k" else float(v) for name, v in r.items()} for r in csv.DictReader(f)
                ]
        categories = [_typed(row) for row in document.get("categories", [])]
        greedy = document["config"].get("temperature", 0) == 0
        notes = bandwidth_notes(rows, GRAPHS)  # the run's other notes need its forward costs
        # A row is written as each prompt ends, so show says when the run stopped. A served row counts
        # only the requests that did not fail.
        resolved = document.get("resolved", {})
        asked = resolved.get("turns")

        def given(row: dict) -> float:  # the prompts a row's decoder was given, failed requests too
            failed = row.get("failed")
            return row["num_prompts"] + (0 if failed is None or math.isnan(failed) else failed)

        decoded = max(map(given, rows))
        if asked and decoded < asked:
            unit = "turns" if asked > resolved.get("prompts", asked) else "prompts"
            notes.insert(
                0,
                f"this run stopped after {decoded:g} of its {asked} {unit}: `specbench run` with its options "
                f"and --resume --out {out} finishes it",
            )
        return cls(out, title, rows, picks, notes, sorted(out.glob("*.png")), greedy, predicted, "", categories)


NUMBERS = {name for name, column in schema.BY_NAME.items() if column.fmt and name != "k"}  # K: None, not NaN
GRAPHS = "graphs" in OPTIONS  # whether a note may point at --graphs


def _typed(row: dict) -> dict:
    """A results.json row as the run held it: null back to NaN where the column is a number."""
    return {name: math.nan if value is None and name in NUMBERS else value for name, value in row.items()}


def benchmark(
    cfg: BenchConfig,
    out: Path,
    resume: bool = False,
    prefill_progress: Callable[[int, int], None] | None = None,
) -> Iterator[Progress | Results]:
    """Run ``cfg`` into the run directory ``out``, yielding Steps as it goes and Results at the end.

    With ``resume``, a run interrupted in ``out`` with the same configuration continues: prompts
    complete in records.csv keep their rows and outputs; the others are decoded now.
    ``prefill_progress`` is told (tokens done, tokens) as a prompt longer than --prefill-chunk is read.
    """
    cfg.validate()
    for line in [*cfg.policy_notes, *cfg.budget_notes]:
        log.info(line)
    if resume and cfg.learns:
        raise SpecbenchError(
            "--resume cannot restore what --method online learned before the interruption: run it again without --resume"
        )
    # A baseline server that does not answer ends the run: found before any model is converted or loaded.
    if cfg.baseline_url is not None and (why := unreachable(cfg.baseline_url)) is not None:
        raise SpecbenchError(
            f"--baseline-url {cfg.baseline_url}: the baseline server is not reachable ({why}): start it, or check the URL"
        )
    if not resume:
        refuse_to_replace(out, resumable=not cfg.learns)
    writer = RunWriter(out)  # fails on an unusable directory before anything is loaded
    try:
        yield from _benchmark(cfg, writer, resume, prefill_progress)
    except BaseException as e:
        if not writer.discard_if_empty() and writer.created and isinstance(e, SpecbenchError):
            raise SpecbenchError(f"{e} (what this run measured is in {out})") from None
        raise


def _benchmark(
    cfg: BenchConfig, writer: RunWriter, resume: bool, prefill_progress: Callable[[int, int], None] | None
) -> Iterator[Progress | Results]:
    out = writer.out
    previous = writer.previous_run(cfg.as_dict()) if resume else None
    yield Progress("loading models and prompts")
    pair, conversations = prepare(cfg)
    building = pair.builds_at_reserve()
    if building:  # compiling a 7B model's forwards takes long enough to need a line of its own
        yield Progress(building)
    widest = cfg.rendering.widest
    pair.reserve(conversations.longest + cfg.rendering.max_new_tokens + widest, widest, cfg.sampling)
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
        "title": run_title(cfg, pair, conversations),  # the tables' caption, which show prints again
        "turns": len(conversations.turns),  # what show reads to say a run stopped before its end
        "prompts": len(conversations.first),
        # Where accelerate put each module of the target (None: all on the device above).
        "device_map": placement(pair.target.model) if cfg.device_map else None,
        "peak_memory": MEMORY_SOURCES.get(PeakMemory(pair.device).source),  # how peak_memory_mb was read
        # What runs each model's forward in specbench's loop, and what building it took (packing, padding choice).
        # meta.json is written again at the end, when the static path's graphs have all been captured.
        "forward": forward_facts(pair),
    }
    if "vllm" in cfg.engines and cfg.synthetic_acceptance is not None and pair.device.type != "cuda":
        raise SpecbenchError(
            "--synthetic-acceptance with --engine vllm needs a GPU: vLLM's CPU sampler refuses its synthetic "
            "rejection sampler; measure it on a GPU, or here with --engine torch or llama-cpp"
        )
    markers = thinking_markers(cfg.thinking_markers, pair.target.tokenizer)
    resolved["thinking_markers"] = [markers.open, markers.close] if markers else None
    if "vllm" in cfg.engines:
        resolved["vllm"] = vllm_version()
    if "llama-cpp" in cfg.engines:
        resolved["llama_cpp"] = llamacpp.version(llamacpp.find_server(cfg.llama_server))
    meta = {**environment(pair.device), "config": cfg.as_dict(), "resolved": resolved}
    writer.write_json("meta.json", meta)

    plan = cfg.plan  # one plan for the run: a method that learns keeps its state in its decoder
    own = "torch" in cfg.engines
    run = serving_run(cfg, pair, conversations, out) if cfg.served_baseline is not None else None
    served = [run.baseline, *run.plan] if run is not None else []
    bound = None  # what bounds the target's step (baseline_mbu): specbench's loop's only
    if own:
        measured = previous.copy_bandwidth if previous is not None else None
        if measured is None:
            yield Progress("measuring copy bandwidth (baseline_mbu)")
        bound = roofline(pair, measured)  # one bandwidth for a run and its resumptions, as its forward costs
        resolved["copy_bandwidth"] = bound.bandwidth
        writer.write_json("meta.json", meta)
    columns = run_columns(cfg, run_info, bound)
    for decoder in plan:
        decoder.method.begin_run(pair, cfg.settings_of(decoder.method), decoder)
    costs = None  # specbench's loop's forward costs; vLLM's are in engine_costs
    loop_forward = {}  # forward_facts of the loop's models, kept when they are let go for vLLM
    if own and previous is not None and previous.costs:
        costs = ForwardCosts.from_rows(previous.costs)
    elif own:
        yield Progress("measuring forward costs (c, verify_ratio)")
        levels = {
            level.name: level.build(pair, cfg.settings_of(decoder.method))
            for decoder in plan
            for level in decoder.method.levels
        }
        costs = measure_costs(pair, prompt_ids, levels, cfg.widest, cfg.max_new_tokens, cfg.cost_repeats)
        levels = {}  # views that only the costs read: their caches would count in every decode's peak memory
        writer.write_csv("verify_cost.csv", costs.rows())
    done = previous.complete_prompts(1 + len(plan)) if previous is not None else set()
    # A conversation is decoded again whole unless every turn of it is done: a later turn needs the answers before it.
    done = {i for i in done if all(j in done for j, t in enumerate(turns) if t.conversation == turns[i].conversation)}
    blocks = previous.complete_blocks(len(turns)) if previous is not None else set()
    records = writer.start_records(previous, done, blocks)
    engine_costs = list(previous.engine_costs) if previous is not None else []
    counters = list(previous.counters) if previous is not None else []
    learning: list[dict] = []  # online.csv

    def over(rows: list[dict]) -> list[dict]:
        """The summary rows of ``rows``: specbench's loop's, then the serving engines'."""
        mine = summarize(rows, costs, plan, columns) if own else []
        return mine + serving.summarize(rows, engine_costs, counters, served, cfg.loads, columns)

    try:
        if own:
            loops = [
                Loop(pair, decoder, cfg.options_of(decoder.method), cfg.repeats)
                for decoder in [Decoder(BASELINE), *plan]
            ]
            sampling = cfg.requests(pair.stop_ids)
            yield from decode_all(
                loops, sampling, cfg.warmup, cfg.random_weights, conversations, writer, records, learning, done,
                lambda: write_summaries(writer, records, over, cfg.group_by), markers,
            )  # fmt: skip
            # A margin of the plain logits says nothing of a penalised or biased argmax: those stay unlabelled.
            # Synthetic acceptance keeps drafts unverified: its outputs part from the baseline's by design.
            exact = sampling.synthetic_acceptance is None
            if exact and sampling.greedy and sampling.repetition_penalty == 1.0 and not sampling.logit_bias:
                yield from label_divergences(loops, conversations, records, writer)
        if run is not None:
            text_of = decoded_text(pair)
            if pair.target_lm is not None:  # vLLM loads the models again: free this process's copy first
                loop_forward = forward_facts(pair)  # what ran the loop's forwards, before they are let go
                # On a GPU vLLM starts only where most of the memory is free: nothing of the loop's may stay.
                loops = []  # they, and the methods' states, hold the loop's models
                for decoder in plan:
                    if not decoder.method.learns:  # a learner's draft is saved at the end (--save-draft)
                        decoder.state = None
                pair = pair.without_weights()
                pair.return_cached_memory()
            yield from serve_rows(run, conversations, writer, records, blocks, engine_costs, counters, text_of, markers)
    finally:
        summary, categories = write_summaries(writer, records, over, cfg.group_by)
        writer.write_csv("acceptance.csv", acceptance_rows(records))
        writer.write_csv("draft_lengths.csv", draft_length_rows(records))
        writer.write_csv("engine_costs.csv", engine_costs)
        writer.write_csv("counters.csv", counters)
        document = results_document(meta, summary, records, categories, cfg.group_by)
        writer.write_json("results.json", document)
        writer.close()
        if cfg.save_draft:  # what was learned is kept, also when the run was interrupted
            learners = [decoder for decoder in plan if decoder.method.learns]
            for decoder in learners:
                row = f"k{decoder.k}" if decoder.k_policy == FIXED else f"k{decoder.k}-{decoder.k_policy}"
                decoder.method.save(decoder, Path(cfg.save_draft) / (row if len(learners) > 1 else ""))
    if found := serving.load_crossovers(document["summary"]):
        writer.write_json("crossover.json", found)
    picks = {} if cfg.random_weights else best_ks(summary)
    if picks:
        writer.write_json("best_k.json", picks)
    predicted = predicted_rows(cfg.assume_alpha, costs) if own and costs.draft_single is not None else []
    if predicted:
        writer.write_csv("predicted.csv", predicted)
    plots = (
        [
            path
            for path in (
                plot_phases(out),
                plot_run(out),
                plot_online(out),
                plot_concurrency(out),
                plot_pareto(out),
                plot_categories(out),
            )  # fmt: skip
            if path is not None
        ]
        if summary
        else []
    )
    title = resolved["title"]
    notes = (
        suggestions(summary, costs, cfg.ks)
        + noisy_costs(costs)
        + drift_notes(summary, costs)
        + bandwidth_notes(summary, GRAPHS)
        if own
        else []
    )
    facts = forward_facts(pair) or loop_forward
    if facts:
        meta["resolved"]["forward"] = facts
        writer.write_json("meta.json", meta)
    forward = ", ".join(describe_forward(role, fact) for role, fact in facts.items())
    # The tables show each speedup with its interval over the prompts (results.json's; not a summary.csv column).
    shown = [
        {**row, "speedup_ci": line.get("speedup_ci")} for row, line in zip(summary, document["summary"], strict=True)
    ]
    yield Results(out, title, shown, picks, notes, plots, cfg.sampling.greedy, predicted, forward, categories)


def write_summaries(
    writer: RunWriter, records: list[dict], over: Callable[[list[dict]], list[dict]], group_by: str
) -> tuple[list[dict], list[dict]]:
    """summary.csv (``over`` every record) and categories.csv (``over`` each category's records, or
    sub-category's, or input length's: --group-by). Returns both."""
    summary, categories = over(records), by_group(records, group_by, over)
    writer.write_csv("summary.csv", summary)
    writer.write_csv("categories.csv", categories)
    return summary, categories


def run_columns(cfg: BenchConfig, run_info: dict, bound: Roofline | None = None) -> RunColumns:
    """What every summary row of ``cfg``'s run repeats (results.RunColumns), with the target's
    Roofline where it was measured."""
    parallel = f"tp={cfg.tensor_parallel_size},pp={cfg.pipeline_parallel_size}"
    extra = ",".join(f"{key}={value}" for key, value in sorted(cfg.engine_args.items()))

    def options(decoder: Decoder) -> str:
        """The options column: the settings a row depends on beyond its method, K and sampling."""
        if decoder.method.engine == "server":
            return f"url={decoder.method.url},api={cfg.api}"
        if decoder.method.engine == "llama-cpp":
            sampling = f",draft_sampling={decoder.method.draft_sampling}" if decoder.method.draft_sampling else ""
            return f"spec_type={decoder.method.spec_type or 'none'}{sampling},gguf={cfg.gguf_type},api={cfg.api}"
        if decoder.method.engine == "vllm":
            return ",".join(part for part in (parallel, extra) if part)
        return decoder.options_column(cfg)

    names = ("temperature", "top_k", "top_p", "eta", "seed", "max_new_tokens", "synthetic_acceptance")
    sampling = {name: getattr(cfg, name) for name in names}
    return RunColumns(run_info, sampling, options, cfg.random_weights, bound)


def launch_llama_cpp(
    cfg: BenchConfig, pair: Pair, conversations: Conversations, decoders: list[Decoder], draft_server
) -> None:
    """Give each llama.cpp server of the run (``decoders``' and the draft alone's) its command line:
    the GGUF files made once from the run's models, a slot per request in flight, each with the
    context the longest prompt, its new tokens and a round's drafts need."""
    server = llamacpp.find_server(cfg.llama_server)
    source = resolve(cfg.target)
    heads = any(d.method.needs_speculator for d in decoders)
    target, draft, head = llamacpp.ggufs(
        server,
        cfg.gguf_type,
        cache_dir() / "gguf",
        Path(model_dir(pair.target)),
        Path(source.location) if source.kind == "gguf" else None,
        Path(model_dir(pair.draft)) if pair.draft is not None else None,
        speculator_dir(cfg.speculator) if heads else None,
    )
    context = conversations.longest + cfg.max_new_tokens + cfg.widest + llamacpp.SLACK
    slots = max(cfg.concurrency)
    for decoder in decoders:
        speculation = decoder.method.speculation(decoder.k, draft, head)
        if speculation is not None and cfg.synthetic_acceptance is not None:
            speculation = replace(speculation, synthetic=tuple(synthetic_rates(cfg.synthetic_acceptance, decoder.k)))
        decoder.method.command = llamacpp.command(server, target, slots, context, speculation, cfg.llama_threads)
    if draft_server is not None:
        draft_server.command = llamacpp.command(server, draft, 1, context, threads=cfg.llama_threads)


def serving_run(cfg: BenchConfig, pair: Pair, conversations: Conversations, out: Path) -> ServingRun:
    """What the serving engines of ``cfg``'s run are opened and driven with (serve.ServingRun)."""
    baseline, plan = cfg.served_baseline, cfg.served_plan
    common = {
        "engine": baseline.method.engine,
        "baseline": baseline,
        "plan": plan,
        "loads": cfg.loads,
        "sampling": cfg.requests(pair.stop_ids),
        "warmup": cfg.warmup,
        "out": out,
    }
    if baseline.method.engine in HTTP_ENGINES:
        draft_server = cfg.draft_server
        if baseline.method.engine == "llama-cpp":
            launch_llama_cpp(cfg, pair, conversations, [baseline, *plan], draft_server)
        tokenizer = pair.target.tokenizer
        return ServingRun(
            **common,
            draft_server=draft_server,
            api=cfg.api,
            api_key=os.environ.get(cfg.api_key_env),
            timeout_s=cfg.request_timeout,
            encode=(lambda text: tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else None,
        )
    own_vocabulary = pair.bridge is not None
    # vLLM's draft model of the target's tokenizer: timed alone too (one of its own would be sent the
    # target's ids, so c is left empty), and of the target's vocabulary size.
    drafts_in_vllm = pair.draft is not None and not own_vocabulary and any(d.method.needs_draft for d in plan)
    if drafts_in_vllm:
        sizes = pair.target.model.config.vocab_size, pair.draft.model.config.vocab_size
        if sizes[0] != sizes[1]:  # vLLM's SpeculativeConfig refuses them, after the baseline's engine has run
            raise SpecbenchError(
                f"vLLM's draft-model speculation needs the draft's vocabulary size to be the target's, and "
                f"{pair.target.name} has {sizes[0]} rows where {pair.draft.name} has {sizes[1]}: run the pair "
                "in specbench's loop (--engine torch), or give vLLM a draft of the target's size"
            )
    windows = [m.context_window for m in (pair.target, pair.draft) if m is not None and m.context_window]
    needed = conversations.longest + cfg.max_new_tokens + cfg.widest
    backend = (
        {"distributed_executor_backend": cfg.distributed_executor_backend} if cfg.distributed_executor_backend else {}
    )
    target = EngineSpec(
        model=model_dir(pair.target),
        dtype=str(pair.dtype).removeprefix("torch."),
        seed=cfg.seed,
        max_model_len=min([needed, *windows]),
        max_num_seqs=max(cfg.concurrency),
        dummy=cfg.random_weights,
        parallel={
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "pipeline_parallel_size": cfg.pipeline_parallel_size,
            **backend,
        },
        extra=cfg.engine_args,
    )
    draft = model_dir(pair.draft) if pair.draft is not None else None
    alone = replace(target, model=draft) if drafts_in_vllm else None
    return ServingRun(
        **common,
        target=target,
        draft_alone=alone,
        draft=draft,
        speculator=cfg.speculator,
        own_vocabulary=own_vocabulary,
    )


def thinking_markers(option: str, tokenizer) -> Markers | None:
    """The token ids of --thinking-markers in the target's vocabulary: None for '' or where the default's
    are not single tokens there (a model that does not think). Markers the user gave that are not one
    token each are refused in one line."""
    if not option:
        return None
    given = option != OPTIONS["thinking_markers"].default
    ids = []
    for text in (part.strip() for part in option.split(",")):
        found = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
        if len(found) != 1:
            if not given:
                return None
            where = f"{len(found)} tokens" if tokenizer is not None else "not readable without the target's tokenizer"
            raise SpecbenchError(
                f"--thinking-markers: {text!r} is {where} for the target; give the tokens its chat template "
                "writes around thinking, one token each, or '' for no split"
            )
        ids += found
    return Markers(*ids)


def decoded_text(pair: Pair) -> Callable[[list[int]], str]:
    """An answer's text from its ids, by the target's tokenizer ("" without one)."""
    tokenizer = pair.target.tokenizer
    return tokenizer.decode if tokenizer is not None else (lambda ids: "")


def run_title(cfg: BenchConfig, pair: Pair, conversations: Conversations) -> str:
    """The caption of a run's tables: the pair, the prompts (random ones with random weights), and
    drafts kept at a --synthetic-acceptance rate, whose outputs are not the target's."""
    title = f"{cfg.target} <- {cfg.draft}" if pair.draft else cfg.target
    count, turns = len(conversations.first), len(conversations.turns)
    if cfg.random_weights:
        lengths = f"{cfg.prompt_tokens} tokens" if cfg.prompt_tokens else f"{cfg.dataset}'s lengths"
        title += f" with random weights ({count} random prompts of {lengths})"
    else:
        title += f" on {cfg.dataset} ({count} prompts" + (f", {turns} turns)" if turns > count else ")")
    if (rate := cfg.synthetic_acceptance) is not None:  # from 1 up a mean length, which 1 puts at a rate of 0
        shown = f"{rate:g}" if rate < 1 else f"{rate:g} token{'s' if rate != 1 else ''} a round"
        title += f", drafts kept unverified at synthetic acceptance {shown}"
    return title


def forward_facts(pair: Pair) -> dict[str, dict]:
    """What runs each model's forward in specbench's loop and what building it took (lm.forward_facts), by role."""
    models = (("target", pair.target_lm), ("draft", pair.draft_lm), ("head", pair.head))
    return {role: lm.forward_facts() for role, lm in models if lm is not None and hasattr(lm, "forward_facts")}


def describe_forward(role: str, facts: dict) -> str:
    """One model's forward in the run's last line: "target graphs (built in 41.0 s; 16 CUDA graphs captured in 0.9 s,
    outputs 9 MB; cache 512 MB for 2048 positions)", or "draft eager (transformers' forward)"."""
    if facts["route"] == "eager":  # a fallback (its reason logged at load) is named at the end too
        return f"{role} eager (transformers' forward)"
    parts = [f"built in {facts['build_s']:.1f} s"]
    if facts.get("graphs"):
        parts.append(
            f"{facts['captured']} CUDA graphs captured in {facts['capture_s']:.1f} s, outputs {facts['graphs_mb']:.0f} MB"
        )
    if "cache_mb" in facts:
        size = f"{facts['cache_mb']:.0f} MB" if facts["cache_mb"] >= 1 else f"{facts['cache_mb'] * 1024:.0f} kB"
        parts.append(f"cache {size} for {facts['cache_positions']} positions")
    plan = {int(n): how.split() for n, how in facts.get("row_plan", {}).items()}
    if facts["route"] == "packed" and (own := [str(n) for n, (_, way) in plan.items() if way == "own"]):
        parts.append(f"row{'s' if len(own) > 1 else ''} {', '.join(own)} on its own weights")
    if padded := [f"{n} to {count}" for n, (count, _) in plan.items() if int(count) > n]:
        parts.append(f"rows padded {', '.join(padded)}")
    return f"{role} {facts['route']} ({'; '.join(parts)})"


def forward_route(lm) -> str:
    """The compile column: what runs ``lm``'s forward in specbench's loop."""
    return "eager" if lm is None else lm.route


def decode_all(
    loops: list[Loop],
    sampling: Sampling,
    warmup: int,
    random_weights: bool,
    conversations: Conversations,
    writer: RunWriter,
    records: list[dict],
    learning: list[dict],
    done: set[int],
    summaries: Callable[[], object],
    markers: Markers | None = None,
) -> Iterator[Progress]:
    """specbench's loop: every turn not in ``done``, by the baseline (``loops[0]``) and each decoder of
    the plan, each a Loop engine of its own, after ``warmup`` untimed decodes of the first prompt.
    A later turn of a conversation is rendered after the decoder's own answers to the turns before it
    (under greedy, the baseline's: the exact methods give the same). Each row is written as it
    completes, and ``summaries()`` rewrites the summary files every SUMMARY_EVERY_S; ``markers`` split
    each answer's thinking from the rest (None: not split)."""
    turns, text_of = conversations.turns, decoded_text(loops[0].pair)
    todo = [i for i in range(len(turns)) if i not in done]
    if todo:  # a resumed run with nothing left to decode only writes its summary again
        yield Progress("warming up")
        for _ in range(warmup):  # untimed, so allocation, kernel choice and caches settle first
            for loop in loops:  # a method that learns learns nothing here: it learns in after_prompt
                list(loop.run(conversations.first[:1], 1, sampling, indices=[0]))
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
            if turn.turn < len(turn.prompt.turns):
                before.append(conversations.answer(tokens))
            writer.output(
                turn, index, decoder.k, decoder.method.name, tokens, text_of(tokens), decoder.shape,
                decoder.method.engine, k_policy=decoder.policy,
            )  # fmt: skip
            records.append(record(turn, index, ids, reference, decoder, measured, learned, markers))
            if random_weights and sampling.synthetic_acceptance is None:  # a synthetic rate decides them
                records[-1].update((name, math.nan) for name in WEIGHT_DEPENDENT if name in records[-1])
            writer.append_record(records[-1])
            writer.write_csv("draft_lengths.csv", draft_length_rows(records))
            if learned is not None:
                learning.append(online_row(records[-1], learned))
                writer.write_csv("online.csv", learning)
            finished += 1
            yield Progress("decoding", finished, total, decoder.label)
            if time.monotonic() - written > SUMMARY_EVERY_S:
                summaries()
                written = time.monotonic()


def label_divergences(
    loops: list[Loop], conversations: Conversations, records: list[dict], writer: RunWriter
) -> Iterator[Progress]:
    """specbench's loop under plain greedy, after every timed decode: each output that parted from its
    reference's (the baseline's, or its engine's own: method.reference) is labelled near-tie or
    structural by the target's two likeliest tokens where they part, read along the reference's
    answer to the same turn (serving.near_tie_bound), and records.csv is written again. Outputs
    that agree token for token but not in length are structural: one went on past a stop. A row a
    resumed run kept with its label keeps it."""
    todo = [r for r in records if r["engine"] in OWN_ENGINES and r["first_divergence"] >= 0 and not r["divergence"]]
    if not todo:
        return
    yield Progress(f"labelling {len(todo)} greedy divergences by the target's margins")
    methods = {loop.decoder.method.name: loop.decoder.method for loop in loops}
    answers = {
        (o["prompt_index"], o["method"]): o["token_ids"]
        for o in writer.outputs()
        if o.get("engine", "torch") in OWN_ENGINES
    }
    turns, labels = conversations.turns, []
    for r in todo:  # labelled all at once below, so that an interruption leaves no row half done
        reference, index, at = methods[r["method"]].reference or BASELINE.name, r["prompt_index"], r["first_divergence"]
        if at >= min(r["new_tokens"], r["baseline_tokens"]):
            labels.append("structural")
            continue
        turn = turns[index]
        before = [
            conversations.answer(answers[(j, reference)])
            for j, earlier in enumerate(turns)
            if earlier.conversation == turn.conversation and earlier.turn < turn.turn
        ]
        first, second, spacing = loops[0].top_two(conversations.ids(turn, before), at, answers[(index, reference)])
        labels.append(serving.divergence_kind(first - second, serving.near_tie_bound(spacing)))
    for r, label in zip(todo, labels, strict=True):
        r["divergence"] = label
    writer.rewrite_records(records)


def serve_rows(
    run: ServingRun,
    conversations: Conversations,
    writer: RunWriter,
    records: list[dict],
    blocks: set[tuple],
    engine_costs: list[dict],
    counters: list[dict],
    text_of: Callable[[list[int]], str],
    markers: Markers | None = None,
) -> Iterator[Progress]:
    """The serving engines' part (serve.serve_all): each answer becomes a records.csv row and an
    outputs.jsonl line as it comes, each block's counters a counters.csv row; a resumed run skips
    the finished ``blocks``. Then, for servers under greedy, each divergent output is labelled
    near-tie or structural by the baseline's own margin there; and c: the target's and the draft's
    time per output token alone, at one request in flight."""
    name = run.baseline.method.name
    kept_rows = any(r["engine"] == run.engine and r["method"] == name for r in records)
    outputs = writer.outputs() if kept_rows else []
    kept = {load: serving.kept_baseline(records, outputs, run.baseline, load) for load in run.loads}
    sent: dict[tuple, list[int]] = {}  # (concurrency, rate, prompt_index) -> the baseline's prompt ids
    for event in serve_all(run, conversations, blocks, kept):
        if isinstance(event, Answer):
            decoder, load, served = event.decoder, event.load, event.served
            row = serving.record(
                event.turn, event.index, event.ids, decoder, load, served, event.base, run.encode, markers
            )
            if decoder is run.baseline:
                sent[(load[0], load[1], event.index)] = event.ids
            if not served.error:
                writer.output(
                    event.turn, event.index, decoder.k, decoder.method.name, served.tokens,
                    served.text or text_of(served.tokens), "", run.engine, load[0], decoder.policy, load[1],
                )  # fmt: skip
            records.append(row)
            writer.append_record(row)
        elif isinstance(event, Counters):
            grew = serving.counter_row(
                run.engine, event.decoder.method.name, event.decoder.k, event.load, event.before, event.after
            )
            if grew is not None:
                counters.append(grew)
                writer.write_csv("counters.csv", counters)
        else:
            yield event
    exact = run.sampling.synthetic_acceptance is None  # synthetic acceptance parts from the baseline by design
    if exact and run.engine in HTTP_ENGINES and run.sampling.greedy and run.api == "completions":
        # Rows whose baseline prompt this run did not send (kept by --resume) stay unlabelled.
        todo = [
            r for r in records
            if r["engine"] == run.engine and not r["error"] and r["first_divergence"] >= 0 and not r["divergence"]
            and (r["concurrency"], r["request_rate"], r["prompt_index"]) in sent
        ]  # fmt: skip
        if todo:
            asked = [
                (sent[(r["concurrency"], r["request_rate"], r["prompt_index"])], int(r["first_divergence"]))
                for r in todo
            ]
            found = []
            for event in margins(run, conversations, asked):
                if isinstance(event, Progress):
                    yield event
                else:
                    found.append(event)
            for r, margin in zip(todo, found, strict=True):
                r["divergence"] = serving.divergence_kind(margin)
            writer.rewrite_records(records)
    single = [load for load in run.loads if load[0] == 1 and math.isinf(load[1])]
    timed = {row["model"] for row in engine_costs if row["engine"] == run.engine}
    if not single:
        return
    if "target" not in timed:
        rows = serving.block(records, run.engine, name, single[0])
        engine_costs.append(serving.decode_cost([r["tpot_ms"] for r in rows], run.engine, "target"))
        writer.write_csv("engine_costs.csv", engine_costs)
    wanted = run.draft_server is not None if run.engine in HTTP_ENGINES else run.draft_alone is not None
    if wanted and "draft" not in timed:
        alone = []
        for event in draft_alone(run, conversations):
            if isinstance(event, Progress):
                yield event
            elif not event.error:
                alone.append(event.tpot_ms)
        engine_costs.append(serving.decode_cost(alone, run.engine, "draft"))
        writer.write_csv("engine_costs.csv", engine_costs)
