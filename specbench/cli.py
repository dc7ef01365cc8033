"""The command line: a thin layer that parses options, shows progress and hands off."""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .errors import SpecbenchError
from .online import OnlineConfig

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=False,
    help="Run and benchmark speculative decoding: acceptance, cost ratio, measured and predicted speedup.",
)
# Logs and CI output are not terminals: give tables room instead of rich's 80-column default.
console = Console() if sys.stdout.isatty() else Console(width=150)
err_console = Console(stderr=True)

# Options of `run` (and so of `sweep-k`, the same command with other defaults).
Target = Annotated[
    str, typer.Option(help="Target model: alias from configs/models.toml, hub id, local dir or .gguf file.")
]
Draft = Annotated[str, typer.Option(help="Draft model (same forms as --target); must share the target's tokenizer.")]
Ks = Annotated[
    str,
    typer.Option(
        "--k", "--ks", help="Lookahead (draft tokens per verification); a comma-separated list sweeps, e.g. 1,2,4."
    ),
]
Dataset = Annotated[str, typer.Option(help="humaneval, xsum, or a local .jsonl/.csv/.parquet file.")]
PromptField = Annotated[str, typer.Option(help="Field holding the prompt in a local dataset file.")]
NumPrompts = Annotated[int, typer.Option(help="How many prompts (from the start of the dataset).")]
MaxNewTokens = Annotated[int, typer.Option(help="Tokens to generate per prompt (decoding also stops at EOS).")]
Temperature = Annotated[float, typer.Option(help="0 = greedy (exact argmax); > 0 samples.")]
TopK = Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass (1.0 = off).")]
Eta = Annotated[
    float,
    typer.Option(help="Eta sampling's epsilon, applied to target and draft alike after top-k and top-p (0 = off)."),
]
Trees = Annotated[
    list[str] | None,
    typer.Option(
        "--tree",
        help="Tree shape for --method tree and lookup-tree: the branching at each depth, e.g. 2,2,1 "
        "(2 + 4 + 4 = 10 nodes, K = 3). Repeat to compare shapes. Default 2,2.",
    ),
]
Seed = Annotated[
    int, typer.Option(help="Base seed; each prompt's generators derive from (seed, prompt index, method).")
]
Device = Annotated[str, typer.Option(help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.")]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16.")]
Repeats = Annotated[int, typer.Option(help="Timed repeats per prompt and method; the median is kept.")]
Warmup = Annotated[int, typer.Option(help="Untimed warm-up passes over the first prompt before timing.")]
CostRepeats = Annotated[int, typer.Option(help="Repeats per forward-cost measurement (c, verify_ratio).")]
Threads = Annotated[
    int,
    typer.Option(
        help="CPU threads for torch (0: torch's default, one per core). On a shared machine use fewer threads "
        "than free cores: a thread that waits for a busy core stalls every forward."
    ),
]
Chat = Annotated[
    str,
    typer.Option(
        help="auto: wrap prompts in the target's chat template when it has one (instruct models); on; off (raw prompts)."
    ),
]
RandomWeights = Annotated[
    bool,
    typer.Option(
        help="Build target and draft from their architecture (configs/ for the aliases, or a config.json) with random "
        "weights: forward costs and tokens/s without the checkpoints; alpha is left empty (see --assume-alpha)."
    ),
]
PromptTokens = Annotated[
    int, typer.Option(help="With --random-weights: random prompts of this many tokens (0: the dataset's lengths).")
]
AssumeAlpha = Annotated[
    str,
    typer.Option(
        help="Comma-separated alphas: predicted.csv and a table of the speedup each would give at each K, from the "
        "measured forward costs (default 0.5,0.6,0.7,0.8 with --random-weights)."
    ),
]
DeviceMap = Annotated[
    str,
    typer.Option(
        help="Spread the target over the GPUs with accelerate: auto, balanced, balanced_low_0 or sequential "
        "(empty: all on --device). The map goes into meta.json."
    ),
]
CascadeSplit = Annotated[
    int,
    typer.Option(
        help="--method cascade: the draft model (sped up by lookup) drafts the first M positions of a round and prompt "
        "lookup alone the rest (a horizontal cascade); 0: the draft model drafts all K."
    ),
]
KvBudget = Annotated[
    int,
    typer.Option(
        help="self-sparse, triforce: KV-cache positions the target drafts over (the first 16, then per --kv-policy)."
    ),
]
KvPolicy = Annotated[
    str,
    typer.Option(
        help="self-sparse, triforce: retrieval (chunks of 8 tokens that the last prompt token's query scores highest, "
        "per layer and head: TriForce's retrieval cache) or window (the most recent tokens: StreamingLLM)."
    ),
]
DraftWindow = Annotated[
    int, typer.Option(help="triforce, speculative-window: the draft model's streaming window (sinks + recent tokens).")
]
InnerK = Annotated[int, typer.Option(help="triforce: draft-model tokens the middle level checks at a time.")]
ContextTokens = Annotated[
    str,
    typer.Option(
        help="--dataset longcode: prompt length in tokens (source cut to end inside a function). A comma-separated "
        "list runs once per length into OUT/context-N/ and writes context.csv, crossover.json and context.png."
    ),
]
PrefillChunk = Annotated[
    int,
    typer.Option(help="Prefill prompts longer than this in chunks of it, so memory stays bounded (0: one forward)."),
]
OnlineEvery = Annotated[int, typer.Option(help="--method online: update the draft after every N prompts.")]
OnlineSteps = Annotated[
    int, typer.Option(help="--method online: optimiser steps per update, over the lessons since the last one.")
]
OnlineLr = Annotated[float, typer.Option(help="--method online: learning rate of the draft's updates (AdamW).")]
SaveDraft = Annotated[
    Path | None,
    typer.Option(
        help="--method online: write the updated draft here at the end (a checkpoint --draft loads; one k<K>/ "
        "directory per K when several K learn). The shipped draft is never changed."
    ),
]
Out = Annotated[Path | None, typer.Option(help="Run directory (default results/<time>-<target>-<draft>/).")]
Resume = Annotated[
    bool,
    typer.Option(help="Continue an interrupted run in --out with the same configuration: finished prompts are kept."),
]


