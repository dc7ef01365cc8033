"""The command line: a thin layer that parses options, shows progress and hands off.

The options of `run` (and of sweep-k and sweep-context, the same command with other defaults) are
not written here: each comes from its declaration (options.RUN, or the method that owns it), read
through config.OPTIONS.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from specbench import __version__
from specbench.audit.broken import BROKEN
from specbench.bench.config import OPTIONS, BenchConfig
from specbench.cli import flags
from specbench.core.environment import read_config
from specbench.core.errors import SpecbenchError, out_of_memory
from specbench.core.options import AUDIT
from specbench.methods.registry import LONG_CONTEXT, METHODS
from specbench.methods.served import SERVED
from specbench.workloads.prompts import dataset_sources

# Only what parses and checks options is imported above: `specbench --help`, `list`, `theory` and every
# refusal of a bad option answer without torch, transformers or pandas (benchmarks/startup.py times
# them). A command imports what it measures with when it runs.


def _version(show: bool) -> None:
    if show:
        print(f"specbench {__version__}")
        raise typer.Exit()


app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=False,
    help="Run and benchmark speculative decoding: acceptance, cost ratio, measured and predicted speedup.",
)


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run and benchmark speculative decoding: acceptance, cost ratio, measured and predicted speedup."""


# Logs and CI output are not terminals: give tables room instead of rich's 80-column default.
console = Console() if sys.stdout.isatty() else Console(width=150)
err_console = Console(stderr=True)


def _setup_logging() -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.WARNING, handlers=[RichHandler(console=err_console, show_path=False)], format="%(message)s"
    )
    logging.getLogger("specbench").setLevel(logging.INFO)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _slug(name: str) -> str:
    return Path(name).stem.replace("/", "_") if name.endswith(".gguf") else name.rstrip("/").replace("/", "_")


# In a log (CI, a job's output, a pipe) rich draws a bar once, as it ends, and so says nothing of where
# the time went: there the bars are off and each stage gets a line (_follow, distill).
LOG_EVERY_S = 15.0  # in a log, a stage that counts on gets a line at most this often
STARTED = time.monotonic()  # when main() began the command: before torch and the models load
RUN_DIR: Path | None = None  # the run directory a run writes as it goes: what an interrupted one says to resume
RESUMABLE = True  # whether that run could go on with --resume (an online method's learning cannot)


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )


def _log_line(text: str) -> None:
    """A line of a command's progress in a log: the seconds since it began, then ``text``."""
    console.print(f"[{time.monotonic() - STARTED:7.1f} s] {text}", highlight=False, markup=False, soft_wrap=True)


def _follow(events, progress: Progress):
    """Shows the Progress events of a long command (bench.serve.Progress) and returns its last other
    event, its results (None if it yielded none). On a terminal: one bar. In a log: a line when the
    stage changes, and at most every LOG_EVERY_S while it counts on; then one when it has finished."""
    from specbench.bench.serve import Progress as Stage

    result, task, said, said_at = None, None, None, 0.0
    with progress:
        for event in events:
            if not isinstance(event, Stage):
                result = event
                continue
            text = event.label or event.stage
            if task is None:
                task = progress.add_task(text, total=None)
            else:
                progress.update(task, description=text, completed=event.done, total=event.total or None)
            if progress.disable:
                stage = event.stage if not event.label else f"{event.stage}: {event.label}"
                counted = f"{stage} ({event.done}/{event.total})" if event.total else stage
                if event.stage != said or time.monotonic() - said_at >= LOG_EVERY_S or event.done == event.total > 0:
                    _log_line(counted)
                    said, said_at = event.stage, time.monotonic()
    if progress.disable:
        _log_line("finished")
    return result


