"""Results on screen: the rich tables of a run, a context sweep and predictions."""

from __future__ import annotations

import math

from rich import box
from rich.table import Table

from specbench.core.thinking import SPANS
from specbench.methods.registry import BASELINE, METHODS
from specbench.methods.served import SERVED_BASELINE
from specbench.results import schema
from specbench.results.context import CONTENDERS
from specbench.results.schema import OWN_ENGINES
from specbench.results.serving import crossover_lines, load_crossovers
from specbench.results.summary import decoder_label, missing, row_label

# What the summary table shows unless --wide: the columns a user reads first (the rest are in summary.csv).
BRIEF = (
    "engine",
    "concurrency",
    "method",
    "k",
    "tree",
    "k_policy",
    "spec_tokens_per_s",
    "speedup",
    "proposable",  # shown only for a draft with its own tokenizer
    "alpha",
    "tau",
    "c",
    "predicted_speedup_verify",
    "outputs_match",
)
NAMES = ("compile", "engine", "method", "tree", "k_policy")  # columns of words, read left-aligned
BRIEF_HEADERS = {"predicted_speedup_verify": "predicted"}  # the measured verification cost's prediction


def summary_table(rows: list[dict], title: str, wide: bool = False) -> Table:
    """The summary's headed columns (with ``wide``; else those of BRIEF, to fit 100 columns), less
    those that say nothing here: a column empty (or plain, as a fixed K policy) in every row, and a
    configuration column (engine, concurrency, tree) with one value for all of them. A row's speedup
    carries its interval over the prompts where the row has one (``speedup_ci``, results.json's)."""
    cells = {c.name: [schema.fmt(c.name, row.get(c.name)) for row in rows] for c in schema.TABLE}
    cells["speedup"] = [
        _with_interval(row.get("speedup"), row.get("speedup_ci"), cell)
        for cell, row in zip(cells["speedup"], rows, strict=True)
    ]
    shown = [
        c
        for c in schema.TABLE
        if (wide or c.name in BRIEF)
        and (
            c.name == "method"
            or (
                any(cell not in ("-", c.plain) for cell in cells[c.name])
                and (c.kind != schema.CONFIG or len(set(cells[c.name])) > 1)
            )
        )
    ]
    lines = bandwidth_line(rows) + ([] if wide else ["more columns: --wide, or summary.csv"])
    caption = "\n".join(lines) or None
    # One space between columns and no frame: the default table fits 100 columns.
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    for column in shown:
        header = column.header if wide else BRIEF_HEADERS.get(column.name, column.header)
        table.add_column(header, justify="left" if column.name in NAMES else "right", no_wrap=True)
    for i in range(len(rows)):
        table.add_row(*(cells[column.name][i] for column in shown))
    return table


def bandwidth_line(rows: list[dict]) -> list[str]:
    """The caption's line on how close the baseline of specbench's loop came to the hardware: its
    model bandwidth utilisation, the bytes a step read and the copy bandwidth (none where not
    measured). Short, as the caption wraps at the table's width (about 70 columns by default)."""
    row = next((r for r in rows if r.get("engine") == "torch" and r["method"] == BASELINE.name), None)
    if row is None or missing(row.get("baseline_mbu")):
        return []
    kv = "" if missing(row["kv_read_bytes"]) else f" + {_bytes(row['kv_read_bytes'])} KV"
    read = f"{_bytes(row['weight_bytes'])}{kv}"
    return [f"baseline MBU {row['baseline_mbu']:.1%} (a step reads {read}; copy {row['copy_bandwidth_gbs']:.1f} GB/s)"]