def _method_help() -> str:
    from .methods import METHODS

    listed = "; ".join(f"{m.name}: {m.help}" for m in METHODS.values())
    return f"Decoding methods, repeatable or comma-separated ({listed})."


Method = Annotated[list[str] | None, typer.Option(help=_method_help())]


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.WARNING, handlers=[RichHandler(console=err_console, show_path=False)], format="%(message)s"
    )
    logging.getLogger("specbench").setLevel(logging.INFO)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _parse_ks(text: str, option: str = "--k") -> list[int]:
    """A sorted list of distinct integers from ``option``'s comma-separated text."""
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise SpecbenchError(
            f"{option} {text!r} is not an integer or a comma-separated list of integers, e.g. 1,2,3,4"
        ) from None
    if not ks:
        raise SpecbenchError(f"{option} is empty: give a number such as 4 or a list such as 1,2,3,4")
    return ks


def _parse_alphas(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SpecbenchError(f"--assume-alpha {text!r}: give alphas like 0.5,0.6,0.7,0.8") from None


def _slug(name: str) -> str:
    return Path(name).stem.replace("/", "_") if name.endswith(".gguf") else name.rstrip("/").replace("/", "_")


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def _prefill_bar(progress: Progress):
    """A second bar for long prefills, shown while one runs: a callback for the benchmark."""
    task = None

    def show(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            task = progress.add_task("prefill (tokens)", total=total)
        progress.update(task, completed=done, total=total, visible=done < total)

    return show


def _show(events, progress: Progress) -> None:
    """Progress while the benchmark runs, then its tables and verdicts."""
    from .bench import Results
    from .report import levels_table, phase_table, predicted_table, summary_table

    results, task = None, None
    with progress:
        for event in events:
            if isinstance(event, Results):
                results = event
            elif task is None:
                task = progress.add_task(event.stage, total=None)
            else:
                progress.update(
                    task, description=event.label or event.stage, completed=event.done, total=event.total or None
                )
    if results is None or not results.summary:
        return
    console.print(summary_table(results.summary, results.title))
    console.print(phase_table(results.summary))
    if (levels := levels_table(results.summary)) is not None:
        console.print(levels)
    if results.predicted:
        console.print(predicted_table(results.predicted))
    for method, picks in results.best_ks.items():
        console.print(
            f"best K for {method}: "
            + ", ".join(f"{label} K={p['k']} ({p['speedup']:.2f}x)" for label, p in picks.items())
        )
    for path in results.plots:
        console.print(f"plot: {path}")
    for line in results.suggestions:
        console.print(line)
    if results.greedy:
        mismatched = [f"{r['method']} K={r['k']}" for r in results.summary if r["outputs_match"] < r["num_prompts"]]
        console.print(
            f"greedy outputs differing from the baseline: {', '.join(mismatched)}"
            if mismatched
            else "greedy outputs: every method equals the baseline"
        )
    console.print(f"results in {results.out}/")


@app.command()
def run(
    target: Target = "smollm2-135m",
    draft: Draft = "smollm2-135m-draft",
    k: Ks = "4",
    method: Method = None,
    dataset: Dataset = "humaneval",
    prompt_field: PromptField = "prompt",
    num_prompts: NumPrompts = 10,
    max_new_tokens: MaxNewTokens = 64,
    temperature: Temperature = 0.0,
    top_k: TopK = 0,
    top_p: TopP = 1.0,
    eta: Eta = 0.0,
    tree: Trees = None,
    seed: Seed = 0,
    device: Device = "auto",
    dtype: Dtype = "auto",
    repeats: Repeats = 1,
    warmup: Warmup = 1,
    cost_repeats: CostRepeats = 10,
    threads: Threads = 0,
    chat: Chat = "auto",
    random_weights: RandomWeights = False,
    prompt_tokens: PromptTokens = 0,
    assume_alpha: AssumeAlpha = "",
    device_map: DeviceMap = "",
    cascade_split: CascadeSplit = 0,
    kv_budget: KvBudget = 1024,
    kv_policy: KvPolicy = "retrieval",
    draft_window: DraftWindow = 256,
    inner_k: InnerK = 2,
    context_tokens: ContextTokens = "",
    prefill_chunk: PrefillChunk = 512,
    online_every: OnlineEvery = 1,
    online_steps: OnlineSteps = OnlineConfig.steps,
    online_lr: OnlineLr = OnlineConfig.lr,
    save_draft: SaveDraft = None,
    out: Out = None,
    resume: Resume = False,
) -> None:
    """Decode prompts with the baseline and each method at each K; write and show what was measured."""
    from . import bench
    from .methods import DEFAULT

    _setup_logging()
    lengths = _parse_ks(context_tokens, "--context-tokens") if context_tokens else [0]
    cfg = bench.BenchConfig(
        target=target,
        draft=draft,
        ks=_parse_ks(k),
        methods=[m.strip() for v in method or DEFAULT for m in v.split(",") if m.strip()],
        dataset=dataset,
        prompt_field=prompt_field,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eta=eta,
        trees=[t.replace(" ", "") for t in tree or ["2,2"]],
        seed=seed,
        device=device,
        dtype=dtype,
        repeats=repeats,
        warmup=warmup,
        cost_repeats=cost_repeats,
        threads=threads,
        chat=chat,
        random_weights=random_weights,
        prompt_tokens=prompt_tokens,
        assume_alpha=_parse_alphas(assume_alpha or ("0.5,0.6,0.7,0.8" if random_weights else "")),
        device_map=device_map or None,
        cascade_split=cascade_split,
        kv_budget=kv_budget,
        kv_policy=kv_policy,
        draft_window=draft_window,
        inner_k=inner_k,
        context_tokens=lengths[0] if len(lengths) == 1 else 0,
        prefill_chunk=prefill_chunk,
        online=OnlineConfig(every=online_every, steps=online_steps, lr=online_lr),
        save_draft=str(save_draft) if save_draft else None,
    )
    if resume and out is None:
        raise SpecbenchError("--resume needs --out DIR: the run directory to continue")
    out = out or Path("results") / f"{time.strftime('%Y%m%d-%H%M%S')}-{_slug(target)}-{_slug(draft)}"
    if len(lengths) == 1:
        progress = _progress()
        _show(bench.benchmark(cfg, out, resume, prefill_progress=_prefill_bar(progress)), progress)
        return
    _sweep_context(cfg, lengths, out, resume)


def _sweep_context(cfg, lengths: list[int], out: Path, resume: bool) -> None:
    """One run per context length, each in its own directory, then what they show together."""
    import dataclasses
    import json

    import pandas as pd

    from . import bench
    from .plot import plot_context
    from .report import context_rows, context_table, crossovers

    runs = {}
    for length in lengths:
        runs[length] = out / f"context-{length}"
        console.rule(f"context {length} tokens")
        progress = _progress()
        events = bench.benchmark(
            dataclasses.replace(cfg, context_tokens=length),
            runs[length],
            resume and (runs[length] / "meta.json").is_file(),  # a length the interruption never reached starts now
            prefill_progress=_prefill_bar(progress),
        )
        _show(events, progress)
    rows = context_rows(runs)
    wins = crossovers(rows)
    pd.DataFrame(rows).to_csv(out / "context.csv", index=False)
    (out / "crossover.json").write_text(json.dumps(wins, indent=2) + "\n")
    console.rule("by context length")
    console.print(context_table(rows, wins))
    console.print(f"plot: {plot_context(out)}")
    console.print(f"results in {out}/ (context.csv, crossover.json, context.png; a directory per length)")


def _with_defaults(command, **defaults):
    """The same command with other option defaults (sweep-k is run with a list of K)."""
    signature = inspect.signature(command, eval_str=True)  # typer reads the Annotated options from it
    params = [p.replace(default=defaults.get(p.name, p.default)) for p in signature.parameters.values()]

    @functools.wraps(command)
    def variant(**options):
        return command(**options)

    variant.__signature__ = signature.replace(parameters=params)
    return variant


app.command("sweep-k", help="`run` with K swept over 1,2,3,4,6,8 by default: one baseline per prompt shared by all K.")(
    _with_defaults(run, k="1,2,3,4,6,8")
)
app.command(
    "sweep-context",
    help="`run` on long code prompts at 1024, 2048, 4096 and 8064 tokens (--context-tokens) with speculative, "
    "speculative-window, self-sparse and triforce at K=3 by default: a run per length, then context.csv, the context length from which "
    "each method beats the baseline and speculative (crossover.json), and context.png.",
)(
    _with_defaults(
        run,
        dataset="longcode",
        context_tokens="1024,2048,4096,8064",
        method=["speculative,speculative-window,self-sparse,triforce"],
        k="3",
        num_prompts=4,
    )
)


@app.command()
def theory(
    alpha: Annotated[
        str, typer.Option(help="Acceptance alpha in [0, 1]; with --costs a comma-separated list.")
    ] = "0.5,0.6,0.7,0.8",
    c: Annotated[float | None, typer.Option(help="Cost ratio: draft step time / target step time (>= 0).")] = None,
    ks: Annotated[str, typer.Option(help="Comma-separated lookaheads.")] = "1,2,3,4,5,6,7,8",
    costs: Annotated[
        Path | None,
        typer.Option(
            help="A run directory (or its verify_cost.csv): take c and each K's verification cost from what it "
            "measured, and predict the speedup of every --alpha at every measured K (as predicted.csv)."
        ),
    ] = None,
    format: Annotated[str, typer.Option(help="table or csv.")] = "table",
) -> None:
    """The speedup formula alone (no models): per K, the optimum, and the break-even c; or, with
    --costs, the speedup each alpha would give with a run's measured forward costs."""
    from . import metrics

    if format not in ("table", "csv"):
        raise SpecbenchError(f"--format {format!r}: use table or csv")
    alphas = _parse_alphas(alpha)
    if not alphas or not all(0 <= a <= 1 for a in alphas):
        raise SpecbenchError("--alpha must be in [0, 1]")
    if costs is not None:
        _theory_from_costs(alphas, costs, c, format)
        return
    if c is None or c < 0 or len(alphas) != 1:
        raise SpecbenchError("give one --alpha and --c >= 0, or a run's measured costs with --costs RUN_DIR")
    alpha = alphas[0]
    k_list = _parse_ks(ks)
    if k_list[0] < 1:
        raise SpecbenchError("K must be at least 1")
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
    console.print(f"some K in this range beats the target alone while c < {metrics.max_useful_c(alpha, k_list):.4f}")


def _theory_from_costs(alphas: list[float], path: Path, c: float | None, format: str) -> None:
    import csv

    from .bench import ForwardCosts, predicted_rows
    from .report import predicted_table

    file = path / "verify_cost.csv" if path.is_dir() else path
    if c is not None:
        raise SpecbenchError("--c and --costs exclude each other: --costs takes c from the run's draft forward")
    try:
        with open(file, newline="") as f:
            costs = ForwardCosts.from_rows(list(csv.DictReader(f)))
    except (OSError, KeyError, ValueError, IndexError):
        raise SpecbenchError(f"{file} is not a verify_cost.csv written by `specbench run`") from None
    if costs.draft_single is None or 1 not in costs.target:
        raise SpecbenchError(f"{file} has no draft forward or no one-token target forward: run with a draft")
    rows = predicted_rows(alphas, costs)
    if format == "csv":
        print(",".join(rows[0]))
        for row in rows:
            print(",".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in row.values()))
        return
    console.print(predicted_table(rows))


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
) -> None:
    """Compare two runs; exit 1 when a metric regressed or a row is missing, 2 on unusable input."""
    from .compare import run_compare

    raise typer.Exit(
        run_compare(baseline, current, tolerance, abs_tolerance, metric, json, markdown, console, confidence)
    )