def _prefill_bar(progress: Progress):
    """A second bar for long prefills, shown while one runs: a callback for the benchmark."""
    task = None

    def show(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            task = progress.add_task("prefill (tokens)", total=total)
        progress.update(task, completed=done, total=total, visible=done < total)

    return show


def _show(events, progress: Progress, wide: bool = False) -> None:
    """Progress while the benchmark runs, then its tables and verdicts."""
    results = _follow(events, progress)
    if results is not None and results.summary:
        _print_results(results, wide)


def _print_results(results, wide: bool = False) -> None:
    """A run's tables and verdicts (bench.run.Results)."""
    from specbench.results.report import (
        best_k_line,
        category_table,
        greedy_lines,
        levels_table,
        phase_table,
        predicted_table,
        serving_table,
        summary_table,
        thinking_table,
    )

    console.print(summary_table(results.summary, results.title, wide))
    if (serving := serving_table(results.summary, wide)) is not None:
        console.print(serving)
    if (phases := phase_table(results.summary)) is not None:  # none for a serving engine's rows alone
        console.print(phases)
    if (levels := levels_table(results.summary)) is not None:
        console.print(levels)
    if (spans := thinking_table(results.summary)) is not None:
        console.print(spans)
    if results.categories:
        console.print(category_table(results.categories))
    if results.predicted:
        console.print(predicted_table(results.predicted))
    for method, picks in results.best_ks.items():
        console.print(best_k_line(method, picks))
    if results.forward:
        console.print(f"forward: {results.forward}")
    for path in results.plots:
        console.print(f"plot: {path}")
    for line in results.suggestions:
        console.print(line)
    if results.greedy:
        for line in greedy_lines(results.summary):
            console.print(line)
    console.print(f"results in {results.out}/ (results.json, summary.csv, records.csv, ...)")


ASSUMED_ALPHAS = [0.5, 0.6, 0.7, 0.8]  # --assume-alpha's default with --random-weights


def run(out: Path | None = None, resume: bool = False, wide: bool = False, ctx=None, **given) -> None:
    """Decode prompts with the baseline and each method at each K; write and show what was measured."""
    values = {name: OPTIONS[name].value(text) for name, text in given.items()}
    per_k = [entry.split("=", 1)[0] for entry in values["launch"] if "{k}" in entry]
    if per_k and ctx is not None and ctx.info_name == "run" and ctx.get_parameter_source("ks").name == "DEFAULT":
        raise SpecbenchError(
            f"--launch {per_k[0]}=...: {{k}} starts a server for each --k; give the K to sweep, e.g. --k 1,2,3,4 "
            "(or run sweep-k)"
        )
    lengths = values["context_tokens"] if isinstance(values["context_tokens"], list) else [values["context_tokens"]]
    values["context_tokens"] = lengths[0] if len(lengths) == 1 else 0  # a sweep sets each length in turn
    cfg = BenchConfig(**values)
    if cfg.random_weights and not cfg.assume_alpha and cfg.unread("assume_alpha") is None:
        cfg.assume_alpha = list(ASSUMED_ALPHAS)  # random weights' default, where the run reads it
    if resume and out is None:
        raise SpecbenchError("--resume needs --out DIR: the run directory to continue")
    for length in lengths:  # bad options are refused here, before torch loads (benchmark checks them again)
        dataclasses.replace(cfg, context_tokens=length).validate()
    _setup_logging()
    from specbench.bench.run import benchmark

    out = out or Path("results") / f"{time.strftime('%Y%m%d-%H%M%S')}-{_slug(cfg.target)}-{_slug(cfg.draft)}"
    if len(lengths) > 1 and not resume:  # each length's run refuses too, but only when its turn comes
        from specbench.results.rundir import refuse_to_replace

        for length in lengths:
            refuse_to_replace(out / f"context-{length}", resumable=not cfg.learns)
    global RUN_DIR, RESUMABLE
    RUN_DIR, RESUMABLE = out, not cfg.learns
    if len(lengths) == 1:
        progress = _progress()
        _show(benchmark(cfg, out, resume, prefill_progress=_prefill_bar(progress)), progress, wide)
        return
    _sweep_context(cfg, lengths, out, resume, wide)


def _sweep_context(cfg: BenchConfig, lengths: list[int], out: Path, resume: bool, wide: bool = False) -> None:
    """One run per context length, each in its own directory, then what they show together."""
    from specbench.bench.run import benchmark
    from specbench.results.context import write_context
    from specbench.results.plot import plot_context
    from specbench.results.report import context_table

    runs = {}
    for length in lengths:
        runs[length] = out / f"context-{length}"
        console.rule(f"context {length} tokens")
        progress = _progress()
        events = benchmark(
            dataclasses.replace(cfg, context_tokens=length),
            runs[length],
            resume and (runs[length] / "meta.json").is_file(),  # a length the interruption never reached starts now
            prefill_progress=_prefill_bar(progress),
        )
        _show(events, progress, wide)
    rows, wins = write_context(out, runs)
    console.rule("by context length")
    console.print(context_table(rows, wins))
    console.print(f"plot: {plot_context(out)}")
    console.print(f"results in {out}/ (context.csv, crossover.json, context.png; a directory per length)")


def _command(defaults: dict | None = None):
    """`run` with its flags built from the declarations (and other ``defaults``)."""
    return flags.command(run, OPTIONS.values(), defaults, (flags.RUN_OUT, flags.RESUME, flags.WIDE, flags.CONTEXT))


app.command("run")(_command())
app.command("sweep-k", help="`run` with K swept over 1,2,3,4,6,8 by default: one baseline per prompt shared by all K.")(
    _command({"ks": "1,2,3,4,6,8"})
)
app.command(
    "sweep-context",
    help="`run` on long code prompts at 1024, 2048, 4096 and 8064 tokens (--context-tokens) with speculative, "
    "speculative-window, self-sparse and triforce at K=3 by default: a run per length, then context.csv, the context "
    "length from which each method beats the baseline and speculative (crossover.json), and context.png.",
)(
    _command(
        {
            "dataset": "longcode",
            "context_tokens": "1024,2048,4096,8064",
            "methods": [",".join(LONG_CONTEXT)],
            "ks": "3",
            "num_prompts": 4,
        }
    )
)


def audit_command(out: Path | None = None, **given) -> None:
    """Audit speculative decoding from outside: whether each subject (the speculative --method of any
    --engine, --server, or a --broken one) returns what its engine's target alone returns: equal greedy
    answers, and, at each sampling --setting, samples of the same law (a two-sample test against the
    reference, with a control arm and the TV it could detect). Exit 0 when every subject passes, 1 when
    one fails, 2 on bad input, 3 when one could not be judged (not exercised, inconclusive, underpowered)."""
    cfg = BenchConfig(**{name: OPTIONS[name].value(text) for name, text in given.items() if name in OPTIONS})
    cfg.validate("audit")
    _setup_logging()
    from specbench.audit.run import audit, plan_of
    from specbench.audit.verdicts import FAIL, NOT_APPLICABLE, PASS
    from specbench.results.report import audit_table

    plan = plan_of(cfg, {option.name: option.value(given[option.name]) for option in AUDIT})
    out = out or Path("results") / f"{time.strftime('%Y%m%d-%H%M%S')}-audit-{_slug(cfg.target)}"
    report = _follow(audit(cfg, plan, out), _progress())
    rows = report["rows"]
    console.print(audit_table(rows, f"audit of {cfg.target}: {plan.samples} samples of {plan.length} tokens per arm"))
    console.print(f"results in {out}/ (audit.json, samples.jsonl)")
    subjects_rows = [r for r in rows if r["test"] != "control"]
    if any(r["verdict"] == FAIL for r in subjects_rows):
        raise typer.Exit(1)
    if any(r["verdict"] not in (PASS, NOT_APPLICABLE) for r in rows):
        raise typer.Exit(3)


app.command("audit")(flags.command(audit_command, [*OPTIONS.values(), *AUDIT], extra=(flags.AUDIT_OUT,)))


@app.command()
def theory(
    alpha: Annotated[
        str, typer.Option(help="Acceptance alpha in [0, 1]; with --costs a comma-separated list.")
    ] = "0.5,0.6,0.7,0.8",
    c: Annotated[float | None, typer.Option(help="Cost ratio: draft step time / target step time (>= 0).")] = None,
    ks: Annotated[
        str, typer.Option("--k", "--ks", help="Lookaheads, comma-separated (as run's --k).")
    ] = "1,2,3,4,5,6,7,8",
    costs: Annotated[
        Path | None,
        typer.Option(
            help="A run directory (or its verify_cost.csv): take c and each K's verification cost from what it "
            "measured, and predict the speedup of every --alpha at every measured K (as predicted.csv)."
        ),
    ] = None,
    format: Annotated[str, typer.Option(help="table or csv.", metavar="[table|csv]")] = "table",
) -> None:
    """The speedup formula alone (no models): per K, the optimum, and the break-even c; or, with
    --costs, the speedup each alpha would give with a run's measured forward costs."""
    from specbench.core import metrics

    if format not in ("table", "csv"):
        raise SpecbenchError(f"--format {format!r}: use table or csv")
    alphas = OPTIONS["assume_alpha"].value(alpha)
    if not alphas or not all(0 <= a <= 1 for a in alphas):
        raise SpecbenchError("--alpha must be in [0, 1]")
    if costs is not None:
        _theory_from_costs(alphas, costs, c, format)
        return
    if c is None or not math.isfinite(c) or c < 0 or len(alphas) != 1:
        raise SpecbenchError("give one --alpha and a finite --c >= 0, or a run's measured costs with --costs RUN_DIR")
    alpha = alphas[0]
    k_list = OPTIONS["ks"].value(ks)
    OPTIONS["ks"].validate(k_list)
    rows = [(k, metrics.expected_tokens(alpha, k), metrics.predicted_speedup(alpha, c, k)) for k in k_list]
    best, best_speedup = metrics.optimal_k(alpha, c, k_list)
    if format == "csv":
        print("alpha,c,k,expected_tokens,predicted_speedup")
        for k, tokens, speedup in rows:
            print(f"{alpha},{c},{k},{tokens:.6f},{speedup:.6f}")
        return
    table = Table(title=f"alpha={alpha}  c={c}", caption="speedup = (1-a^(K+1)) / ((1-a)(Kc+1))")
    for name in ("K", "E\\[tokens]", "speedup"):
        table.add_column(name, justify="right")
    for k, tokens, speedup in rows:
        table.add_row(str(k), f"{tokens:.3f}", f"[bold]{speedup:.3f}[/]" if k == best else f"{speedup:.3f}")
    console.print(table)
    console.print(f"optimal K = {best} with speedup {best_speedup:.3f}")
    overall = metrics.unbounded_optimal_k(alpha, c)
    if overall is None:
        console.print("beyond --k the speedup keeps growing with K: no K is best (c = 0, or alpha = 1)")
    elif overall[0] not in k_list:
        console.print(f"beyond --k: K = {overall[0]} gives {overall[1]:.3f}, the best of every K")
    console.print(f"some K in this range beats the target alone while c < {metrics.max_useful_c(alpha, k_list):.4f}")


def _theory_from_costs(alphas: list[float], path: Path, c: float | None, format: str) -> None:
    import csv

    from specbench.models.costs import ForwardCosts
    from specbench.results.report import predicted_table
    from specbench.results.summary import predicted_rows

    file = path / "verify_cost.csv" if path.is_dir() else path
    if c is not None:
        raise SpecbenchError("--c and --costs exclude each other: --costs takes c from the run's draft forward")
    if not file.is_file():
        raise SpecbenchError(
            f"{file} does not exist: give --costs a run directory of `specbench run`, or its verify_cost.csv"
        )
    try:
        with open(file, newline="") as f:
            costs = ForwardCosts.from_rows(list(csv.DictReader(f)))
    except (OSError, KeyError, ValueError, IndexError):
        raise SpecbenchError(f"{file} is not a verify_cost.csv written by `specbench run`") from None
    if costs.draft_single is None or 1 not in costs.target:
        raise SpecbenchError(f"{file} has no draft forward or no one-token target forward: run with a draft")
    seconds = [costs.draft_single.seconds, *(cost.seconds for cost in costs.target.values())]
    if not all(math.isfinite(s) and s > 0 for s in seconds):
        raise SpecbenchError(f"{file} holds a forward time that is not a positive number: measure the costs again")
    rows = predicted_rows(alphas, costs)
    if not rows:
        raise SpecbenchError(
            f"{file} has no target forward of 2 tokens or more, to verify a draft: measure it with a run"
        )
    if format == "csv":
        print(",".join(rows[0]))
        for row in rows:
            print(",".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in row.values()))
        return
    console.print(predicted_table(rows))


