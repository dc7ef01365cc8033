"""The rows of a serving engine (vLLM): a record per request, a summary row per method, K and
concurrency, and the one-token decode costs that give its c.

Pure functions over what the engine returned (vllm_engine.Served) and the records already written,
so a resumed run summarises exactly as a fresh one. A request's acceptance comes from vLLM's own
per-request histogram of accepted drafts per verify step; specbench's alpha needs both models'
distributions, which vLLM does not expose, so these rows carry alpha_estimate instead.
"""

from __future__ import annotations

import math

from . import metrics, schema
from .method import Decoder
from .methods import BASELINE, SERVED_BASELINE
from .prompts import Turn
from .results import OWN_ENGINES, prompt_columns
from .vllm_engine import Served

ENGINE = "vllm"


def counts(histogram: list[int] | None, drafted: int, tokens: int, rejected: int | None = None) -> dict:
    """What vLLM's per-request counters say, in specbench's columns. ``histogram[n]`` counts verify
    steps that accepted n drafts, ``rejected`` the steps that rejected a drafted token (when vLLM
    did not report it: the steps that accepted fewer than K). Every target forward yields one token
    that was not an accepted draft (the prefill's first token, a bonus or a correction), so the
    forwards are the tokens less the accepted drafts. ``tested`` counts the draft positions
    verification decided on: the accepted ones and the first rejected one of each step."""
    if histogram is None:
        return {
            "drafted": math.nan,
            "accepted": math.nan,
            "tested": math.nan,
            "target_forwards": tokens,
            "accept_hist": "",
        }
    accepted = sum(n * count for n, count in enumerate(histogram))
    return {
        "drafted": drafted,
        "accepted": accepted,
        "tested": accepted + (sum(histogram[:-1]) if rejected is None else rejected),
        "target_forwards": tokens - accepted,
        "accept_hist": " ".join(map(str, histogram)),
    }


def record(
    turn: Turn, index: int, ids: list[int], decoder: Decoder, concurrency: int, served: Served, base: Served
) -> dict:
    """The records.csv row of one request, against vLLM's baseline on the same prompt and concurrency."""
    tokens, seconds = len(served.tokens), served.end - served.start
    base_tokens, base_s = len(base.tokens), base.end - base.start
    found = counts(served.histogram, served.drafted, tokens, served.rejected)
    divergence = metrics.first_divergence(base.tokens, served.tokens)
    row = dict.fromkeys(schema.RECORDS, math.nan)
    row.update(
        {
            **found,
            "engine": ENGINE,
            "concurrency": concurrency,
            "method": decoder.method.name,
            "k": decoder.k,
            "tree": "",
            "k_policy": decoder.policy,
            **prompt_columns(turn, index, len(ids)),
            "new_tokens": tokens,
            "baseline_tokens": base_tokens,
            "baseline_s": base_s,
            "method_s": seconds,
            "baseline_tokens_per_s": base_tokens / base_s,
            "spec_tokens_per_s": tokens / seconds,
            "speedup": (tokens / seconds) / (base_tokens / base_s),
            "alpha_estimate": found["accepted"] / found["tested"] if found["tested"] else math.nan,
            "acceptance_rate": found["accepted"] / served.drafted if served.drafted else math.nan,
            "tau": tokens / found["target_forwards"] if served.histogram else math.nan,
            "ttft_ms": 1000 * (served.first - served.start),
            "tpot_ms": served.tpot_ms,
            "start_s": served.start,
            "end_s": served.end,
            "outputs_match": divergence is None,
            "first_divergence": -1 if divergence is None else divergence,
            "rank_hist": "",
            "draft_hist": "",  # vLLM reports no round's draft length
        }
    )
    return row


def block(records: list[dict], method: str, concurrency: int) -> list[dict]:
    """vLLM's rows of one method at one concurrency."""
    return [r for r in records if r["engine"] == ENGINE and r["method"] == method and r["concurrency"] == concurrency]


def decode_cost(tpots_ms: list[float], model: str) -> dict:
    """engine_costs.csv: a model's one-token decode time alone in vLLM, one request at a time."""
    tpots = [t for t in tpots_ms if not math.isnan(t)]
    return {
        "engine": ENGINE,
        "model": model,
        "tpot_ms": metrics.percentile(tpots, 50),
        "tpot_iqr_ms": metrics.percentile(tpots, 75) - metrics.percentile(tpots, 25),
        "requests": len(tpots),
    }


def c_of(costs: list[dict]) -> float:
    """The draft's one-token decode time over the target's, both alone in vLLM (NaN until both ran)."""
    tpot = {row["model"]: float(row["tpot_ms"]) for row in costs if row["engine"] == ENGINE}
    return tpot["draft"] / tpot["target"] if {"draft", "target"} <= set(tpot) else math.nan


