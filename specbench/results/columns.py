"""summary.csv and records.csv, column by column: each column's kind, direction, format and meaning.

The rich tables and compare read these declarations; results/schema.py derives the lists every other module
uses from them. A new column is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

from specbench.core.metrics import LATENCIES, PERCENTILES

CONFIG = "configuration"  # identifies the experiment; compare matches rows on these
DETERMINISTIC = "deterministic"  # repeats exactly for a fixed seed, model and hardware
TIMING = "timing"  # wall-clock figures: noisy on shared machines

HIGHER, LOWER = "higher", "lower"


@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # CONFIG, DETERMINISTIC or TIMING
    better: str | None  # HIGHER, LOWER, or None when neither direction is better
    fmt: str  # format spec for tables, e.g. ".3f"
    meaning: str  # one line, shown in docs/methodology.md
    header: str = ""  # short label in the summary table; empty: not shown there
    # Judged by `specbench compare` when no --metric is given. Not absolute tokens/s: a runner busier
    # for a whole run slows every prompt alike, which the paired interval takes for a real change.
    gated: bool = False
    files: str = "both"  # "summary", "records" (per prompt) or "both"
    absolute: bool = False  # seconds or tokens/s: they measure the machine as much as the code
    # A timing that the machine's speed cancels out of (the run's speedup over what its own measured
    # forwards predict): compare judges it against a baseline from any machine.
    portable: bool = False
    plain: str = ""  # a value that says nothing: the summary table hides a column of nothing else


def _spans() -> tuple[Column, ...]:
    """The thinking split's columns (core/thinking.py), the same for each span: where an answer holds
    --thinking-markers, its thinking spans (markers included) apart from the rest, the answer."""
    columns: list[Column] = []
    for span, where in (("thinking", "the thinking spans"), ("answer", "the answer outside the thinking spans")):
        columns += [
            Column(f"{span}_tokens", DETERMINISTIC, None, "d", f"tokens in {where} (empty: no --thinking-markers)"),
            Column(
                f"{span}_forwards",
                DETERMINISTIC,
                None,
                "d",
                f"target forwards (prefill included) whose first token lies in {where}",
                files="records",
            ),
            Column(
                f"{span}_drafted", DETERMINISTIC, None, "d", "draft tokens those forwards verified", files="records"
            ),
            Column(
                f"{span}_accepted", DETERMINISTIC, None, "d", "draft tokens those forwards accepted", files="records"
            ),
            Column(
                f"{span}_s",
                TIMING,
                LOWER,
                ".4f",
                f"seconds spent on {where}: each token's time since the token before it (the first's since the start)",
                files="records",
                absolute=True,
            ),
            Column(f"{span}_acceptance", DETERMINISTIC, HIGHER, ".3f", f"accepted / drafted in {where}"),
            Column(
                f"{span}_tau",
                DETERMINISTIC,
                HIGHER,
                ".2f",
                f"tokens per target forward in {where}: 1 + accepted / forwards",
            ),
            Column(f"{span}_tokens_per_s", TIMING, HIGHER, ".1f", f"tokens / seconds in {where}", absolute=True),
            Column(
                f"{span}_speedup",
                TIMING,
                HIGHER,
                ".3f",
                f"tokens/s in {where} over the baseline's in its own, on the same prompts",
            ),
        ]
    return tuple(columns)


INPUT_LENGTH = (
    "the prompt's length class: the length SPEED-Bench built it to (throughput configs: 1k ... 32k), else "
    "prompt_tokens rounded up to a power of two (128, 256, 512, 1k, ...)"
)
COLUMNS: tuple[Column, ...] = (
    Column("target", CONFIG, None, "", "target model as given (alias, hub id, directory or .gguf)", files="summary"),
    Column("draft", CONFIG, None, "", "draft model as given", files="summary"),
    Column("dataset", CONFIG, None, "", "prompt source", files="summary"),
    Column("device", CONFIG, None, "", "torch device the run used", files="summary"),
    Column("dtype", CONFIG, None, "", "weights' dtype", files="summary"),
    Column(
        "compile",
        CONFIG,
        None,
        "",
        "the target's forward: packed (specbench's, oneDNN-packed weights on CPU beside its own, each row count on the "
        "faster), inductor (specbench's under "
        "torch.compile, CUDA), own (specbench's, unpacked), eager (transformers': --no-compile and the hf-* methods), "
        "vllm",
        header="forward",
        files="summary",
    ),
    Column(
        "prompts_hash",
        CONFIG,
        None,
        "",
        "hash of the encoded prompt ids: runs with other prompts are not comparable",
        files="summary",
    ),
    Column(
        "engine",
        CONFIG,
        None,
        "",
        "who decodes: torch (specbench's loop), hf (transformers' generate) or vllm; speedup is over the engine's own baseline",
        header="engine",
    ),
    Column("concurrency", CONFIG, None, "d", "requests in flight (1 for specbench's loop)", header="conc"),
    Column(
        "request_rate",
        CONFIG,
        None,
        "g",
        "requests sent per second, Poisson arrivals (served engines; inf: all at once, held to --concurrency)",
    ),
    Column("method", CONFIG, None, "", "decoding method (`baseline` is the target alone)", header="method"),
    Column(
        "k",
        CONFIG,
        None,
        "d",
        "lookahead: draft tokens per target verification (under --k-policy heuristic the first round's, under "
        "confidence the most a round drafts; empty for methods without K)",
        header="K",
    ),
    Column(
        "tree",
        CONFIG,
        None,
        "",
        "tree shape, the branching at each depth (tree methods; K is its depth)",
        header="tree",
    ),
    Column(
        "k_policy",
        CONFIG,
        None,
        "",
        "how K is chosen round by round (--k-policy): fixed, heuristic or confidence (empty for methods without K)",
        header="policy",
        plain="fixed",
    ),
    Column(
        "options",
        CONFIG,
        None,
        "",
        "the method's own settings that change what it does (cascade split, online schedule)",
        files="summary",
    ),
    Column("temperature", CONFIG, None, "", "sampling temperature (0 = greedy)", files="summary"),
    Column("top_k", CONFIG, None, "", "top-k truncation (0 = off)", files="summary"),
    Column("top_p", CONFIG, None, "", "nucleus truncation (1.0 = off)", files="summary"),
    Column("eta", CONFIG, None, "", "eta-sampling epsilon (0 = off)", files="summary"),
    Column(
        "synthetic_acceptance",
        CONFIG,
        None,
        "",
        "--synthetic-acceptance: drafts kept unverified at this rate (below 1) or mean tokens per round; the "
        "outputs are not the target's. Blank: verified",
        files="summary",
    ),
    Column("seed", CONFIG, None, "", "base seed of every random stream", files="summary"),
    Column("max_new_tokens", CONFIG, None, "", "generation limit per prompt", files="summary"),
    Column(
        "num_prompts",
        CONFIG,
        None,
        "",
        "prompts decoded in the row (each turn of a conversation is one)",
        files="summary",
    ),
    Column("prompt_id", CONFIG, None, "", "the prompt's id in its dataset", files="records"),
    Column("prompt_index", CONFIG, None, "d", "the row's position in the run (each turn is a row)", files="records"),
    Column("turn", CONFIG, None, "d", "which user turn of its conversation the row decoded (from 1)", files="records"),
    Column("category", CONFIG, None, "", "the prompt's category in its dataset (empty: none)", files="records"),
    Column("sub_category", CONFIG, None, "", "its sub-category, where the dataset has one", files="records"),
    Column("input_length", CONFIG, None, "", INPUT_LENGTH, files="records"),
    Column("prompt_tokens", DETERMINISTIC, None, "d", "prompt length in tokens", files="records"),
    Column("new_tokens", DETERMINISTIC, None, "d", "tokens the method generated"),
    Column("baseline_tokens", DETERMINISTIC, None, "d", "tokens the baseline generated", files="records"),
    Column(
        "baseline_s",
        TIMING,
        LOWER,
        ".3f",
        "baseline wall seconds for the prompt, median of the repeats",
        files="records",
        absolute=True,
    ),
    Column(
        "method_s",
        TIMING,
        LOWER,
        ".3f",
        "the method's wall seconds: per prompt the median of the repeats; in the summary their sum",
        absolute=True,
    ),
    Column(
        "baseline_tokens_per_s",
        TIMING,
        HIGHER,
        ".1f",
        "baseline tokens / wall seconds",
        header="base tok/s",
        absolute=True,
    ),
    Column(
        "spec_tokens_per_s",
        TIMING,
        HIGHER,
        ".1f",
        "the method's tokens / wall seconds",
        header="tok/s",
        absolute=True,
    ),
    Column(
        "speedup",
        TIMING,
        HIGHER,
        ".3f",
        "method tokens/s over baseline tokens/s on the same prompts, end to end (prefill included)",
        header="speedup",
        gated=True,
    ),
    Column(
        "throughput",
        TIMING,
        HIGHER,
        ".1f",
        "tokens/s over all requests: their tokens / the wall time from the first submission to the last token",
        files="summary",
        absolute=True,
    ),
    Column(
        "throughput_speedup",
        TIMING,
        HIGHER,
        ".3f",
        "throughput over the engine's baseline's at the same concurrency",
        files="summary",
    ),
    Column(
        "vs_specbench",
        TIMING,
        HIGHER,
        ".3f",
        "tokens/s over specbench's own baseline on the same prompts (empty without --engine torch)",
        files="summary",
    ),
    Column(
        "ttft_ms",
        TIMING,
        LOWER,
        ".1f",
        "time to first token in ms, from the request's submission (specbench's loop: its prefill)",
        files="records",
        absolute=True,
    ),
    Column(
        "tpot_ms",
        TIMING,
        LOWER,
        ".2f",
        "time per output token after the first, in ms (the request's decode time / (tokens - 1))",
        files="records",
        absolute=True,
    ),
    Column(
        "itl_ms",
        TIMING,
        None,
        "",
        "the gaps between successive chunks of the answer as they arrived, ms (served engines; a chunk may hold "
        "several tokens)",
        files="records",
        absolute=True,
    ),
    Column(
        "e2e_ms",
        TIMING,
        LOWER,
        ".1f",
        "the request's end-to-end latency, submission to last token, ms",
        files="records",
        absolute=True,
    ),
    *(
        Column(
            f"{name}_p{q}_ms",
            TIMING,
            LOWER,
            ".1f",
            f"{'median' if q == 50 else f'{q}th percentile of'} {what} over the requests, ms",
            files="summary",
            absolute=True,
        )
        for name, what in LATENCIES.items()
        for q in PERCENTILES
    ),
    Column(
        "start_s",
        TIMING,
        None,
        ".3f",
        "when the request was submitted, seconds from its block's start (vLLM)",
        files="records",
        absolute=True,
    ),
    Column(
        "end_s",
        TIMING,
        None,
        ".3f",
        "when its last token arrived, seconds from its block's start (vLLM)",
        files="records",
        absolute=True,
    ),
    Column(
        "train_s",
        TIMING,
        LOWER,
        ".3f",
        "seconds a method that learns (online) spent training its draft after the prompt(s), apart from decoding",
        absolute=True,
    ),
    Column(
        "speedup_with_training",
        TIMING,
        HIGHER,
        ".3f",
        "speedup with the training seconds added to the method's decoding seconds",
        files="summary",
    ),
    Column(
        "alpha",
        DETERMINISTIC,
        HIGHER,
        ".3f",
        "mean of sum_x min(p, q) over the draft positions tested (each accepted one and the first rejected one)",
        header="alpha",
        gated=True,
    ),
    Column(
        "proposable",
        DETERMINISTIC,
        HIGHER,
        ".3f",
        "for a draft with its own tokenizer: the share of the baseline's output tokens the method can propose "
        "(speculative-intersection: those in both vocabularies; speculative-text: those whose text the draft's "
        "tokenizer writes back unchanged); empty for the other methods",
        header="propose",
    ),
    Column(
        "alpha_estimate",
        DETERMINISTIC,
        HIGHER,
        ".3f",
        "alpha from acceptance counts alone, as if each draft were accepted independently with one probability: "
        "accepted / tested (the maximum-likelihood estimate); all vLLM's counters give, and equal to alpha under greedy",
        header="alpha~",
    ),
    Column(
        "acceptance_rate",
        DETERMINISTIC,
        HIGHER,
        ".3f",
        "accepted draft tokens / drafted tokens",
        header="accepted",
        gated=True,
    ),
    Column(
        "tau",
        DETERMINISTIC,
        HIGHER,
        ".2f",
        "generated tokens per target forward (prefill and bonus tokens included)",
        header="tau",
        gated=True,
    ),
    Column(
        "nodes",
        DETERMINISTIC,
        None,
        ".2f",
        "draft tokens verified per target forward that verifies (a prefill verifies only under hf-assisted; "
        "K for a chain of a draft model)",
        header="nodes",
    ),
    Column(
        "c",
        TIMING,
        LOWER,
        ".3f",
        "cost of one drafting step / one-token target forward (0 without a draft model)",
        header="c",
        files="summary",
    ),
    Column(
        "c_implied",
        TIMING,
        LOWER,
        ".3f",
        "served engines: the c that would make the formula give the measured speedup with the measured tau, "
        "(tau / speedup - 1) / K; it holds the draft's steps and everything else speculation costs the server "
        "(verifying K + 1 tokens, scheduling, the larger batches)",
        files="summary",
    ),
    Column(
        "verify_ratio",
        TIMING,
        LOWER,
        ".2f",
        "target forward over K+1 tokens / over one token (empty under a --k-policy other than fixed, whose rounds "
        "verify a varying number: see verify_ratio_run)",
        header="verify",
        files="summary",
    ),
    Column(
        "predicted_speedup",
        TIMING,
        HIGHER,
        ".2f",
        "(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)): the classic formula, for K drafts every round (empty under "
        "another --k-policy than fixed: predicted_speedup_run holds for any)",
        header="pred",
        files="summary",
    ),
    Column(
        "predicted_speedup_verify",
        TIMING,
        HIGHER,
        ".2f",
        "E[tokens] / (K c + verify_ratio): the formula with the measured cost of verification (fixed K only, as "
        "predicted_speedup)",
        header="pred+verify",
        files="summary",
    ),
    Column(
        "prefill_s", TIMING, LOWER, ".3f", "seconds in prefill forwards (the prompt, target and draft)", absolute=True
    ),
    Column(
        "draft_s",
        TIMING,
        LOWER,
        ".3f",
        "seconds in the drafting model's forwards after its prefill (self-sparse, triforce: the target over its KV budget)",
        absolute=True,
    ),
    Column(
        "inner_s",
        TIMING,
        LOWER,
        ".3f",
        "seconds in the level beneath the drafting model (cascade: prompt lookup; triforce: the windowed draft model)",
        absolute=True,
    ),
    Column(
        "retokenize_s",
        TIMING,
        LOWER,
        ".3f",
        "seconds converting between a draft's vocabulary and the target's (speculative-intersection, speculative-text)",
        absolute=True,
    ),
    Column(
        "verify_s",
        TIMING,
        LOWER,
        ".3f",
        "seconds in target forwards after the prefill (the baseline: its steps)",
        absolute=True,
    ),
    Column(
        "other_s",
        TIMING,
        LOWER,
        ".3f",
        "the rest of the decode's wall time: sampling, accept/reject, cache bookkeeping, Python",
        absolute=True,
    ),
    Column(
        "decode_speedup",
        TIMING,
        HIGHER,
        ".3f",
        "tokens/s over the baseline's with both prefills left out",
        header="decode x",
    ),
    Column(
        "c_run",
        TIMING,
        LOWER,
        ".3f",
        "mean draft forward / the baseline's mean one-token target forward, both timed in this run",
    ),
    Column(
        "verify_ratio_run",
        TIMING,
        LOWER,
        ".2f",
        "mean verification forward / the baseline's mean one-token target forward, timed in this run",
    ),
    Column(
        "predicted_speedup_run",
        TIMING,
        HIGHER,
        ".2f",
        "tokens per round / (drafting per round + verify_ratio_run), in target steps: forwards (and lookup) only",
    ),
    Column(
        "efficiency",
        TIMING,
        HIGHER,
        ".3f",
        "decode_speedup / predicted_speedup_run (1.0: the loop loses nothing beyond its forwards); judged against "
        "a baseline from any machine",
        header="eff",
        portable=True,
    ),
    Column(
        "peak_memory_mb",
        TIMING,  # measured, not counted: it moves with the allocator and the machine, so compare allows a tolerance
        LOWER,
        ".0f",
        "the most memory a decode held, MB: on CUDA torch.cuda.max_memory_allocated on the model's device, on a CPU "
        "the process's peak resident set (weights included), each reset before the decode (meta.json's "
        "resolved.peak_memory says how it was read); in the summary the most over the method's prompts",
        header="peak MB",
        absolute=True,
    ),
    Column(
        "copy_bandwidth_gbs",
        TIMING,
        None,
        ".1f",
        "GB/s that copying a buffer larger than the caches moves on the run's device, read and written counted, "
        "measured once in the run after the models loaded and kept in meta.json (`resolved.copy_bandwidth`, "
        "bytes/s), which a resumed run reads instead of measuring again (empty for served engines)",
        files="summary",
        absolute=True,
    ),
    Column(
        "weight_bytes",
        DETERMINISTIC,
        None,
        "d",
        "bytes of the target's weights, as loaded, that one decode step reads: every parameter once, of the input "
        "embedding one row (a tied LM head reads that matrix whole, once)",
        files="summary",
    ),
    Column(
        "kv_read_bytes",
        DETERMINISTIC,
        None,
        ".0f",
        "bytes of KV cache the baseline's mean decode step reads: a key and a value per layer and key/value head for "
        "each token of context, at the mean context of its steps over the row's prompts",
        files="summary",
    ),
    Column(
        "baseline_mbu",
        TIMING,
        HIGHER,
        ".1%",
        "the baseline's model bandwidth utilisation on the row's prompts: its decode tokens/s (prefill left out) x "
        "(weight_bytes + kv_read_bytes) / copy_bandwidth_gbs (empty for served engines)",
        header="MBU",
        files="summary",
        absolute=True,
    ),
    *_spans(),
    Column("drafted", DETERMINISTIC, None, "d", "draft tokens proposed"),
    Column(
        "drafted_per_round",
        DETERMINISTIC,
        None,
        ".2f",
        "mean draft tokens per verification round, from each round's count (draft_lengths.csv: how often each "
        "count was drafted); specbench's loop only",
    ),
    Column("accepted", DETERMINISTIC, None, "d", "draft tokens accepted"),
    Column("beta_sum", DETERMINISTIC, None, ".3f", "sum of beta over the tested positions (alpha's numerator)"),
    Column("tested", DETERMINISTIC, None, "d", "draft positions tested (alpha's denominator)"),
    Column(
        "inner_drafted",
        DETERMINISTIC,
        None,
        "d",
        "tokens the level beneath the drafting model proposed to it (cascade: prompt lookup; triforce: the draft model; "
        "lookup-or-draft and lookup-or-eagle: lookup, beside it, to the target)",
    ),
    Column(
        "inner_accepted",
        DETERMINISTIC,
        None,
        "d",
        "of them, those the drafting model's exact check accepted (lookup-or-draft and lookup-or-eagle: the target's)",
    ),
    Column(
        "from_inner",
        DETERMINISTIC,
        None,
        "d",
        "accepted draft tokens that the level beneath the drafting model proposed",
    ),
    Column(
        "inner_forwards",
        DETERMINISTIC,
        None,
        "d",
        "forwards of the level beneath the drafting model (0 for prompt lookup)",
    ),
    Column("target_forwards", DETERMINISTIC, LOWER, "d", "target forwards, prefill included"),
    Column(
        "draft_forwards",
        DETERMINISTIC,
        None,
        "d",
        "forwards of the drafting model (the draft model, or the target over its KV budget)",
    ),
    Column(
        "outputs_match",
        DETERMINISTIC,
        HIGHER,
        "d",
        "prompts whose output equals the baseline's token for token (greedy: all but near-ties, see structural)",
        header="= base",
    ),
    Column(
        "first_divergence",
        DETERMINISTIC,
        None,
        "d",
        "earliest token index where an output differs from the baseline's (-1: none)",
    ),
    Column(
        "divergence",
        DETERMINISTIC,
        None,
        "",
        "greedy: near-tie where the baseline's two likeliest tokens at the first divergence are within NEAR_TIE "
        "nats (specbench's loop: or TIE_STEPS rounding steps of its logits' dtype), which numerics can flip, "
        "structural otherwise; empty: equal outputs, or no margin (vLLM, a server without logprobs, a repetition "
        "penalty or logit bias)",
        files="records",
    ),
    Column(
        "structural",
        DETERMINISTIC,
        LOWER,
        "d",
        "greedy: outputs that diverged from the baseline's where no near-tie explains it (0: lossless); "
        "empty when a divergence has no label",
        header="struct.",
        files="summary",
    ),
    Column(
        "error",
        DETERMINISTIC,
        None,
        "",
        "why a served request failed (unreachable, HTTP status, timeout, a stream cut short); empty when it did not",
        files="records",
    ),
    Column(
        "failed", DETERMINISTIC, LOWER, "d", "requests that failed: their rows are not in any rate", files="summary"
    ),
    Column(
        "acceptance_source",
        DETERMINISTIC,
        None,
        "",
        "where a served engine's acceptance came from: response (the request's own figures), counters (the "
        "server's counters over the block) or empty (nowhere: its acceptance columns are empty)",
    ),
    Column(
        "accept_hist",
        DETERMINISTIC,
        None,
        "",
        "verify rounds that accepted 0, 1, ..., K drafts (a heuristic K: up to the most a round accepted)",
        files="records",
    ),
    Column("draft_hist", DETERMINISTIC, None, "", "verify rounds that drafted 0, 1, 2, ... tokens", files="records"),
    Column(
        "rank_hist",
        DETERMINISTIC,
        None,
        "",
        "accepted tree nodes that were their parent's 1st, 2nd, ... child",
        files="records",
    ),
)