@app.command("list")
def list_(
    what: Annotated[
        str,
        typer.Argument(
            help="methods, models, datasets, broken or all.", metavar="[methods|models|datasets|broken|all]"
        ),
    ] = "all",
) -> None:
    """What specbench can run: the methods (with the options each owns), the model aliases, the datasets,
    and the audit's known-broken subjects."""
    if what not in ("methods", "models", "datasets", "broken", "all"):
        raise SpecbenchError(f"specbench list {what}: use methods, models, datasets, broken or all")
    if what in ("methods", "all"):
        table = Table("method", "engine", "K", "draft model", "what it does", "its options", title="methods (--method)")
        for m in [*METHODS.values(), *SERVED.values()]:
            k = "tree" if m.takes_tree else f"K: {', '.join(m.k_policies)}" if m.takes_k else "-"
            options = "\n".join(f"{o.flag} ({o.default})" for o in m.options) or "-"
            table.add_row(m.name, m.engine, k, "yes" if m.needs_draft else "-", m.help, options)
        console.print(table)
        console.print("--engine vllm runs vLLM's methods, and for speculative and prompt-lookup vLLM's draft and ngram")
    if what in ("models", "all"):
        table = Table(
            "alias", "source", "random weights", title="model aliases (--target, --draft; EAGLE heads: --speculator)"
        )
        for alias, entry in read_config("models.toml").items():
            source = entry.get("hub") or entry.get("bundled") and "shipped with specbench" or entry.get("install", "")
            table.add_row(alias, source, "yes" if "architecture" in entry else "-")
        console.print(table)
        console.print("or a hub id, a local checkpoint directory, or a .gguf file")
    if what in ("datasets", "all"):
        table = Table("dataset", "source", title="datasets (--dataset)")
        for name, source in dataset_sources():
            table.add_row(name, source)
        console.print(table)
    if what in ("broken", "all"):
        table = Table("subject", "its bug", "seen in", title="known-broken subjects (specbench audit --broken)")
        for subject in BROKEN.values():
            table.add_row(subject.name, subject.help, subject.where)
        console.print(table)


