"""The rows of the engines that serve requests (vLLM in this process, running servers): a record per
request, a summary row per method, K and load (concurrency, request rate), the one-token decode
costs that give c, and each block's counter differences.

Pure functions over what an engine returned (engines.Served) and the rows already written, so a
resumed run summarises exactly as a fresh one. A request's acceptance comes from its own response
where the engine gives it (vLLM's per-request histogram of accepted drafts per verify step,
llama.cpp's drafted and accepted counts, SGLang's verify count); else the summary takes the block's
counter difference (counters.csv); else its acceptance columns stay empty. specbench's alpha needs
both models' distributions, which no server exposes, so these rows carry alpha_estimate instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from specbench.core import metrics, thinking
from specbench.core.thinking import Markers
from specbench.engines import Served
from specbench.methods.base import Decoder
from specbench.methods.registry import BASELINE
from specbench.methods.served import HTTP_ENGINES
from specbench.results import schema
from specbench.results.summary import RunColumns, prompt_columns, structural
from specbench.workloads.prompts import Turn

# Log-probability gap (nats) between the baseline's two likeliest tokens under which a greedy divergence
# counts as a near-tie: batching, kernels and precision can flip such a pair without any bug.
NEAR_TIE = 0.05
# Below float32 a logit keeps few bits (bfloat16: 8, so steps of 0.125 from 16 to 32), and a K+1-token
# forward rounds differently from a one-token one: on SmolLM2 in bfloat16 (CPU, 450 positions) the
# top-two gap moved by up to 4 steps between the two. A gap within twice that is a near-tie too.
TIE_STEPS = 8
NOTHING = {"drafted": math.nan, "accepted": math.nan, "tested": math.nan, "accept_hist": ""}


def counts(served: Served) -> dict:
    """What the engine said of one request's speculation, in specbench's columns.

    ``histogram[n]`` counts verify steps that accepted n drafts, ``rejected`` the steps that rejected
    a drafted token (when not reported: the steps that accepted fewer than K). Every target forward
    yields one token that was not an accepted draft (the prefill's first token, a bonus or a
    correction), so the forwards are at least the tokens less the accepted drafts: exactly that
    unless the last step was cut at the token limit (vLLM counts the drafts it accepted past the
    cut). They are also at least the verify steps plus the prefill: exactly that when every step
    drafted (n-grams draft only where they find a match). The larger bound is the count. ``tested``
    counts the draft positions verification decided on: the accepted ones and the first rejected
    one of each step."""
    tokens = served.count
    if served.histogram is not None:
        accepted = sum(n * count for n, count in enumerate(served.histogram))
        steps = sum(served.histogram[:-1]) if served.rejected is None else served.rejected
        return {
            "drafted": served.drafted,
            "accepted": accepted,
            "tested": accepted + steps,
            "target_forwards": max(tokens - accepted, sum(served.histogram) + 1),
            "accept_hist": " ".join(map(str, served.histogram)),
        }
    if served.accepted is not None:  # counts without a histogram: no tested positions
        drafted = served.drafted or math.nan
        return {**NOTHING, "drafted": drafted, "accepted": served.accepted, "target_forwards": tokens - served.accepted}
    return {**NOTHING, "target_forwards": tokens}


def record(
    turn: Turn,
    index: int,
    ids: list[int],
    decoder: Decoder,
    load: tuple[int, float],
    served: Served,
    base: Served | None,
    encode: Callable[[str], list[int]] | None = None,
    markers: Markers | None = None,
) -> dict:
    """The records.csv row of one request, against its engine's baseline on the same prompt and load
    (``base`` None: the baseline's request failed, so nothing compares with it). Outputs compare by
    the engines' ids; where either side gave text only, by both texts encoded alike (``encode``).
    ``markers`` split its thinking from its answer (None: not split)."""
    concurrency, rate = load
    row = dict.fromkeys(schema.RECORDS, math.nan)
    row.update(
        {
            "engine": decoder.method.engine,
            "concurrency": concurrency,
            "request_rate": rate,
            "method": decoder.method.name,
            "k": served.k or decoder.k,
            "tree": "",
            "k_policy": decoder.policy,
            **prompt_columns(turn, index, len(ids)),
            "error": served.error,
            "divergence": "",
            "acceptance_source": "response" if served.reports_acceptance else "",
            "accept_hist": "",
            "itl_ms": "",
            "rank_hist": "",
            "draft_hist": "",  # no engine reports a round's draft length
            "start_s": served.start,
            "end_s": served.end,
        }
    )
    if served.error:
        return row
    found = counts(served)
    tokens, seconds = served.count, served.end - served.start
    row.update(
        {
            **found,
            "new_tokens": tokens,
            "method_s": seconds,
            "spec_tokens_per_s": tokens / seconds,
            "alpha_estimate": found["accepted"] / found["tested"] if found["tested"] else math.nan,
            "acceptance_rate": found["accepted"] / found["drafted"] if found["drafted"] else math.nan,
            "tau": tokens / found["target_forwards"]
            if served.reports_acceptance and found["target_forwards"]
            else math.nan,
            "ttft_ms": 1000 * (served.first - served.start),
            "tpot_ms": served.tpot_ms,
            "itl_ms": " ".join(f"{1000 * gap:.3f}" for gap in served.itl),
            "e2e_ms": 1000 * seconds,
        }
    )
    usable = base is not None and not base.error
    mine = answer(served, decoder.method.takes_k)
    row.update(thinking.record_columns(markers, ids, mine, answer(base, False) if usable else None))
    if base is not None and not base.error:
        base_tokens, base_s = base.count, base.end - base.start
        ours, theirs = served.tokens, base.tokens
        if (served.encoded or base.encoded) and encode is not None:
            ours, theirs = encode(served.text), encode(base.text)
        divergence = metrics.first_divergence(theirs, ours)
        row.update(
            {
                "baseline_tokens": base_tokens,
                "baseline_s": base_s,
                "baseline_tokens_per_s": base_tokens / base_s,
                "speedup": (tokens / seconds) / (base_tokens / base_s),
                "outputs_match": divergence is None,
                "first_divergence": -1 if divergence is None else divergence,
            }
        )
    return row


def answer(served: Served, speculates: bool) -> thinking.Emitted:
    """What an engine said of one answer for the thinking split: one token a forward where nothing
    speculates, else the verify steps it reported after the prefill's token; when each token came
    where its chunks carried ids (not the client's encoding of text)."""
    if not speculates:
        steps = [(0, 0)] * len(served.tokens)
    else:
        steps = None if served.steps is None else [(0, 0), *served.steps]
    times = [t - served.start for t in served.arrivals] if served.arrivals and not served.encoded else None
    return thinking.Emitted(served.tokens, steps, times)


def divergence_kind(margin: float | None, bound: float = NEAR_TIE) -> str:
    """A greedy divergence's label from the baseline's top-two margin there ('' when unknown): a
    near-tie within ``bound`` nats (near_tie_bound), structural beyond."""
    if margin is None:
        return ""
    return "near-tie" if margin <= bound else "structural"


def near_tie_bound(spacing: float) -> float:
    """The largest top-two margin (nats) of a near-tie where the logits' dtype rounds in steps of
    ``spacing``: NEAR_TIE, or TIE_STEPS steps where that is more (bfloat16 above a logit of 1)."""
    return max(NEAR_TIE, TIE_STEPS * spacing)


def block(records: list[dict], engine: str, method: str, load: tuple[int, float]) -> list[dict]:
    """An engine's rows of one method at one load (concurrency, request rate)."""
    concurrency, rate = load
    return [
        r
        for r in records
        if r["engine"] == engine and r["method"] == method and r["concurrency"] == concurrency
        and float(r["request_rate"]) == rate
    ]  # fmt: skip


def kept_baseline(
    records: list[dict], outputs: list[dict], baseline: Decoder, load: tuple[int, float]
) -> dict[int, Served]:
    """The baseline's requests at ``load`` that a resumed run kept, rebuilt from their rows and their
    outputs.jsonl lines (``outputs``), by prompt index; empty for a fresh run."""
    engine, name = baseline.method.engine, baseline.method.name
    rows = [r for r in block(records, engine, name, load) if not r["error"]]
    tokens = {
        o["prompt_index"]: o["token_ids"]
        for o in outputs
        if o.get("engine") == engine and o["concurrency"] == load[0]
        and float(o.get("request_rate", math.inf)) == load[1] and o["method"] == name
    }  # fmt: skip
    return {
        r["prompt_index"]: Served(
            r["prompt_index"],
            tokens[r["prompt_index"]],
            r["start_s"],
            r["start_s"] + r["ttft_ms"] / 1000,
            r["end_s"],
            None,
            reported=int(r["new_tokens"]),
        )
        for r in rows
    }


def decode_cost(tpots_ms: list[float], engine: str, model: str) -> dict:
    """engine_costs.csv: a model's one-token decode time alone in an engine, one request at a time."""
    tpots = [t for t in tpots_ms if not math.isnan(t)]
    return {
        "engine": engine,
        "model": model,
        "tpot_ms": metrics.percentile(tpots, 50),
        "tpot_iqr_ms": metrics.percentile(tpots, 75) - metrics.percentile(tpots, 25),
        "requests": len(tpots),
    }


def c_of(costs: list[dict], engine: str) -> float:
    """The draft's one-token decode time over the target's, both alone in the engine (NaN until both ran)."""
    tpot = {row["model"]: float(row["tpot_ms"]) for row in costs if row["engine"] == engine}
    return tpot["draft"] / tpot["target"] if {"draft", "target"} <= set(tpot) else math.nan


def counter_row(
    engine: str, method: str, k: int | None, load: tuple[int, float], before: dict, after: dict
) -> dict | None:
    """counters.csv: what the engine's own counters grew by over one block; None when it has none."""
    if not after:
        return None
    grew = {
        name: after.get(name, 0.0) - before.get(name, 0.0) for name in after if name != "num_accepted_tokens_per_pos"
    }
    per_pos = after.get("num_accepted_tokens_per_pos", [])
    old = before.get("num_accepted_tokens_per_pos", [])
    per_pos = [a - (old[i] if i < len(old) else 0.0) for i, a in enumerate(per_pos)]
    return {
        "engine": engine,
        "concurrency": load[0],
        "request_rate": load[1],
        "method": method,
        "k": k,
        **{name: grew.get(name, math.nan) for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
        "num_accepted_tokens_per_pos": " ".join(f"{n:g}" for n in per_pos),
    }


def acceptance(
    rs: list[dict], counters: list[dict], engine: str, method: str, k: int | None, load: tuple[int, float]
) -> dict:
    """A block's acceptance figures from the best source it has: the requests' own (every request
    reported), else the block's counter difference at its K, else none (empty, never a guess)."""
    done = [r for r in rs if not r["error"]]
    tokens = sum(r["new_tokens"] for r in done)
    # A request that ran no verify step (one token) reports nothing: it drafted and accepted nothing.
    if any(r["acceptance_source"] == "response" for r in done):
        drafted, accepted, tested = (sum(_or_zero(r[name]) for r in done) for name in ("drafted", "accepted", "tested"))
        return {
            "acceptance_source": "response",
            "drafted": drafted,
            "accepted": accepted,
            "tested": tested,
            "alpha_estimate": accepted / tested if tested else math.nan,
            "acceptance_rate": accepted / drafted if drafted else math.nan,
            "tau": tokens / sum(r["target_forwards"] for r in done),
            "target_forwards": sum(r["target_forwards"] for r in done),
        }
    grew = [
        c for c in counters
        if c["engine"] == engine and c["method"] == method and c["concurrency"] == load[0]
        and float(c["request_rate"]) == load[1] and (_missing(k) or _missing(c.get("k")) or c["k"] == k)
    ]  # fmt: skip
    if grew and grew[-1]["num_drafts"] and not math.isnan(grew[-1]["num_drafts"]):
        c = grew[-1]
        drafts, drafted, accepted = c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]
        return {
            "acceptance_source": "counters",
            "drafted": drafted,
            "accepted": accepted,
            "tested": accepted + drafts,  # each draft's first rejection, or its end (as vLLM counts alpha)
            "alpha_estimate": accepted / (accepted + drafts),
            "acceptance_rate": accepted / drafted if drafted else math.nan,
            "tau": (drafts + accepted) / drafts,  # tokens per verify step: the accepted and one more
            "target_forwards": math.nan,
        }
    return {"acceptance_source": "", **dict.fromkeys(
        ("drafted", "accepted", "tested", "alpha_estimate", "acceptance_rate", "tau", "target_forwards"), math.nan
    )}  # fmt: skip


def summarize(
    records: list[dict],
    costs: list[dict],
    counters: list[dict],
    decoders: list[Decoder],
    loads: list[tuple[int, float]],
    columns: RunColumns,
) -> list[dict]:
    """One summary row per served method, K and load, its engine's baseline (``decoders[0]``) first
    at each load.

    speedup is the per-request rate over the baseline's on the same prompts (as for specbench's loop,
    so compare's intervals apply); throughput counts every request over the block's wall time."""
    own_base = {
        r["prompt_index"]: r for r in records if r["engine"] in schema.OWN_ENGINES and r["method"] == BASELINE.name
    }
    rows = []
    for load in loads:
        seen = set()
        for decoder in decoders:
            method, engine = decoder.method, decoder.method.engine
            # A plan holds a decoder per K (an engine or server each), and the Ks are read from the
            # records below: a method's second decoder would repeat its first's rows.
            if (engine, method.name) in seen:
                continue
            seen.add((engine, method.name))
            rs = block(records, engine, method.name, load)
            base_rows = [r for r in block(records, engine, decoders[0].method.name, load) if not r["error"]]
            for k in sorted({r["k"] for r in rs if not _missing(r["k"])}) or [decoder.k]:
                rows.append(_row(rs, base_rows, own_base, decoder, k, load, costs, counters, columns))
    return [row for row in rows if row is not None]


def _row(rs, base_rows, own_base, decoder, k, load, costs, counters, columns: RunColumns) -> dict | None:
    method, engine = decoder.method, decoder.method.engine
    rs = [r for r in rs if _missing(k) or r["k"] == k]
    done = [r for r in rs if not r["error"]]
    if not rs:
        return None
    values = dict.fromkeys(schema.SUMMARY, math.nan)
    values.update(
        {
            **columns.run_info,
            **columns.sampling,
            "engine": engine,
            "compile": engine,
            "concurrency": load[0],
            "request_rate": load[1],
            "method": method.name,
            "k": k,
            "tree": "",
            "k_policy": decoder.policy,
            "options": columns.options(decoder),
            "num_prompts": len(done),
            "failed": len(rs) - len(done),
            "acceptance_source": "",
        }
    )
    if not done:
        return {name: values[name] for name in schema.SUMMARY}
    compared = [r for r in done if not _missing(r["baseline_s"])]
    tokens, seconds = sum(r["new_tokens"] for r in done), sum(r["method_s"] for r in done)
    base_tokens, base_s = sum(r["baseline_tokens"] for r in compared), sum(r["baseline_s"] for r in compared)
    same = [own_base[r["prompt_index"]] for r in done if r["prompt_index"] in own_base]
    found = acceptance(rs, counters, engine, method.name, k, load) if method.takes_k else {}
    if not method.takes_k:
        c = math.nan  # the baseline drafts nothing
    else:
        c = c_of(costs, engine) if method.needs_draft or engine == "server" else method.c(None)
    divergences = [r["first_divergence"] for r in compared if r["first_divergence"] >= 0]
    speedup = (
        (sum(r["new_tokens"] for r in compared) / sum(r["method_s"] for r in compared)) / (base_tokens / base_s)
        if compared
        else math.nan
    )
    throughput = tokens / _span(done)
    values.update(
        {
            **metrics.latency_figures(done),
            **found,
            "new_tokens": tokens,
            "method_s": seconds,
            "baseline_tokens_per_s": base_tokens / base_s if compared else math.nan,
            "spec_tokens_per_s": tokens / seconds,
            "speedup": speedup,
            "throughput": throughput,
            "throughput_speedup": throughput / (sum(r["new_tokens"] for r in base_rows) / _span(base_rows))
            if base_rows
            else math.nan,
            "vs_specbench": (tokens / seconds) / (sum(r["new_tokens"] for r in same) / sum(r["method_s"] for r in same))
            if same and len(same) == len(done)
            else math.nan,
            "c": c,
            # drafts kept at a --synthetic-acceptance rate: outputs that are not the target's, not compared
            "outputs_match": sum(bool(r["outputs_match"]) for r in compared) if columns.verified else math.nan,
            "structural": structural(compared)
            if engine in HTTP_ENGINES and columns.greedy and columns.verified
            else math.nan,
            "first_divergence": min(divergences, default=-1),
        }
    )
    base_of = {r["prompt_index"]: r for r in base_rows}
    values.update(
        thinking.summary_columns(done, [base_of[r["prompt_index"]] for r in done if r["prompt_index"] in base_of])
    )
    if method.takes_k and not _missing(k):
        alpha, tau = values["alpha_estimate"], values["tau"]
        # The classic formula with the estimated alpha (no server exposes the distributions).
        values["predicted_speedup"] = metrics.predicted_speedup(alpha, c, k) if not math.isnan(c) else math.nan
        values["c_implied"] = metrics.implied_c(tau, speedup, k) if not math.isnan(tau) else math.nan
    if columns.weights_decide_acceptance:
        weights = ("alpha_estimate", "acceptance_rate", "tau", "predicted_speedup", *thinking.WEIGHT_DEPENDENT)
        values.update(dict.fromkeys(weights, math.nan))
    return {name: values[name] for name in schema.SUMMARY}


def _or_zero(value) -> float:
    return 0.0 if _missing(value) else value


def _missing(value) -> bool:
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def _span(rs: list[dict]) -> float:
    """Wall seconds from the first request's submission to the last one's last token."""
    return max(r["end_s"] for r in rs) - min(r["start_s"] for r in rs)


def load_crossovers(summary: list[dict]) -> list[dict]:
    """Where speculation stops paying as the load grows (crossover.json): for each serving engine's
    method and K, along each load axis with more than one value (requests in flight at each request
    rate, request rate at each concurrency), the first load at which the speedup's interval over the
    prompts reaches 1.0 or below (its low end; the speedup itself where a row has no interval), None
    when it never does up to the highest load measured. ``summary`` is results.json's rows (with
    ``speedup_ci``). Each entry lists the points it was read from."""
    served = [r for r in summary if r["engine"] not in schema.OWN_ENGINES and r["method"] != BASELINE.name]
    found = []
    for axis, other in (("concurrency", "request_rate"), ("request_rate", "concurrency")):
        groups: dict[tuple, list[dict]] = {}
        for row in served:
            groups.setdefault((row["engine"], row["method"], row["k"], row[other]), []).append(row)
        for (engine, method, k, fixed), rows in groups.items():
            if len({row[axis] for row in rows}) < 2:
                continue
            points = [
                {"load": _json_load(row[axis]), "speedup": row["speedup"], "interval": row.get("speedup_ci")}
                for row in sorted(rows, key=lambda row: row[axis])
            ]
            low = [(p["interval"] or [p["speedup"]])[0] for p in points]  # None: no speedup (every request failed)
            first = next(
                (p["load"] for p, bound in zip(points, low, strict=True) if bound is not None and bound <= 1.0), None
            )
            found.append(
                {
                    "engine": engine,
                    "method": method,
                    "k": k,
                    "axis": axis,
                    other: _json_load(fixed),
                    "crossover": first,
                    "points": points,
                }
            )
    return found


def _json_load(value: float) -> float | str:
    """A load as JSON holds it: an infinite request rate (all at once) as "inf"."""
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def crossover_lines(found: list[dict]) -> list[str]:
    """One sentence per load_crossovers entry, for the run's caption."""
    lines = []
    for entry in found:
        unit = " in flight" if entry["axis"] == "concurrency" else " requests/s"
        who = f"{entry['engine']} {entry['method']}" + (f" K={entry['k']}" if entry["k"] is not None else "")
        if entry["axis"] == "request_rate":
            who += f" ({entry['concurrency']} in flight at most)"
        elif entry["request_rate"] != "inf":
            who += f" (at {entry['request_rate']} requests/s)"
        first, crossover, highest = entry["points"][0]["load"], entry["crossover"], entry["points"][-1]["load"]
        if crossover is None:
            lines.append(f"{who}: pays at every load up to {highest}{unit} (its speedup's interval stays above 1.0)")
        elif crossover == first:
            lines.append(f"{who}: does not pay even at {first}{unit} (its speedup's interval reaches 1.0)")
        else:
            lines.append(f"{who}: stops paying at {crossover}{unit} (its speedup's interval first reaches 1.0 there)")
    return lines
