"""Timing orchestration: prompts x K, baseline and speculative, forward-cost curves.

Yields plain data and never prints; the CLI decides what to show and report.py what to write.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from . import metrics
from .engine import DecodeResult, PromptLookupDrafter, autoregressive_decode, speculative_decode
from .errors import SpecbenchError
from .models import HFCausalLM, LoadedModel, hf_generate, load, resolve_device, resolve_dtype, shared_width
from .prompts import Prompt, load_prompts
from .sampling import SamplingConfig

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"
# Methods that take a lookahead K; "baseline" always runs and "hf-generate" has no K.
K_METHODS = ("speculative", "prompt-lookup", "hf-assisted")
METHODS = ("baseline", *K_METHODS, "hf-generate")


@dataclass
class BenchConfig:
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    dataset: str = "humaneval"
    ks: list[int] = field(default_factory=lambda: [4])
    methods: list[str] = field(default_factory=lambda: ["speculative"])
    num_prompts: int | None = 10
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    repeats: int = 1
    warmup: int = 1
    prompt_field: str = "prompt"
    cost_repeats: int = 10
    chat: str = "auto"  # auto: use the target's chat template when it has one; on; off

    @property
    def plan(self) -> list[tuple[str, int | None]]:
        """(method, K) pairs decoded per prompt after the baseline."""
        steps = []
        for method in dict.fromkeys(self.methods):
            if method in K_METHODS:
                steps += [(method, k) for k in self.ks]
            elif method != "baseline":
                steps.append((method, None))
        return steps

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    def validate(self) -> None:
        problems = [
            (any(k < 1 for k in self.ks) or not self.ks, "K must be at least 1 (--k / --ks)"),
            (self.max_new_tokens < 1, "--max-new-tokens must be at least 1"),
            (self.num_prompts is not None and self.num_prompts < 1, "--num-prompts must be at least 1"),
            (self.temperature < 0, "--temperature must be >= 0 (0 means greedy)"),
            (self.top_k < 0, "--top-k must be >= 0 (0 turns it off)"),
            (not 0 < self.top_p <= 1, "--top-p must be in (0, 1]"),
            (self.repeats < 1 or self.warmup < 0, "--repeats must be >= 1 and --warmup >= 0"),
            (not set(self.methods) <= set(METHODS), f"unknown --method in {self.methods}: choose from {', '.join(METHODS)}"),
            (self.chat not in ("auto", "on", "off"), f"--chat {self.chat}: use auto, on or off"),
        ]
        for bad, message in problems:
            if bad:
                raise SpecbenchError(message)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Pair:
    target: LoadedModel
    draft: LoadedModel
    target_lm: HFCausalLM
    draft_lm: HFCausalLM
    device: torch.device
    dtype: torch.dtype

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.target.stop_ids


def load_pair(cfg: BenchConfig) -> Pair:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    target = load(cfg.target, device, dtype)
    draft = load(cfg.draft, device, dtype)
    width = shared_width(target, draft)
    if "hf-assisted" in cfg.methods and target.width != draft.width:
        raise SpecbenchError(
            f"--method hf-assisted needs equal logit widths (target {target.width}, draft {draft.width}); transformers "
            "would switch to a different (universal) algorithm: drop hf-assisted for this pair"
        )
    return Pair(target, draft, HFCausalLM(target.model, width), HFCausalLM(draft.model, width, draft.head_tokens), device, dtype)


def encode_prompts(pair: Pair, prompts: list[Prompt], cfg: BenchConfig) -> list[torch.Tensor]:
    """Token ids per prompt, left-truncated so prompt + new tokens + a full draft fit the window."""
    windows = [w for w in (pair.target.context_window, pair.draft.context_window) if w]
    room = min(windows) - cfg.max_new_tokens - max(cfg.ks) - 1 if windows else None
    if room is not None and room < 1:
        raise SpecbenchError(
            f"--max-new-tokens {cfg.max_new_tokens} plus K does not fit the context window of {min(windows)} tokens: "
            "lower --max-new-tokens"
        )
    tokenizer = pair.target.tokenizer
    chat = cfg.chat == "on" or (cfg.chat == "auto" and tokenizer.chat_template is not None)
    if chat and tokenizer.chat_template is None:
        raise SpecbenchError(f"--chat on, but {cfg.target}'s tokenizer has no chat template: use --chat off")
    encoded = []
    for prompt in prompts:
        if chat:
            messages = [{"role": "user", "content": prompt.instruction}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        else:
            ids = tokenizer(prompt.text, return_tensors="pt").input_ids[0]
        if room is not None:
            ids = ids[-room:]
        if len(ids) == 0:
            raise SpecbenchError(f"prompt {prompt.id} encodes to no tokens: remove it from the dataset")
        encoded.append(ids.to(pair.device))
    return encoded


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def median_time(device: torch.device, fn: Callable[[], object], repeats: int) -> tuple[object, float]:
    """Run ``fn`` ``repeats`` times with the device synchronised around each; last result, median seconds."""
    times, out = [], None
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return out, metrics.median(times)


@dataclass
class ForwardCosts:
    context_tokens: int
    target: dict[int, float]  # tokens in one forward -> median seconds
    draft_single: float

    @property
    def c(self) -> float:
        return self.draft_single / self.target[1]

    def verify_ratio(self, k: int) -> float:
        return self.target[k + 1] / self.target[1]


def _forward_seconds(probes: list[tuple[HFCausalLM, int]], context: torch.Tensor, repeats: int, device: torch.device) -> list[float]:
    """Median time of one n-token forward on top of the cache, for each (model, n) in ``probes``.

    The probes take turns within every repeat, so a change in machine load during the
    measurement moves all of them alike instead of skewing the ratios between them.
    """
    steps = []
    for lm, n in probes:
        def step(lm=lm, n=n):
            lm.forward(context[:n], last=n)
            lm.crop(n)

        median_time(device, step, 1)  # warm-up for this shape
        steps.append(step)
    times = [[median_time(device, step, 1)[1] for step in steps] for _ in range(repeats)]
    return [metrics.median(column) for column in zip(*times)]


def measure_costs(pair: Pair, prompt_ids: list[torch.Tensor], cfg: BenchConfig) -> ForwardCosts:
    """Single-token forward times of both models and target forward times for 1..max(K)+1 tokens.

    Measured at the context length decoding actually runs at: the median prompt plus half the
    generated tokens, built from real prompt tokens.
    """
    lengths = sorted(len(ids) for ids in prompt_ids)
    length = lengths[len(lengths) // 2] + cfg.max_new_tokens // 2
    tokens = torch.cat(prompt_ids)
    context = tokens.repeat(length // len(tokens) + 2)[: length + max(cfg.ks) + 1]
    prefix, probe = context[:length], context[length:]
    sizes = range(1, max(cfg.ks) + 2)
    with torch.inference_mode():
        for lm in (pair.target_lm, pair.draft_lm):
            lm.reset()
            lm.forward(prefix, last=1)
        *target, draft = _forward_seconds(
            [(pair.target_lm, n) for n in sizes] + [(pair.draft_lm, 1)], probe, cfg.cost_repeats, pair.device
        )
    return ForwardCosts(length, dict(zip(sizes, target)), draft)


@dataclass
class Measurement:
    """One timed decode of one prompt."""

    prompt_index: int
    prompt_id: str
    prompt_tokens: int
    method: str  # one of METHODS
    k: int | None
    result: DecodeResult
    seconds: float


def generator_for(device: torch.device, seed: int, prompt_index: int, stream: int) -> torch.Generator:
    """Independent, reproducible random streams per (seed, prompt, method)."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + prompt_index) * 8 + stream)