@app.command()
def compare(
    baseline: Annotated[str, typer.Argument(help="Baseline run directory or summary.csv.")],
    current: Annotated[str, typer.Argument(help="Current run directory or summary.csv.")],
    tolerance: Annotated[
        float, typer.Option(help="Relative tolerance for timing metrics (throughput, speedup, c).")
    ] = 0.10,
    abs_tolerance: Annotated[
        float, typer.Option(help="Absolute tolerance for deterministic metrics (alpha, tau, acceptance_rate).")
    ] = 0.01,
    metric: Annotated[list[str] | None, typer.Option(help="Compare only this metric (repeatable).")] = None,
    json: Annotated[str | None, typer.Option("--json", help="Write the verdict as JSON here.")] = None,
    markdown: Annotated[str | None, typer.Option(help="Write a Markdown table here.")] = None,
    confidence: Annotated[
        float, typer.Option(help="Confidence of the paired-bootstrap interval of speedup and tokens/s changes.")
    ] = 0.95,
    allow_unjudged: Annotated[
        bool,
        typer.Option(
            help="Pass although a metric could not be judged on any row (e.g. timings against another machine's "
            "baseline); it is still reported as NOT JUDGED."
        ),
    ] = False,
) -> None:
    """Compare two runs.

    Exit 0: pass; 1: a metric regressed or a row is missing; 2: unusable input; 3: a metric could not
    be judged on any row (timings against a baseline from another machine), unless --allow-unjudged.
    """
    from specbench.results.compare import run_compare

    raise typer.Exit(
        run_compare(
            baseline,
            current,
            tolerance,
            abs_tolerance,
            metric,
            json,
            markdown,
            console,
            confidence,
            allow_unjudged=allow_unjudged,
        )
    )