def _bytes(n: float) -> str:
    """A byte count in decimal units, three figures: 538 MB, 1.2 kB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _with_interval(speedup, interval, cell: str) -> str:
    """A speedup with its 95% interval over the prompts, when it has one that is not a point (else ``cell``)."""
    if cell == "-" or not interval or any(v is None or v != v for v in interval) or interval[0] == interval[1]:
        return cell
    return f"{speedup:.2f} ({interval[0]:.2f}-{interval[1]:.2f})"


SERVING = (
    ("engine", "engine"),
    ("concurrency", "conc"),
    ("request_rate", "req/s"),
    ("method", "method"),
    ("k", "K"),
    ("spec_tokens_per_s", "tok/s"),
    ("throughput", "all tok/s"),
    ("speedup", "speedup"),
    ("predicted_speedup", "predicted"),
    ("throughput_speedup", "all x"),
    ("vs_specbench", "x specbench"),
    ("ttft_p50_ms", "ttft p50"),
    ("tpot_p50_ms", "tpot p50"),
    ("tpot_p99_ms", "tpot p99"),
    ("itl_p99_ms", "itl p99"),
    ("alpha_estimate", "alpha~"),
    ("tau", "tau"),
    ("c", "c"),
    ("c_implied", "c implied"),
    ("acceptance_source", "from"),
    ("outputs_match", "= base"),
    ("structural", "structural"),
    ("failed", "failed"),
)


# What the serving table shows unless --wide (the rest are in summary.csv): it fits 100 columns.
SERVING_BRIEF = (
    "engine", "concurrency", "request_rate", "method", "k", "spec_tokens_per_s", "throughput", "speedup",
    "throughput_speedup", "tpot_p50_ms", "tau", "outputs_match", "failed",
)  # fmt: skip
LOAD = ("engine", "concurrency", "request_rate")  # shown where they vary


def serving_table(rows: list[dict], wide: bool = False) -> Table | None:
    """Requests in flight: per engine, method, K and concurrency, each request's tokens/s and all of
    them together, with time to first token and per output token (ms); its caption says where each
    method stops paying as the load grows (crossover.json). Without ``wide`` the columns of
    SERVING_BRIEF, less those empty in every row and the load's with one value. None for a run
    without a serving engine."""
    if all(row["engine"] in OWN_ENGINES for row in rows):
        return None
    cells = {name: [schema.fmt(name, row.get(name)) for row in rows] for name, _ in SERVING}
    shown = [
        (name, header)
        for name, header in SERVING
        if wide
        or name == "method"
        or (
            name in SERVING_BRIEF
            and any(cell != "-" for cell in cells[name])
            and (name not in LOAD or len(set(cells[name])) > 1)
        )
    ]
    lines = crossover_lines(load_crossovers(rows)) + ([] if wide else ["more columns: --wide, or summary.csv"])
    table = Table(
        title="engines and requests in flight",
        caption="\n".join(lines),
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
        show_edge=False,
    )
    for name, header in shown:
        table.add_column(header, justify="left" if name in NAMES else "right", no_wrap=not wide)
    for i in range(len(rows)):
        table.add_row(*(cells[name][i] for name, _ in shown))
    return table


def best_k_line(method: str, picks: dict) -> str:
    """The run's line for one method's best_ks picks: each pick's K and speedup, and where none is
    above 1, that no K beats the baseline (the best K of a method that never pays is not a choice)."""
    line = f"best K for {method}: " + ", ".join(
        f"{label} K={p['k']} ({p['speedup']:.2f}x)" for label, p in picks.items()
    )
    return line + ("; at no K does it beat the baseline" if all(p["speedup"] < 1 for p in picks.values()) else "")


def greedy_lines(rows: list[dict]) -> list[str]:
    """What a greedy run's summary rows say of exactness, a line each: the decoders whose outputs part
    from their baseline's where no near-tie explains it (a losslessness bug), those whose divergences
    have no label, and the near-ties (the target's two likeliest tokens within what rounding flips)."""
    if any(
        row.get("synthetic_acceptance") not in (None, "") and not missing(row["synthetic_acceptance"]) for row in rows
    ):
        return [
            "greedy outputs: not compared (--synthetic-acceptance kept drafts unverified, so they are not the target's)"
        ]
    structural, unlabelled, ties = [], [], []
    for row in rows:
        parted = row["num_prompts"] - row["outputs_match"]
        if not parted > 0:  # equal outputs, or none compared (NaN)
            continue
        label = decoder_label(row)
        if missing(row["structural"]):
            unlabelled.append(f"{label} ({int(parted)})")
            continue
        if row["structural"]:
            structural.append(f"{label} ({int(row['structural'])} of {int(row['num_prompts'])})")
        if near := int(parted - row["structural"]):
            ties.append((label, near))
    lines = []
    if structural:
        lines.append(
            f"greedy outputs with structural divergences from the baseline (not lossless): {', '.join(structural)}"
        )
    if unlabelled:
        lines.append(
            f"greedy outputs differing from the baseline with no label (no margin was taken): {', '.join(unlabelled)}"
        )
    if not structural and not unlabelled:
        lines.append(
            "greedy outputs: no structural divergence from the baseline"
            if ties
            else "greedy outputs: every method equals the baseline"
        )
    if ties:
        lines.append(
            f"near-ties, not failures: {sum(n for _, n in ties)} greedy outputs parted from the baseline where the "
            "target's two likeliest tokens were within what rounding flips (a K+1-token forward rounds differently "
            f"from a one-token one): {', '.join(f'{label} ({n})' for label, n in ties)}"
        )
    return lines


def k_cell(row: dict) -> str:
    """K as a table shows it, with the policy that chose it round by round when that is not fixed."""
    policy = row.get("k_policy")
    shown = schema.fmt("k", row["k"])
    return f"{shown} {policy}" if policy and policy != schema.BY_NAME["k_policy"].plain else shown


def phase_table(rows: list[dict]) -> Table | None:
    """Where each method's time went: milliseconds per generated token, phase by phase (inner only
    when a method has a level beneath its draft model, retokenize when its draft has a vocabulary of its own).
    None when no row is specbench's loop's."""
    rows = [row for row in rows if row["engine"] in OWN_ENGINES]  # a serving engine's time is not split into phases
    if not rows:
        return None
    rare = ("inner_s", "retokenize_s")
    phases = [name for name in schema.PHASES if name not in rare or any(row.get(name) for row in rows)]
    names = (f"{name.removesuffix('_s')} ms" for name in phases)
    table = Table("method", "K", "tree", *names, "total ms", "other %")
    table.title = "time per generated token"
    for column in table.columns:
        column.justify = "right"
    for row in rows:
        per_token = [1000 * row[name] / row["new_tokens"] for name in phases]
        cells = [f"{ms:.2f}" for ms in per_token]
        other = row["other_s"] / (row["method_s"] - row["prefill_s"])  # of the decode proper
        key = (row["method"], k_cell(row), schema.fmt("tree", row.get("tree")))
        table.add_row(*key, *cells, f"{sum(per_token):.2f}", f"{other:.1%}")
    return table


def thinking_table(rows: list[dict]) -> Table | None:
    """Thinking apart from answering (core/thinking.py): per decoder and span, its tokens, acceptance,
    tau, tokens/s and speedup over the baseline's. None when no answer had a thinking span."""
    split = [row for row in rows if not missing(row.get("thinking_tokens"))]  # older runs lack the columns
    if not any(row["thinking_tokens"] for row in split):
        return None
    figures = ("tokens", "acceptance", "tau", "tokens_per_s", "speedup")
    table = Table(
        "method",
        "span",
        "tokens",
        "accepted",
        "tau",
        "tok/s",
        "speedup",
        title="thinking apart from answering (--thinking-markers)",
        caption="thinking: from an open marker through its close marker; answer: the rest. accepted: drafts accepted / "
        "drafted; tau: tokens per target forward, a forward counted in the span of its first token; speedup: tok/s "
        "over the baseline's in the same span",
        box=box.SIMPLE_HEAD,
    )
    for column in table.columns[2:]:
        column.justify = "right"
    for row in split:
        for span in SPANS:
            cells = (schema.fmt(f"{span}_{name}", row[f"{span}_{name}"]) for name in figures)
            table.add_row(decoder_label(row) if span == SPANS[0] else "", span, *cells, end_section=span == SPANS[-1])
    return table


def levels_table(rows: list[dict]) -> Table | None:
    """For methods of several levels (cascade, triforce), a row per level, top down: its forwards,
    the tokens it proposed to the level above and how many that level accepted, the output tokens it
    chose, and its time per output token. None when no row has a level beneath its drafting model."""
    nested = [row for row in rows if not math.isnan(row["inner_drafted"])]  # NaN for one-level methods
    if not nested:
        return None
    table = Table(
        "method",
        "K",
        "options",
        "level",
        "forwards",
        "proposed",
        "accepted",
        "acceptance",
        "output tokens",
        "ms/token",
        title="levels: what each level ran, proposed, had accepted and chose, and its time",
        caption="accepted: by the level above (lookup-or-draft's and lookup-or-eagle's lookup: by the target); output tokens: the tokens "
        "of the output the level chose (the target adds one of its own per forward); ms/token: the level's time over every output token. With --cascade-split, "
        "lookup's tokens after the split go to the target unchecked: output tokens count them, proposed does not",
    )
    for column in table.columns:
        column.justify = "right"
    for row in nested:
        method, tokens = METHODS[row["method"]], row["new_tokens"]
        levels = [
            (
                "target",
                row["target_forwards"],
                None,
                None,
                tokens - row["accepted"],
                row["prefill_s"] + row["verify_s"],
            ),
            (
                method.draft_level,
                row["draft_forwards"],
                row["drafted"] - (row["inner_drafted"] if method.inner_beside else 0),  # its own rounds' tokens
                row["accepted"] - (row["from_inner"] if method.inner_beside else 0),
                row["accepted"] - row["from_inner"],
                row["draft_s"],
            ),
            (
                method.inner_level,
                row["inner_forwards"],
                row["inner_drafted"],
                row["inner_accepted"],
                row["from_inner"],
                row["inner_s"],
            ),
        ]
        for depth, (level, forwards, proposed, accepted, chosen, seconds) in enumerate(levels):
            table.add_row(
                row["method"] if depth == 0 else "",
                k_cell(row) if depth == 0 else "",
                (row.get("options") or "-") if depth == 0 else "",
                level,
                f"{forwards:.0f}",
                "-" if proposed is None else f"{proposed:.0f}",
                "-" if accepted is None else f"{accepted:.0f}",
                f"{accepted / proposed:.3f}" if proposed else "-",
                f"{chosen:.0f}",
                f"{1000 * seconds / tokens:.2f}",
            )
    return table


def context_table(rows: list[dict], wins: dict[str, dict]) -> Table:
    """context.csv on screen: per context length, the target's step and each method's c, acceptance
    at each level and speedups; the crossovers in the caption."""
    table = Table(
        "context",
        "method",
        "target step ms",
        "c",
        "alpha",
        "acceptance",
        "lower acc.",
        "speedup",
        "decode x",
        "vs spec.",
        title="by context length (decode x: speedup with both prefills left out)",
    )
    for column in table.columns:
        column.justify = "right"

    def cell(value, spec=".3f"):
        return "-" if missing(value) else format(value, spec)

    for row in rows:
        table.add_row(
            str(row["context_tokens"]),
            row_label(row),
            cell(row["target_step_ms"], ".1f"),
            cell(row["c"]),
            cell(row["alpha"]),
            cell(row["acceptance_rate"]),
            cell(row["inner_acceptance"]),
            cell(row["speedup"]),
            cell(row["decode_speedup"]),
            cell(row["vs_speculative"]),
        )

    def since(length):
        return "never" if length is None else f"from {length} tokens"

    if not all(found.get("judged", True) for found in wins.values()):
        table.caption = "wins: not judged (a prompt per length gives no interval; --num-prompts 2 or more)"
        return table
    lines = [
        "wins (decode speedup above the rival's, by the low end of its 95% interval over the prompts, at that "
        "length and every longer one measured):"
    ]
    for label, found in wins.items():
        text = f"{label}: over the baseline {since(found['beats_baseline_from'])}"
        if label.split()[0] != CONTENDERS[1]:
            text += f", over speculative {since(found['beats_speculative_from'])}"
        lines.append(text)
    table.caption = "\n".join(lines)
    return table


def predicted_table(rows: list[dict]) -> Table:
    """predicted.csv on screen: a row per assumed alpha, a column per K, the speedup with the measured
    verification cost (the classic formula's, which counts it as one step, in brackets); the best K
    of each alpha in bold."""
    ks = sorted({row["k"] for row in rows})
    table = Table("alpha", *(f"K={k}" for k in ks), title="predicted speedup at an assumed alpha")
    table.caption = (
        f"c = {rows[0]['c']:.3f}, verify_ratio = "
        + " ".join(f"{r['verify_ratio']:.2f}" for r in rows if r["alpha"] == rows[0]["alpha"])
        + " (K=1..) measured; in brackets the classic formula, which counts a verification as one step"
    )
    for column in table.columns:
        column.justify = "right"
    for alpha in dict.fromkeys(row["alpha"] for row in rows):
        by_k = {row["k"]: row for row in rows if row["alpha"] == alpha}
        best = max(by_k, key=lambda k: by_k[k]["predicted_speedup_verify"])
        cells = [
            f"{'[bold]' if k == best else ''}{by_k[k]['predicted_speedup_verify']:.2f}{'[/]' if k == best else ''}"
            f" \\[{by_k[k]['predicted_speedup']:.2f}]"
            for k in ks
        ]
        table.add_row(f"{alpha:g}", *cells)
    return table


def category_table(rows: list[dict]) -> Table:
    """categories.csv on screen: a row per decoder (the baselines left out), a column per category,
    each cell the speedup over the baseline on that category's prompts and tau."""
    group_by = rows[0]["group_by"]
    categories = list(dict.fromkeys(str(row["category"]) for row in rows))
    table = Table(
        "method",
        *categories,
        title=f"by {group_by.replace('_', ' ')}: speedup over the baseline, and tau",
        caption="tau: tokens per target forward; categories.csv has every column (alpha, acceptance, c, ...) and "
        "categories.png draws this table",
    )
    for column in table.columns[1:]:
        column.justify = "right"
    cells: dict[str, dict[str, str]] = {}
    for row in rows:
        if row["method"] not in (BASELINE.name, SERVED_BASELINE.name):
            cells.setdefault(decoder_label(row), {})[str(row["category"])] = (
                f"{row['speedup']:.2f}x {schema.fmt('tau', row['tau'])}"
            )
    for label, by_category in cells.items():
        table.add_row(label, *(by_category.get(category, "-") for category in categories))
    return table


def audit_table(rows: list[dict], title: str) -> Table:
    """`specbench audit`'s verdicts: a row per subject (and control) and setting, then the probes."""

    def number(value, digits: int = 3) -> str:
        return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}g}"

    table = Table(
        title=title,
        caption="TV: the bias-corrected distance [95% interval] (the plug-in; what two samples of one law show)",
    )
    for header in ("subject", "setting", "verdict", "p (Holm)", "TV", "detectable TV", "N", "s", "evidence"):
        table.add_column(header, justify="left" if header in ("subject", "setting", "evidence") else "right")
    for row in rows:
        verdict = row["verdict"]
        style = "bold red" if verdict == "FAIL" else "green" if verdict == "pass" else "yellow"
        setting = row["setting"] if row["test"] in ("greedy", "sampling", "control") else f"probe: {row['test']}"
        tv = (
            f"{row['tv_corrected']:.3f} [{row['tv_low']:.3f}, {row['tv_high']:.3f}] "
            f"({row['tv']:.3f}; {row['tv_noise']:.3f})"
            if "tv" in row
            else ""
        )
        size = f"{row['samples']} x {row['prompts']}" if "samples" in row else str(row.get("prompts", ""))
        evidence = "; ".join(part for part in (row.get("equal", ""), row["evidence"]) if part)
        table.add_row(
            row["subject"] + (f" [{row['broken']}]" if row.get("broken") else ""),
            setting,
            f"[{style}]{verdict}[/]",
            number(row.get("p"), 2),
            tv,
            number(row.get("detectable_tv")),
            size,
            "" if "seconds" not in row else f"{row['seconds']:.0f}",
            evidence,
        )
    return table
