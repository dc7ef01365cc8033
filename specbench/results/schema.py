"""The results schema: every column of every file specbench writes, and the phases of a decode.

summary.csv and records.csv are declared column by column in results/columns.py (kind, direction, format,
meaning); the lists every module uses are derived from them here. The other files' columns are
listed in FILES; the writer refuses a row with a column the schema lacks, and a test runs the
pipeline and holds every file it wrote to these lists.
"""

from __future__ import annotations

from specbench.results.columns import COLUMNS, CONFIG, DETERMINISTIC, HIGHER, INPUT_LENGTH, LOWER, TIMING, Column

__all__ = ["COLUMNS", "CONFIG", "DETERMINISTIC", "HIGHER", "INPUT_LENGTH", "LOWER", "TIMING", "Column"]

BY_NAME = {column.name: column for column in COLUMNS}
SUMMARY = [c.name for c in COLUMNS if c.files != "records"]
RECORDS = [c.name for c in COLUMNS if c.files != "summary"]
KEYS = [name for name in SUMMARY if BY_NAME[name].kind == CONFIG]
TABLE = [c for c in COLUMNS if c.header]
GATED = [c.name for c in COLUMNS if c.gated]
ABSOLUTE = [c.name for c in COLUMNS if c.absolute]
PORTABLE = [c.name for c in COLUMNS if c.portable]
# The summary's value of each rate is metrics.rate_of_sums of these records.csv columns over its
# prompts, so the prompts give it (and its change between runs) a bootstrap interval.
RATES = {
    "spec_tokens_per_s": ["new_tokens", "method_s"],
    "baseline_tokens_per_s": ["baseline_tokens", "baseline_s"],
    "speedup": ["new_tokens", "method_s", "baseline_tokens", "baseline_s"],
}
OWN_ENGINES = ("torch", "hf")  # the engines of specbench's process: its loop, and transformers' generate
# Where a decode's time went; they add up to its wall time (timing.Phases has one field for each).
PHASES = ("prefill_s", "draft_s", "inner_s", "retokenize_s", "verify_s", "other_s")

# The columns of the other files a run writes (outputs.jsonl: the keys of each line).
VERIFY_COST = ("model", "tokens", "context_tokens", "seconds", "iqr_s", "ratio", "ratio_iqr", "repeats")
BLOCK = ("engine", "concurrency", "request_rate", "method", "k", "tree", "k_policy")  # what a summary row is one of
ACCEPTANCE = (*BLOCK, "by", "position", "acceptance", "verify_steps")
PREDICTED = ("alpha", "k", "c", "verify_ratio", "predicted_speedup", "predicted_speedup_verify")
ONLINE = (
    "method",
    "k",
    "k_policy",
    "prompt_index",
    "prompt_id",
    "alpha",
    "acceptance_rate",
    "lessons",
    "updates",
    "train_s",
)
OUTPUTS = ("prompt_id", "prompt_index", "turn", *BLOCK, "token_ids", "text")
# specbench's loop: how many verification rounds drafted each number of tokens, per method, K, tree and policy.
DRAFT_LENGTHS = ("method", "k", "tree", "k_policy", "drafted", "rounds")
# vLLM's one-token decode time per model, each alone in the engine at one request: its c.
ENGINE_COSTS = ("engine", "model", "tpot_ms", "tpot_iqr_ms", "requests")
# Served engines: each block's difference of the engine's own speculative-decoding counters.
COUNTERS = (
    "engine",
    "concurrency",
    "request_rate",
    "method",
    "k",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_accepted_tokens_per_pos",
)
CONTEXT = (
    "context_tokens",
    "method",
    "k",
    "k_policy",
    "options",
    "num_prompts",
    "target_step_ms",
    "c",
    "c_run",
    "alpha",
    "acceptance_rate",
    "inner_acceptance",
    "tau",
    "speedup",
    "decode_speedup",
    "decode_speedup_low",  # the lower end of its 95% interval over the prompts (NaN under 2 prompts)
    "outputs_match",
    "structural",
    "vs_speculative",
    "vs_speculative_low",
)
# categories.csv: summary.csv's columns over the prompts of one category (or sub-category or input
# length: group_by says which), whose value is in ``category``.
GROUP_KEYS = ("group_by", "category")
CATEGORIES = (*GROUP_KEYS, *SUMMARY)
FILES = {
    "summary.csv": tuple(SUMMARY),
    "categories.csv": CATEGORIES,
    "records.csv": tuple(RECORDS),
    "verify_cost.csv": VERIFY_COST,
    "acceptance.csv": ACCEPTANCE,
    "draft_lengths.csv": DRAFT_LENGTHS,
    "predicted.csv": PREDICTED,
    "online.csv": ONLINE,
    "outputs.jsonl": OUTPUTS,
    "context.csv": CONTEXT,
    "engine_costs.csv": ENGINE_COSTS,
    "counters.csv": COUNTERS,
}
RESULTS_FORMAT = 2  # results.json's "format": raised when its structure changes


def fmt(name: str, value) -> str:
    """A cell for tables: '-' for missing values, the column's format otherwise."""
    if value is None or value == "" or (isinstance(value, float) and value != value):
        return "-"
    spec = BY_NAME[name].fmt if name in BY_NAME else ""
    try:
        return format(int(value) if spec == "d" else value, spec)
    except (TypeError, ValueError):
        return str(value)