# distill shares these options with run: the same declarations.
Target, Seed, Device = (flags.parameter(OPTIONS[name]).annotation for name in ("target", "seed", "device"))


@app.command()
def distill(
    out: Annotated[Path, typer.Option(help="Directory for the draft checkpoint (and resumable training state).")],
    target: Target = "smollm2-135m",
    kind: Annotated[
        str,
        typer.Option(
            help="draft: a small model (--draft DIR); eagle: an EAGLE-3 head over the target's features (--speculator DIR, Llama targets)."
        ),
    ] = "draft",
    ttt_steps: Annotated[
        int, typer.Option(help="eagle: steps of the training-time test (the head reads its own outputs).")
    ] = 3,
    head_intermediate: Annotated[int, typer.Option(help="eagle: the head's MLP width (0: the target's).")] = 0,
    hidden_size: Annotated[int, typer.Option(help="Draft width.")] = 256,
    layers: Annotated[int, typer.Option(help="Draft depth (decoder layers).")] = 2,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads (grouped-query attention).")] = 2,
    intermediate_size: Annotated[int, typer.Option(help="MLP width.")] = 768,
    init: Annotated[
        str,
        typer.Option(
            help="pca: start from a projection of the target's embeddings; random; or a checkpoint to go on training (its shape then wins over the size options): a draft's directory, or for --kind eagle a head's directory or alias."
        ),
    ] = "pca",
    draft_vocab: Annotated[
        int,
        typer.Option(
            help="The drafter's vocabulary: the N ids the target ranks first most often in the training data (0: all of them). Each id costs a row of the vocabulary projection, a large part of a drafter's step."
        ),
    ] = 0,
    tokenizer_vocab: Annotated[
        int,
        typer.Option(
            help="--kind draft: give the draft a tokenizer of its own, a byte-level BPE of N tokens trained on the target's answers and --source (0: the target's tokenizer). It learns the answers' text by cross-entropy (distributions over another vocabulary cannot be distilled); --teacher-tokens then counts tokens of --source it reads as text."
        ),
    ] = 0,
    source: Annotated[
        list[str] | None,
        typer.Option(help="Training text: files or directories of .py (default: Python's standard library)."),
    ] = None,
    teacher_tokens: Annotated[
        int, typer.Option(help="Tokens of --source the target labels with its top-k distribution (0: none).")
    ] = 300_000,
    top_k: Annotated[int, typer.Option(help="Teacher probabilities kept per position.")] = 32,
    seq_len: Annotated[int, typer.Option(help="Training sequence length.")] = 256,
    epochs: Annotated[float, typer.Option(help="Passes over the teacher data.")] = 3.0,
    batch: Annotated[int, typer.Option(help="Sequences per optimiser step.")] = 8,
    data: Annotated[
        str,
        typer.Option(
            help="What the target answers: sharegpt (chat, less the conversations --dataset sharegpt evaluates), humaneval (function stubs from --source), or a conversation FILE; a mixture as sharegpt:3,humaneval:1. Spec-Bench's and MT-Bench's questions are held out."
        ),
    ] = "humaneval",
    generate_prompts: Annotated[
        int,
        typer.Option(
            help="Prompts of --data the target answers itself (chat-formatted like the evaluation's); 0 = none."
        ),
    ] = 1024,
    max_prompt_tokens: Annotated[int, typer.Option(help="Longer prompts of --data are skipped.")] = 1024,
    generate_new_tokens: Annotated[int, typer.Option(help="Tokens the target writes per prompt.")] = 128,
    teacher_engine: Annotated[
        str,
        typer.Option(
            help="Who writes the target's answers: torch (the target itself, batched generate), llama-cpp (llama.cpp's llama-server from the same weights; `make install-llama-cpp`) or vllm (vLLM in this process, from .venv-vllm; `make install-vllm`). Another engine's answers are checked against the torch target on the first batch."
        ),
    ] = "torch",
    teacher_gguf: Annotated[
        str | None,
        typer.Option(
            help="llama-cpp: the GGUF it serves (default: the target's own .gguf, else its checkpoint converted to f32 once).",
            metavar="PATH",
        ),
    ] = None,
    llama_server: Annotated[
        str | None,
        typer.Option(
            help="llama-cpp: the llama-server binary (default: $LLAMA_CPP_DIR/bin, .llama-cpp/bin, then PATH).",
            metavar="PATH",
        ),
    ] = None,
    generate_batch: Annotated[int, typer.Option(help="Prompts the target answers at once.")] = 64,
    sampled_fraction: Annotated[
        float, typer.Option(help="Share of answer batches sampled at T=1; the rest are greedy.")
    ] = 0.25,
    generated_repeats: Annotated[
        int, typer.Option(help="Times the target's own answers count per epoch (they match what it is evaluated on).")
    ] = 4,
    answers_from: Annotated[
        list[str] | None,
        typer.Option(
            help="An earlier distill run's --out (repeatable) whose answers to train on beside this run's: its prompts are not drawn again (--generate-prompts counts new ones), what it held out stays held out, and a head reads its stored features (computed there if missing).",
            metavar="DIR",
        ),
    ] = None,
    lr: Annotated[float, typer.Option(help="Peak learning rate (cosine decay).")] = 2e-3,
    train_dtype: Annotated[
        str,
        typer.Option(
            help="The training forwards' products: float32, or bfloat16 under autocast (weights, optimiser and loss stay float32), faster on CPUs with bfloat16 units and on GPUs."
        ),
    ] = "float32",
    seed: Seed = 0,
    device: Device = "auto",
) -> None:
    """Train a small draft (or with --kind eagle an EAGLE-3 head) for TARGET from the target's own
    next-token distributions.

    Rerunning the same command resumes: stored teacher shards are kept, training continues
    from the last saved step. Settings that change what is stored (the target, --seq-len, --top-k,
    --source, --data, --seed, the draft's recipe) must be those the stored data were made with.
    """
    from specbench.models.load import load, resolve_device
    from specbench.training import distill as distillation
    from specbench.training.distill_eagle import distill_eagle
    from specbench.training.distill_own_tokenizer import distill_own_vocabulary

    _setup_logging()
    # Every option of this command but --source and --device is the DistillConfig field of its name.
    given, fields = locals(), distillation.DistillConfig.__dataclass_fields__
    cfg = distillation.DistillConfig(
        **{name: value for name, value in given.items() if name in fields and name != "answers_from"}
    )
    if source:
        cfg.sources = source
    cfg.answers_from = answers_from or []
    cfg.validate()
    OPTIONS["device"].validate(device)
    with console.status("loading the target"):
        teacher = load(target, resolve_device(device), __import__("torch").float32)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,  # in a log: a line per phase, and every LOG_EVERY_S (_follow's)
    )
    tasks: dict[str, int] = {}
    last, said_at = None, 0.0
    with progress:
        phases = (
            distill_eagle if cfg.trains_head else distill_own_vocabulary if tokenizer_vocab else distillation.distill
        )
        for p in phases(cfg, teacher):
            label = {
                "generate": "target answers prompts",
                "student": "draft training (steps)",
                "tokenizer": "draft's own tokenizer",
                "features": "target features (sequences)",
                "head": "EAGLE head training (steps)",
            }.get(p.phase, f"target labels {p.phase.split(':')[-1]} (sequences)")
            if p.phase not in tasks:
                tasks[p.phase] = progress.add_task(label, total=p.total, loss="")
            loss = f"loss {p.loss:.3f}" if p.loss is not None else ""
            if p.agreement is not None:
                kind_of = "text/token " if tokenizer_vocab else ""
                loss += f" held-out {kind_of}agreement {'/'.join(f'{a:.3f}' for a in (p.agreement, *p.later))}"
            progress.update(tasks[p.phase], completed=p.done, total=p.total, loss=loss)
            if progress.disable and (
                last is None or p.phase != last.phase or p.done == p.total or time.monotonic() - said_at >= LOG_EVERY_S
            ):
                left = next(t for t in progress.tasks if t.id == tasks[p.phase]).time_remaining
                eta = f" (about {left / 60:.0f} min left)" if left and p.done < p.total else ""
                _log_line(f"{label} {p.done}/{p.total}{eta} {loss}".rstrip())
                said_at = time.monotonic()
            last = p
    console.print(f"{kind} saved in {out}/ (use {'--speculator' if cfg.trains_head else '--draft'} {out})")
    if last is not None and last.agreement is not None and tokenizer_vocab:
        console.print(
            f"held-out greedy answers of the target, per position in the draft's tokens: the draft's greedy token "
            f"begins the target's text at {last.agreement:.3f}, is its next token at {last.later[0]:.3f}"
        )
    elif last is not None and last.agreement is not None:
        steps = f" (training-time test steps 0..{len(last.later)})" if last.later else ""
        console.print(
            f"top-1 agreement with held-out greedy answers of the target: {'/'.join(f'{a:.3f}' for a in (last.agreement, *last.later))}{steps} (step 0 estimates greedy alpha)"
        )
    spent = distillation.PhaseSeconds(out).seconds
    if spent:
        each = ", ".join(f"{phase.split(':')[0]} {seconds / 60:.1f}" for phase, seconds in spent.items())
        console.print(
            f"minutes per phase, over every run on {out}: {each}; {sum(spent.values()) / 60:.1f} in all", soft_wrap=True
        )