def decode(
    pair: Pair, cfg: BenchConfig, ids: torch.Tensor, index: int, method: str, k: int | None
) -> tuple[DecodeResult, float]:
    """Time one prompt's decode (median of cfg.repeats, each from the same seed, so identical work)."""
    sampling, stream = cfg.sampling, METHODS.index(method)
    args = (ids, cfg.max_new_tokens, sampling)

    def fn():
        generator = generator_for(pair.device, cfg.seed, index, stream)
        if method == "baseline":
            return autoregressive_decode(pair.target_lm, *args, generator, pair.stop_ids)
        if method == "speculative":
            return speculative_decode(pair.target_lm, pair.draft_lm, ids, k, cfg.max_new_tokens, sampling, generator, pair.stop_ids)
        if method == "prompt-lookup":
            lookup = PromptLookupDrafter(pair.target_lm.width)
            return speculative_decode(pair.target_lm, lookup, ids, k, cfg.max_new_tokens, sampling, generator, pair.stop_ids)
        seed = int(torch.randint(2**62, (1,), generator=generator, device=pair.device))
        assistant = pair.draft if method == "hf-assisted" else None
        return hf_generate(pair.target, *args, seed, pair.stop_ids, assistant, k)

    return median_time(pair.device, fn, cfg.repeats)