def summarize(records: list[dict], costs: list[dict], cfg, run_info: dict) -> list[dict]:
    """One summary row per vLLM method, K and concurrency, its baseline's first at each concurrency.

    speedup is the per-request rate over the baseline's on the same prompts (as for specbench's loop,
    so compare's intervals apply); throughput counts every request over the block's wall time."""
    own_base = {r["prompt_index"]: r for r in records if r["engine"] in OWN_ENGINES and r["method"] == BASELINE.name}
    c_draft = c_of(costs)
    rows = []
    for concurrency in cfg.concurrency:
        base_rows = block(records, SERVED_BASELINE.name, concurrency)
        for decoder in [Decoder(SERVED_BASELINE), *cfg.served_plan]:
            method, k = decoder.method, decoder.k
            rs = [r for r in block(records, method.name, concurrency) if r["k"] == k]
            if not rs:
                continue
            tokens, seconds = sum(r["new_tokens"] for r in rs), sum(r["method_s"] for r in rs)
            base_tokens, base_s = sum(r["baseline_tokens"] for r in rs), sum(r["baseline_s"] for r in rs)
            throughput = tokens / _span(rs)
            drafts = any(r["accept_hist"] for r in rs)  # vLLM reported acceptance: it speculated
            tested = sum(r["tested"] for r in rs)
            c = c_draft if method.needs_draft else method.c(None)
            drafted = sum(r["drafted"] for r in rs)
            accepted = sum(r["accepted"] for r in rs)
            alpha = accepted / tested if drafts and tested else math.nan
            divergences = [r["first_divergence"] for r in rs if r["first_divergence"] >= 0]
            same = [own_base[r["prompt_index"]] for r in rs if r["prompt_index"] in own_base]
            values = dict.fromkeys(schema.SUMMARY, math.nan)
            values.update(
                {
                    **run_info,
                    **metrics.latency_figures(rs),
                    "engine": ENGINE,
                    "compile": ENGINE,
                    "concurrency": concurrency,
                    "method": method.name,
                    "k": k,
                    "tree": "",
                    "k_policy": decoder.policy,
                    "options": _options(decoder, cfg),
                    **{name: getattr(cfg, name) for name in ("temperature", "top_k", "top_p", "eta", "seed")},
                    "max_new_tokens": cfg.max_new_tokens,
                    "num_prompts": len(rs),
                    "new_tokens": tokens,
                    "method_s": seconds,
                    "baseline_tokens_per_s": base_tokens / base_s,
                    "spec_tokens_per_s": tokens / seconds,
                    "speedup": (tokens / seconds) / (base_tokens / base_s),
                    "throughput": throughput,
                    "throughput_speedup": throughput / (sum(r["new_tokens"] for r in base_rows) / _span(base_rows)),
                    "vs_specbench": (tokens / seconds)
                    / (sum(r["new_tokens"] for r in same) / sum(r["method_s"] for r in same))
                    if len(same) == len(rs)
                    else math.nan,
                    "alpha_estimate": alpha,
                    "acceptance_rate": accepted / drafted if drafted else math.nan,
                    "tau": tokens / sum(r["target_forwards"] for r in rs) if drafts else math.nan,
                    "target_forwards": sum(r["target_forwards"] for r in rs),
                    "drafted": drafted,
                    "accepted": accepted,
                    "tested": tested if drafts else math.nan,
                    "c": c,
                    # The classic formula with the estimated alpha (vLLM exposes no other).
                    "predicted_speedup": metrics.predicted_speedup(alpha, c, k) if k else math.nan,
                    "outputs_match": sum(r["outputs_match"] for r in rs),
                    "first_divergence": min(divergences, default=-1),
                }
            )
            if cfg.random_weights:
                values.update(
                    {name: math.nan for name in ("alpha_estimate", "acceptance_rate", "tau", "predicted_speedup")}
                )
            rows.append({name: values[name] for name in schema.SUMMARY})
    return rows


def _span(rs: list[dict]) -> float:
    """Wall seconds from the first request's submission to the last one's last token."""
    return max(r["end_s"] for r in rs) - min(r["start_s"] for r in rs)


def _options(decoder: Decoder, cfg) -> str:
    """The engine settings a vLLM row depends on beyond its method and K."""
    parallel = f"tp={cfg.tensor_parallel_size},pp={cfg.pipeline_parallel_size}"
    extra = ",".join(f"{key}={value}" for key, value in sorted(cfg.engine_args.items()))
    return ",".join(part for part in (parallel, extra) if part)