@app.command()
def show(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by run, sweep-k or sweep-context.")],
    wide: Annotated[bool, typer.Option("--wide", help="Show every column of the summary table.")] = False,
) -> None:
    """Print a finished run's tables again from its directory: the summary (with --wide every column),
    and the serving, phase, level, category and predicted-speedup tables the run printed."""
    from specbench.bench.run import Results

    _print_results(Results.read(run_dir), wide)


@app.command()
def plot(run_dir: Annotated[Path, typer.Argument(help="A run directory written by run or sweep-k.")]) -> None:
    """Redraw a run's figures from its CSVs: time per token by phase; for methods with K speedup vs
    K, acceptance by position and verification cost; with --method online, alpha over the run; for
    serving engines at several loads, speedup and the trade-off of per-request and total tokens/s."""
    from specbench.results.plot import (
        plot_categories,
        plot_concurrency,
        plot_online,
        plot_pareto,
        plot_phases,
        plot_run,
    )

    for path in (
        plot_phases(run_dir),
        plot_run(run_dir),
        plot_online(run_dir),
        plot_concurrency(run_dir),
        plot_pareto(run_dir),
        plot_categories(run_dir),
    ):
        if path is not None:
            console.print(f"wrote {path}")


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is torch's out of memory (only a command that imported torch can raise it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def _paragraphs(text: str) -> str:
    """Help text with each paragraph's lines joined: rich's help keeps a docstring's line breaks."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(text).split("\n\n"))


for _info in app.registered_commands:
    _info.help = _paragraphs(_info.help or _info.callback.__doc__ or "")


def main() -> None:
    global STARTED, RUN_DIR
    STARTED, RUN_DIR = time.monotonic(), None
    try:
        app()
    except Exception as e:  # bad input, or out of memory in any forward (the run kept its rows)
        memory = _out_of_memory(e)
        if not isinstance(e, SpecbenchError) and not memory:
            raise
        said = out_of_memory(str(e)) if memory else e
        err_console.print(f"[red]error:[/] {said}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except SystemExit as e:
        # Typer turns Ctrl-C into a silent exit 130: a run says where its rows are and how to go on, once
        # it has a run to resume (a run stopped before its meta.json removes a directory it made).
        if e.code == 130 and RUN_DIR is not None:
            started = (RUN_DIR / "meta.json").is_file() or any(RUN_DIR.glob("context-*/meta.json"))
            go_on = (
                f"the same command with --resume --out {RUN_DIR} goes on from there"
                if RESUMABLE
                else "--resume cannot restore what --method online learned: run the command again with another --out"
            )
            err_console.print(
                f"interrupted: what was measured is in {RUN_DIR}/; {go_on}"
                if started
                else "interrupted before anything was measured",
                highlight=False,
                soft_wrap=True,
            )
        raise