def warm_up(pair: Pair, cfg: BenchConfig, prompt_ids: list[torch.Tensor]) -> None:
    """Untimed runs of every decoder, so allocation, kernel selection and caches settle first."""
    for _ in range(cfg.warmup):
        for method, k in [("baseline", None), *cfg.plan]:
            decode(pair, cfg, prompt_ids[0], 0, method, k)


def run(pair: Pair, cfg: BenchConfig, prompts: list[Prompt], prompt_ids: list[torch.Tensor]) -> Iterator[Measurement]:
    """Per prompt: the baseline once (shared by every method and K), then each (method, K)."""
    for index, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
        for method, k in [("baseline", None), *cfg.plan]:
            result, seconds = decode(pair, cfg, ids, index, method, k)
            yield Measurement(index, prompt.id, len(ids), method, k, result, seconds)


def record(baseline: Measurement, spec: Measurement) -> dict:
    """The per-prompt, per-K row of records.csv."""
    b, s = baseline.result, spec.result
    divergence = next((i for i, (x, y) in enumerate(zip(b.tokens, s.tokens)) if x != y), None)
    if divergence is None and len(b.tokens) != len(s.tokens):
        divergence = min(len(b.tokens), len(s.tokens))
    k = spec.k
    return {
        "prompt_id": spec.prompt_id,
        "prompt_index": spec.prompt_index,
        "method": spec.method,
        "k": k,
        "prompt_tokens": spec.prompt_tokens,
        "baseline_tokens": len(b.tokens),
        "spec_tokens": len(s.tokens),
        "baseline_s": baseline.seconds,
        "spec_s": spec.seconds,
        "baseline_tokens_per_s": len(b.tokens) / baseline.seconds,
        "spec_tokens_per_s": len(s.tokens) / spec.seconds,
        "speedup": (len(s.tokens) / spec.seconds) / (len(b.tokens) / baseline.seconds),
        "alpha": s.beta_sum / s.tested if s.tested else float("nan"),
        "acceptance_rate": s.accepted / s.drafted if s.drafted else float("nan"),
        "tau": len(s.tokens) / s.target_forwards if k else float("nan"),
        "drafted": s.drafted,
        "accepted": s.accepted,
        "beta_sum": s.beta_sum,
        "tested": s.tested,
        "target_forwards": s.target_forwards,
        "draft_forwards": s.draft_forwards,
        "outputs_match": divergence is None,
        "first_divergence": -1 if divergence is None else divergence,
        "accept_hist": " ".join(str(s.accept_counts.count(n)) for n in range(k + 1)) if s.accept_counts else "",
    }