@app.command()
def distill(
    out: Annotated[Path, typer.Option(help="Directory for the draft checkpoint (and resumable training state).")],
    target: Target = "smollm2-135m",
    hidden_size: Annotated[int, typer.Option(help="Draft width.")] = 256,
    layers: Annotated[int, typer.Option(help="Draft depth (decoder layers).")] = 2,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads (grouped-query attention).")] = 2,
    intermediate_size: Annotated[int, typer.Option(help="MLP width.")] = 768,
    init: Annotated[
        str,
        typer.Option(
            help="pca: start from a projection of the target's embeddings; random; or the directory of a draft to go on training (its shape then wins over the size options)."
        ),
    ] = "pca",
    source: Annotated[
        list[str] | None,
        typer.Option(help="Training text: files or directories of .py (default: Python's standard library)."),
    ] = None,
    teacher_tokens: Annotated[
        int, typer.Option(help="Tokens the target labels with its top-k distribution.")
    ] = 300_000,
    top_k: Annotated[int, typer.Option(help="Teacher probabilities kept per position.")] = 32,
    seq_len: Annotated[int, typer.Option(help="Training sequence length.")] = 256,
    epochs: Annotated[float, typer.Option(help="Passes over the teacher data.")] = 3.0,
    batch: Annotated[int, typer.Option(help="Sequences per optimiser step.")] = 8,
    generate_prompts: Annotated[
        int,
        typer.Option(
            help="Function stubs from the sources that the target answers itself (chat-formatted like the evaluation prompts); 0 = none."
        ),
    ] = 1024,
    generate_new_tokens: Annotated[int, typer.Option(help="Tokens the target writes per stub.")] = 128,
    generate_batch: Annotated[int, typer.Option(help="Stubs the target answers at once.")] = 64,
    sampled_fraction: Annotated[
        float, typer.Option(help="Share of answer batches sampled at T=1; the rest are greedy.")
    ] = 0.25,
    generated_repeats: Annotated[
        int, typer.Option(help="Times the target's own answers count per epoch (they match what it is evaluated on).")
    ] = 4,
    lr: Annotated[float, typer.Option(help="Peak learning rate (cosine decay).")] = 2e-3,
    seed: Seed = 0,
    device: Device = "auto",
) -> None:
    """Train a small draft for TARGET from the target's own next-token distributions.

    Rerunning the same command resumes: stored teacher shards are kept, training continues
    from the last saved step.
    """
    from . import distill as distillation
    from .models import load, resolve_device

    _setup_logging()
    cfg = distillation.DistillConfig(
        out=out,
        target=target,
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate_size=intermediate_size,
        init=init,
        seq_len=seq_len,
        teacher_tokens=teacher_tokens,
        top_k=top_k,
        epochs=epochs,
        batch=batch,
        lr=lr,
        seed=seed,
        generate_prompts=generate_prompts,
        generate_new_tokens=generate_new_tokens,
        generate_batch=generate_batch,
        sampled_fraction=sampled_fraction,
        generated_repeats=generated_repeats,
    )
    if source:
        cfg.sources = source
    cfg.validate()
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
    )
    tasks: dict[str, int] = {}
    last = None
    with progress:
        for p in distillation.distill(cfg, teacher):
            last = p
            if p.phase not in tasks:
                label = {"generate": "target answers stubs", "student": "draft training (steps)"}.get(
                    p.phase, f"target labels {p.phase.split(':')[-1]} (sequences)"
                )
                tasks[p.phase] = progress.add_task(label, total=p.total, loss="")
            loss = f"loss {p.loss:.3f}" if p.loss is not None else ""
            if p.agreement is not None:
                loss += f" held-out agreement {p.agreement:.3f}"
            progress.update(tasks[p.phase], completed=p.done, total=p.total, loss=loss)
    console.print(f"draft saved in {out}/ (use --draft {out})")
    if last is not None and last.agreement is not None:
        console.print(
            f"top-1 agreement with held-out greedy answers of the target: {last.agreement:.3f} (an estimate of greedy alpha)"
        )


@app.command()
def plot(run_dir: Annotated[Path, typer.Argument(help="A run directory written by run or sweep-k.")]) -> None:
    """Redraw a run's figures from its CSVs: time per token by phase; for methods with K speedup vs
    K, acceptance by position and verification cost; with --method online, alpha over the run."""
    from .plot import plot_online, plot_phases, plot_run

    for path in (plot_phases(run_dir), plot_run(run_dir), plot_online(run_dir)):
        if path is not None:
            console.print(f"wrote {path}")


def main() -> None:
    try:
        app()
    except SpecbenchError as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted: rows measured so far are in the run directory")
        sys.exit(130)