def summarize(records: list[dict], costs: ForwardCosts, cfg: BenchConfig, pair_info: dict) -> list[dict]:
    """One summary row per (method, K) over the prompts measured so far, after a baseline row."""
    rows = []
    for method, k in [("baseline", None), *cfg.plan]:
        if method == "baseline":  # its figures ride along in every record: count each prompt once
            rs = list({r["prompt_id"]: r for r in records}.values())
        else:
            rs = [r for r in records if r["method"] == method and r["k"] == k]
        if not rs:
            continue
        base_tokens, base_s = sum(r["baseline_tokens"] for r in rs), sum(r["baseline_s"] for r in rs)
        if method == "baseline":
            tokens, seconds = base_tokens, base_s
        else:
            tokens, seconds = sum(r["spec_tokens"] for r in rs), sum(r["spec_s"] for r in rs)
        # Only the K methods draft; the baseline and hf-generate rows carry no acceptance figures.
        tested, drafted = (sum(r["tested"] for r in rs), sum(r["drafted"] for r in rs)) if k else (0, 0)
        alpha = sum(r["beta_sum"] for r in rs) / tested if tested else float("nan")
        # Prompt lookup runs no draft model: its drafting cost is host-side bookkeeping.
        c = 0.0 if method == "prompt-lookup" else costs.c
        verify_ratio = costs.verify_ratio(k) if k else float("nan")
        rows.append(
            {
                **pair_info,
                "method": method,
                "num_prompts": len(rs),
                "k": k,
                "temperature": cfg.temperature,
                "top_k": cfg.top_k,
                "top_p": cfg.top_p,
                "seed": cfg.seed,
                "max_new_tokens": cfg.max_new_tokens,
                "new_tokens": tokens,
                "baseline_tokens_per_s": base_tokens / base_s,
                "spec_tokens_per_s": tokens / seconds,
                "speedup": (tokens / seconds) / (base_tokens / base_s),
                "alpha": alpha,
                "acceptance_rate": sum(r["accepted"] for r in rs) / drafted if drafted else float("nan"),
                "tau": tokens / sum(r["target_forwards"] for r in rs) if k else float("nan"),
                "c": c if k else float("nan"),
                "verify_ratio": verify_ratio,
                "predicted_speedup": metrics.predicted_speedup(alpha, c, k) if k else float("nan"),
                "predicted_speedup_verify": metrics.predicted_speedup_verify(alpha, c, k, verify_ratio) if k else float("nan"),
                "outputs_match": len(rs) if method == "baseline" else sum(r["outputs_match"] for r in rs),
                "first_divergence": -1 if method == "baseline" else min(
                    (r["first_divergence"] for r in rs if r["first_divergence"] >= 0), default=-1
                ),
            }
        )
    return rows


def acceptance_rows(records: list[dict]) -> list[dict]:
    """Per K and draft position: how often that position was accepted (acceptance.csv)."""
    hists: dict[int, list[int]] = {}
    for r in records:
        if r["method"] != "speculative":
            continue
        counts = [int(x) for x in r["accept_hist"].split()]
        total = hists.setdefault(r["k"], [0] * len(counts))
        hists[r["k"]] = [a + b for a, b in zip(total, counts)]
    return [
        {"k": k, "position": i + 1, "acceptance": rate, "verify_steps": sum(hist)}
        for k, hist in sorted(hists.items())
        for i, rate in enumerate(metrics.acceptance_by_position(hist))
    ]


def predicted_by_k(alpha: float, costs: ForwardCosts) -> dict[int, float]:
    """predicted_speedup_verify at every K whose verification cost was measured (1..max K), so a
    one-K run can say whether a smaller K would have done better."""
    return {k: metrics.predicted_speedup_verify(alpha, costs.c, k, costs.verify_ratio(k)) for k in range(1, max(costs.target))}


def best_ks(summary: list[dict]) -> dict:
    """For specbench's loop: the best K by measured speedup and by each prediction."""
    summary = [r for r in summary if r["method"] == "speculative"]
    if not summary:
        return {}
    picks = {}
    for label, column in [("measured", "speedup"), ("predicted", "predicted_speedup"), ("predicted_verify", "predicted_speedup_verify")]:
        by_k = {r["k"]: r[column] for r in summary}
        k = metrics.best_k(by_k)
        picks[label] = {"k": k, "speedup": by_k[k], "by_k": by_k}
    return picks


def prepare(cfg: BenchConfig) -> tuple[Pair, list[Prompt], list[torch.Tensor]]:
    """Validate, load the pair and the prompts; every input error surfaces here, before timing."""
    cfg.validate()
    prompts = load_prompts(cfg.dataset, cfg.num_prompts, cfg.prompt_field)
    pair = load_pair(cfg)
    return pair, prompts, encode_prompts(pair, prompts, cfg)
