"""The benchmark: prompts x methods x K, timed, with the forward-cost curve and the summary.

`benchmark` runs a whole configuration and yields what it is doing, then its results; it never
prints. Files are written through report.RunWriter as each measurement completes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from . import metrics, report, schema
from .engine import DecodeResult, tree_parents
from .errors import SpecbenchError
from .kv import SINKS
from .machine import environment
from .methods import BASELINE, DEFAULT, METHODS, Decoder, draft_window
from .models import (
    DEVICE_MAPS,
    HFCausalLM,
    LoadedModel,
    SparseView,
    available_memory,
    load,
    offload_warning,
    placement,
    random_model,
    resolve_device,
    resolve_dtype,
    shared_width,
    weight_bytes,
)
from .online import Learned, OnlineConfig
from .prompts import LONG_DATASETS, Prompt, load_prompts
from .sampling import SamplingConfig
from .timing import PhaseClock, Phases, TimedLM, synchronize

log = logging.getLogger("specbench")

KV_POLICIES = ("retrieval", "window")
DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"
SUMMARY_EVERY_S = 10.0  # summary.csv is rewritten at most this often while decoding, and at the end
# What random weights make meaningless: how often random models agree, and what follows from it.
WEIGHT_DEPENDENT = ("alpha", "acceptance_rate", "tau", "predicted_speedup", "predicted_speedup_verify")


@dataclass
class BenchConfig:
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    dataset: str = "humaneval"
    ks: list[int] = field(default_factory=lambda: [4])
    methods: list[str] = field(default_factory=lambda: list(DEFAULT))
    num_prompts: int | None = 10
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eta: float = 0.0
    trees: list[str] = field(default_factory=lambda: ["2,2"])  # shapes for tree methods: branching per depth
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    repeats: int = 1
    warmup: int = 1
    prompt_field: str = "prompt"
    cost_repeats: int = 10
    threads: int = 0  # torch's CPU threads; 0 leaves torch's default
    chat: str = "auto"  # auto: use the target's chat template when it has one; on; off
    random_weights: bool = False  # both models built from their architecture with random weights
    prompt_tokens: int = 0  # random weights: every prompt this many random ids (0: the dataset's lengths)
    assume_alpha: list[float] = field(default_factory=list)  # alphas for predicted.csv
    device_map: str | None = None  # accelerate's placement of the target over the devices (auto, balanced, ...)
    cascade_split: int = 0  # cascade: the draft model drafts the first M positions, lookup the rest (0: all K)
    kv_budget: int = 1024  # self-sparse, triforce: cache positions the target drafts over
    kv_policy: str = "retrieval"  # which: "retrieval" (sinks + best chunks) or "window" (sinks + most recent)
    draft_window: int = 256  # triforce, speculative-window: the draft model's streaming window
    inner_k: int = 2  # triforce: draft-model tokens per check of the middle level
    context_tokens: int = 0  # longcode: prompt length in tokens
    prefill_chunk: int = 512  # prompts longer than this are prefilled in chunks of it (0: in one forward)
    online: OnlineConfig = field(default_factory=OnlineConfig)  # online: when and how the draft learns
    save_draft: str | None = None  # online: write the updated draft here at the end

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(int(b) for b in tree.split(",")) for tree in self.trees]

    @property
    def plan(self) -> list[Decoder]:
        """What is decoded per prompt after the baseline: each method at each K, or each tree shape."""
        steps = []
        for method in (METHODS[name] for name in dict.fromkeys(self.methods) if name != BASELINE.name):
            if method.takes_tree:
                steps += [Decoder(method, len(shape), shape) for shape in self.shapes]
            else:
                steps += [Decoder(method, k) for k in self.ks] if method.takes_k else [Decoder(method)]
        return steps

    @property
    def widest(self) -> int:
        """Most tokens in one target forward: K + 1 for a chain, the tree's nodes + 1 for a tree."""
        return 1 + max([max(self.ks)] + [len(tree_parents(step.tree)) for step in self.plan if step.tree])

    @property
    def needs_draft(self) -> bool:
        return any(step.method.needs_draft for step in self.plan)

    @property
    def learns(self) -> bool:
        return any(step.method.learns for step in self.plan)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.eta)

    def validate(self) -> None:
        problems = [
            (any(k < 1 for k in self.ks) or not self.ks, "K must be at least 1 (--k)"),
            (self.max_new_tokens < 1, "--max-new-tokens must be at least 1"),
            (self.num_prompts is not None and self.num_prompts < 1, "--num-prompts must be at least 1"),
            (self.temperature < 0, "--temperature must be >= 0 (0 means greedy)"),
            (self.top_k < 0, "--top-k must be >= 0 (0 turns it off)"),
            (not 0 < self.top_p <= 1, "--top-p must be in (0, 1]"),
            (not 0 <= self.eta < 1, "--eta must be in [0, 1) (0 turns it off)"),
            (
                not all(re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", tree) for tree in self.trees),
                f"--tree {' '.join(self.trees)}: give the branching at each depth, like 2,2,1",
            ),
            (self.repeats < 1 or self.warmup < 0, "--repeats must be >= 1 and --warmup >= 0"),
            (self.cost_repeats < 1, "--cost-repeats must be at least 1"),
            (self.threads < 0, "--threads must be >= 0 (0 is torch's default)"),
            (
                not set(self.methods) <= set(METHODS),
                f"unknown --method in {self.methods}: choose from {', '.join(METHODS)}",
            ),
            (self.chat not in ("auto", "on", "off"), f"--chat {self.chat}: use auto, on or off"),
            (self.prompt_tokens < 0, "--prompt-tokens must be >= 0 (0: the dataset's prompt lengths)"),
            (
                self.prompt_tokens > 0 and not self.random_weights,
                "--prompt-tokens sets the length of random prompts: use it with --random-weights",
            ),
            (not all(0 <= a < 1 for a in self.assume_alpha), "--assume-alpha values must lie in [0, 1)"),
            (
                self.device_map is not None and self.device_map not in DEVICE_MAPS,
                f"--device-map {self.device_map}: use one of {', '.join(DEVICE_MAPS)}",
            ),
            (
                self.device_map is not None and self.random_weights,
                "--device-map places a checkpoint's weights as it loads them: with --random-weights use --device",
            ),
            (self.cascade_split < 0, "--cascade-split must be >= 0 (0: the draft model drafts all K positions)"),
            (self.kv_policy not in KV_POLICIES, f"--kv-policy {self.kv_policy}: use {' or '.join(KV_POLICIES)}"),
            (
                self.kv_budget < 2 * SINKS,
                f"--kv-budget must be at least {2 * SINKS} (the first {SINKS} tokens are always kept)",
            ),
            (self.draft_window < 2 * SINKS + 2, f"--draft-window must be at least {2 * SINKS + 2}"),
            (self.inner_k < 1, "--inner-k must be at least 1"),
            (self.prefill_chunk < 0, "--prefill-chunk must be >= 0 (0: the whole prompt in one forward)"),
            (self.context_tokens < 0, "--context-tokens must be >= 0"),
            (
                bool(self.context_tokens) != (self.dataset in LONG_DATASETS),
                f"--dataset {' / '.join(LONG_DATASETS)} takes its prompt length from --context-tokens N, and only it",
            ),
            (
                self.online.every < 1 or self.online.steps < 1 or self.online.lr <= 0,
                "--online-every and --online-steps must be at least 1, --online-lr positive",
            ),
            (
                self.random_weights and self.learns,
                "--method online learns from the target's rows, which mean nothing with --random-weights: drop one",
            ),
            (
                self.save_draft is not None and not self.learns,
                "--save-draft writes what --method online learned: add --method online or drop --save-draft",
            ),
        ]
        for bad, message in problems:
            if bad:
                raise SpecbenchError(message)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Pair:
    """The loaded target, and the draft when a method needs one."""

    target: LoadedModel
    target_lm: HFCausalLM
    draft: LoadedModel | None
    draft_lm: HFCausalLM | None
    device: torch.device
    dtype: torch.dtype
    clock: PhaseClock | None = None  # set on a timed pair: what methods lap their own timed parts on

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.target.stop_ids

    def timed(self, clock: PhaseClock) -> Pair:
        """This pair with every forward of its models lapped on ``clock``."""
        draft_lm = TimedLM(self.draft_lm, clock, "draft") if self.draft_lm else None
        return replace(self, target_lm=TimedLM(self.target_lm, clock, "verify"), draft_lm=draft_lm, clock=clock)


def random_weights_dtype(cfg: BenchConfig, device: torch.device) -> torch.dtype:
    """The dtype for random weights: as --dtype says, except that auto on the CPU falls back to
    bfloat16 when float32 weights would not fit in memory; a dtype that cannot fit is refused."""
    dtype = resolve_dtype(cfg.dtype, device)
    free = available_memory() if device.type == "cpu" else None
    if free is None:
        return dtype
    specs = [cfg.target] + ([cfg.draft] if cfg.needs_draft else [])
    need = sum(weight_bytes(spec, dtype) for spec in specs)
    if need > 0.9 * free and cfg.dtype == "auto" and dtype.itemsize > 2:
        log.info("float32 weights need %.1f GB of the %.1f GB free: using bfloat16", need / 1e9, free / 1e9)
        dtype, need = torch.bfloat16, need // 2
    if need > 0.9 * free:
        raise SpecbenchError(
            f"the weights need {need / 1e9:.1f} GB in {str(dtype).removeprefix('torch.')} and {free / 1e9:.1f} GB "
            "of memory are free: use --dtype bfloat16 or a smaller model"
        )
    return dtype


def load_pair(cfg: BenchConfig) -> Pair:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    if cfg.random_weights:
        dtype = random_weights_dtype(cfg, device)
        target = random_model(cfg.target, device, dtype, cfg.seed)
    else:
        dtype = resolve_dtype(cfg.dtype, device)
        target = load(cfg.target, device, dtype, cfg.device_map)
        if cfg.device_map and (warning := offload_warning(placement(target.model))):
            log.warning(warning)
    if not cfg.needs_draft:
        return Pair(target, HFCausalLM(target.model, target.width), None, None, device, dtype)
    draft = (
        random_model(cfg.draft, device, dtype, cfg.seed + 1) if cfg.random_weights else load(cfg.draft, device, dtype)
    )
    width = shared_width(target, draft)
    pair = Pair(
        target, HFCausalLM(target.model, width), draft, HFCausalLM(draft.model, width, draft.head_tokens), device, dtype
    )
    for step in cfg.plan:
        step.method.check(pair)
    return pair


def encode_prompts(pair: Pair, prompts: list[Prompt], cfg: BenchConfig) -> list[torch.Tensor]:
    """Token ids per prompt, left-truncated so prompt + new tokens + a full draft fit the window.

    With random weights the ids are random, as many per prompt as the prompt encodes to (or
    --prompt-tokens).
    """
    models = [pair.target] + ([pair.draft] if pair.draft else [])
    windows = [m.context_window for m in models if m.context_window]
    room = min(windows) - cfg.max_new_tokens - cfg.widest if windows else None
    if room is not None and room < 1:
        raise SpecbenchError(
            f"--max-new-tokens {cfg.max_new_tokens} plus K does not fit the context window of {min(windows)} tokens: "
            "lower --max-new-tokens"
        )
    if not cfg.random_weights:
        return _encoded(pair.target.tokenizer, prompts, cfg, room, pair.device)
    if cfg.prompt_tokens:
        lengths = [min(cfg.prompt_tokens, room or cfg.prompt_tokens)] * len(prompts)
    else:
        lengths = [len(ids) for ids in _encoded(length_tokenizer(pair.target), prompts, cfg, room, pair.device)]
    generator = torch.Generator().manual_seed(cfg.seed)
    return [torch.randint(pair.target_lm.width, (n,), generator=generator).to(pair.device) for n in lengths]


def length_tokenizer(target: LoadedModel):
    """The tokenizer that measures prompt lengths for a random-weights target: its own when one lies
    beside its architecture config, else the default target's (shipped with the bundled draft)."""
    from transformers import AutoTokenizer

    from .models import resolve

    for directory in (target.path.parent, Path(resolve(DEFAULT_DRAFT).location)):
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory)
        except (OSError, ValueError):
            continue
        if directory != target.path.parent:
            log.info("prompt lengths measured with %s's tokenizer (%s has none here)", DEFAULT_TARGET, target.name)
        return tokenizer
    raise SpecbenchError(f"no tokenizer to measure prompt lengths for {target.name}: pass --prompt-tokens N")


def _encoded(tokenizer, prompts: list[Prompt], cfg: BenchConfig, room: int | None, device) -> list[torch.Tensor]:
    long = cfg.dataset in LONG_DATASETS  # code to continue as it is, cut to --context-tokens
    if long and room is not None and cfg.context_tokens > room:
        raise SpecbenchError(
            f"--context-tokens {cfg.context_tokens} with --max-new-tokens {cfg.max_new_tokens} and K does not fit the "
            f"context window of the models ({room} tokens of prompt fit): lower --context-tokens"
        )
    chat = cfg.chat == "on" or (cfg.chat == "auto" and tokenizer.chat_template is not None and not long)
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
        if long:
            ids = ids[-cfg.context_tokens :]
        if len(ids) == 0:
            raise SpecbenchError(f"prompt {prompt.id} encodes to no tokens: remove it from the dataset")
        encoded.append(ids.to(device))
    return encoded


def prompts_hash(prompt_ids: list[torch.Tensor]) -> str:
    """A short hash of the encoded prompts: two runs are comparable only when it is equal."""
    digest = hashlib.sha256()
    for ids in prompt_ids:
        digest.update(ids.to(torch.int64).cpu().numpy().tobytes() + b"|")
    return digest.hexdigest()[:16]


def median_run(device: torch.device, fn: Callable[[], object], repeats: int) -> tuple[object, float]:
    """Run ``fn`` ``repeats`` times with the device synchronised around each; the result and seconds
    of the median run (the faster of the middle two for an even count)."""
    runs = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        runs.append((time.perf_counter() - start, out))
    seconds, out = sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]
    return out, seconds


COST_SIZES = 8  # verify_cost.csv covers target forwards of 1..max(this, K + 1) tokens: the whole curve


@dataclass(frozen=True)
class Cost:
    """One forward size's cost over the repeats."""

    seconds: float  # median
    iqr_s: float  # interquartile range of the repeats
    ratio_iqr: float  # interquartile range of (this / the one-token target forward), within each repeat


@dataclass
class ForwardCosts:
    context_tokens: int
    target: dict[int, Cost]  # tokens in one forward -> its cost
    draft_single: Cost | None  # None when no draft model was loaded
    repeats: int
    levels: dict[str, Cost] = field(default_factory=dict)  # one-token forwards of drafting levels (LEVELS)

    @property
    def c(self) -> float:
        return math.nan if self.draft_single is None else self.draft_single.seconds / self.target[1].seconds

    def level_c(self, name: str) -> float:
        """A drafting level's one-token forward over the target's (NaN when it was not measured)."""
        return self.levels[name].seconds / self.target[1].seconds if name in self.levels else math.nan

    def verify_ratio(self, k: int) -> float:
        return self.target[k + 1].seconds / self.target[1].seconds

    def rows(self) -> list[dict]:
        """verify_cost.csv: one row per model and forward size, with the spread of its repeats."""
        costs = [("target", n, cost) for n, cost in self.target.items()]
        if self.draft_single is not None:
            costs.append(("draft", 1, self.draft_single))
        costs += [(name, 1, cost) for name, cost in self.levels.items()]
        return [
            {
                "model": model,
                "tokens": n,
                "context_tokens": self.context_tokens,
                "seconds": cost.seconds,
                "iqr_s": cost.iqr_s,
                "ratio": cost.seconds / self.target[1].seconds,
                "ratio_iqr": cost.ratio_iqr,
                "repeats": self.repeats,
            }
            for model, n, cost in costs
        ]

    @classmethod
    def from_rows(cls, rows: list[dict]) -> ForwardCosts:
        def cost(r):
            return Cost(float(r["seconds"]), float(r["iqr_s"]), float(r["ratio_iqr"]))

        target = {int(r["tokens"]): cost(r) for r in rows if r["model"] == "target"}
        draft = [cost(r) for r in rows if r["model"] == "draft"]
        levels = {r["model"]: cost(r) for r in rows if r["model"] in LEVELS}
        return cls(int(rows[0]["context_tokens"]), target, draft[0] if draft else None, int(rows[0]["repeats"]), levels)


# Drafting levels a method may ask measure_costs to time (Method.levels), and how each is built.
LEVELS = {
    "self-sparse": lambda pair, cfg: SparseView(pair.target_lm, cfg.kv_budget, cfg.kv_policy),
    "draft-window": draft_window,
}


def _forward_seconds(
    probes: list[tuple[HFCausalLM, int]], context: torch.Tensor, repeats: int, device: torch.device
) -> list[list[float]]:
    """Seconds of one n-token forward on top of the cache, per repeat and per (model, n) in ``probes``.

    The probes take turns within every repeat, so a change in machine load during the
    measurement moves all of them alike instead of skewing the ratios between them. Two untimed
    rounds first let allocation and the kernel choice for each shape settle.
    """
    steps = []
    for lm, n in probes:

        def step(lm=lm, n=n):
            lm.forward(context[:n], last=n)
            lm.keep([], n)

        steps.append(step)
    times = [[median_run(device, step, 1)[1] for step in steps] for _ in range(2 + repeats)]
    return times[2:]


def measure_costs(pair: Pair, prompt_ids: list[torch.Tensor], cfg: BenchConfig, plan: list[Decoder]) -> ForwardCosts:
    """Single-token forward times of both models and target forward times for 1..max(K+1, COST_SIZES) tokens.

    Measured at the context length decoding actually runs at: the median prompt plus half the
    generated tokens, built from real prompt tokens.
    """
    lengths = sorted(len(ids) for ids in prompt_ids)
    length = lengths[len(lengths) // 2] + cfg.max_new_tokens // 2
    windows = [m.context_window for m in (pair.target, pair.draft) if m is not None and m.context_window]
    room = min(windows, default=length + COST_SIZES) - length  # K + 1 always fits (encode_prompts made sure)
    sizes = range(1, max(cfg.widest, min(COST_SIZES, room)) + 1)
    tokens = torch.cat(prompt_ids)
    context = tokens.repeat(length // len(tokens) + 2)[: length + sizes[-1]]
    prefix, probe = context[:length], context[length:]
    models = [pair.target_lm] + ([pair.draft_lm] if pair.draft_lm else [])
    levels = {name: LEVELS[name](pair, cfg) for step in plan for name in step.method.levels}
    with torch.inference_mode():
        for view in levels.values():
            if isinstance(view, SparseView):
                view.watch()
        for lm in models:
            lm.prefill(prefix)
        for view in levels.values():
            view.prefill(prefix)  # a sparse view is built from the target's cache; a window reads the prefix
        probes = [(pair.target_lm, n) for n in sizes] + [(lm, 1) for lm in [*models[1:], *levels.values()]]
        times = _forward_seconds(probes, probe, cfg.cost_repeats, pair.device)
    costs = []
    for column in zip(*times, strict=True):
        ratios = [t / repeat[0] for t, repeat in zip(column, times, strict=True)]
        costs.append(Cost(metrics.median(column), metrics.iqr(column), metrics.iqr(ratios)))
    draft = costs[len(sizes)] if pair.draft_lm else None
    return ForwardCosts(
        length,
        dict(zip(sizes, costs, strict=False)),
        draft,
        cfg.cost_repeats,
        dict(zip(levels, costs[len(costs) - len(levels) :], strict=True)),
    )


def generator_for(device: torch.device, seed: int, prompt_index: int, method: str) -> torch.Generator:
    """An independent, reproducible random stream per (seed, prompt, method), from a stable hash of
    the three: adding, removing or reordering methods changes no other method's samples."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{method}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


@dataclass
class Measurement:
    """One prompt decoded by one method: the median run of the repeats and its phases."""

    result: DecodeResult
    seconds: float
    phases: Phases


def decode(pair: Pair, cfg: BenchConfig, ids: torch.Tensor, index: int, decoder: Decoder) -> Measurement:
    """Time one prompt's decode cfg.repeats times (each from the same seed, so identical work) and
    keep the median run, phases and all."""
    clock = PhaseClock(pair.device)

    timed = pair.timed(clock)

    def once():
        generator = generator_for(pair.device, cfg.seed, index, decoder.method.name)
        clock.start()
        result = decoder.method.decode(timed, cfg, decoder, ids, generator)
        return result, clock.stop()

    (result, phases), seconds = median_run(pair.device, once, cfg.repeats)
    return Measurement(result, seconds, phases)


def warm_up(pair: Pair, cfg: BenchConfig, prompt_ids: list[torch.Tensor], plan: list[Decoder]) -> None:
    """Untimed runs of every decoder, so allocation, kernel selection and caches settle first (a
    method that learns learns nothing from them: it learns in after_prompt)."""
    for _ in range(cfg.warmup):
        for decoder in [Decoder(BASELINE), *plan]:
            decode(pair, cfg, prompt_ids[0], 0, decoder)


def _totals(m: Measurement) -> dict:
    """The figures of one decode that add up over prompts (metrics.phase_figures reads them)."""
    return {
        "new_tokens": len(m.result.tokens),
        "target_forwards": m.result.target_forwards,
        "draft_forwards": m.result.draft_forwards,
        "method_s": m.seconds,
        "prefill_s": m.phases.prefill,
        "draft_s": m.phases.draft,
        "inner_s": m.phases.inner,
        "verify_s": m.phases.verify,
        "other_s": m.phases.other,
    }


TOTALS = list(_totals(Measurement(DecodeResult([]), 0.0, Phases())))


def record(
    prompt: Prompt,
    index: int,
    ids: torch.Tensor,
    baseline: Measurement,
    decoder: Decoder,
    measured: Measurement,
    learned: Learned | None = None,
) -> dict:
    """The per-prompt, per-decoder row of records.csv (the baseline has its own row, too);
    ``learned`` is what a method that learns did after the prompt."""
    b, s = baseline.result, measured.result
    method, k = decoder.method, decoder.k
    divergence = next((i for i, (x, y) in enumerate(zip(b.tokens, s.tokens, strict=False)) if x != y), None)
    if divergence is None and len(b.tokens) != len(s.tokens):
        divergence = min(len(b.tokens), len(s.tokens))
    drafts = method.drafts
    rate, base_rate = len(s.tokens) / measured.seconds, len(b.tokens) / baseline.seconds
    return {
        "method": method.name,
        "k": k,
        "tree": shape_text(decoder.tree),
        "prompt_id": prompt.id,
        "prompt_index": index,
        "prompt_tokens": len(ids),
        "baseline_tokens": len(b.tokens),
        "baseline_s": baseline.seconds,
        "baseline_tokens_per_s": base_rate,
        "spec_tokens_per_s": rate,
        "speedup": rate / base_rate,
        "alpha": s.beta_sum / s.tested if s.tested else math.nan,
        "acceptance_rate": s.accepted / s.drafted if s.drafted else math.nan,
        "tau": len(s.tokens) / s.target_forwards if drafts else math.nan,
        "nodes": s.drafted / (s.target_forwards - 1) if drafts and s.target_forwards > 1 else math.nan,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "beta_sum": s.beta_sum,
        "tested": s.tested,
        **(_inner(s) if method.inner_level else dict.fromkeys(INNER, math.nan)),
        "train_s": learned.train_s if learned else math.nan,
        **_totals(measured),
        **metrics.phase_figures(_totals(measured), _totals(baseline)),
        "outputs_match": divergence is None,
        "first_divergence": -1 if divergence is None else divergence,
        "accept_hist": " ".join(str(s.accept_counts.count(n)) for n in range(k + 1)) if s.accept_counts else "",
        "rank_hist": " ".join(map(str, s.rank_counts)) if decoder.tree else "",
    }


def _inner(result: DecodeResult) -> dict:
    """The counts of a drafter's bottom level (a cascade's prompt lookup)."""
    return {name: getattr(result, name) for name in INNER}


INNER = ("inner_drafted", "inner_accepted", "from_inner", "inner_forwards")


def shape_text(tree: tuple[int, ...] | None) -> str:
    return ",".join(map(str, tree)) if tree else ""


def summarize(
    records: list[dict], costs: ForwardCosts, cfg: BenchConfig, run_info: dict, plan: list[Decoder]
) -> list[dict]:
    """One summary row per (method, K) over the prompts measured so far, the baseline's first.

    Each row sums its prompts' totals and compares them with the baseline's on the same prompts.
    """
    baselines = {r["prompt_index"]: r for r in records if r["method"] == BASELINE.name}
    rows = []
    for decoder in [Decoder(BASELINE), *plan]:
        method, k, tree = decoder.method, decoder.k, shape_text(decoder.tree)
        rs = [r for r in records if r["method"] == method.name and r["k"] == k and r["tree"] == tree]
        if not rs:
            continue
        run = {name: sum(r[name] for r in rs) for name in TOTALS}
        base = {name: sum(baselines[r["prompt_index"]][name] for r in rs) for name in TOTALS}
        tokens, seconds = run["new_tokens"], run["method_s"]
        base_tokens, base_s = base["new_tokens"], base["method_s"]
        drafts = method.drafts  # only drafting methods; the others' counts are left empty
        chain = drafts and not decoder.tree  # the chain formulas apply
        counted = ("drafted", "accepted", "beta_sum", "tested")
        totals = {name: sum(r[name] for r in rs) for name in counted}
        alpha = totals["beta_sum"] / totals["tested"] if totals["tested"] else math.nan
        c = method.c(costs)
        rounds = run["target_forwards"] - len(rs)
        nodes = totals["drafted"] / rounds if drafts and rounds else math.nan
        verify_ratio = costs.verify_ratio(k if chain else round(nodes)) if not math.isnan(nodes) else math.nan
        divergences = [r["first_divergence"] for r in rs if r["first_divergence"] >= 0]
        trained = sum(r["train_s"] for r in rs) if method.learns else math.nan
        values = {
            **run_info,
            **run,
            **metrics.phase_figures(run, base, len(rs)),
            **{name: sum(r[name] for r in rs) if method.inner_level else math.nan for name in INNER},
            "method": method.name,
            "k": k,
            "tree": tree,
            "options": method.options(cfg),
            "eta": cfg.eta,
            "temperature": cfg.temperature,
            "top_k": cfg.top_k,
            "top_p": cfg.top_p,
            "seed": cfg.seed,
            "max_new_tokens": cfg.max_new_tokens,
            "num_prompts": len(rs),
            "baseline_tokens_per_s": base_tokens / base_s,
            "spec_tokens_per_s": tokens / seconds,
            "speedup": (tokens / seconds) / (base_tokens / base_s),
            "train_s": trained,
            "speedup_with_training": (tokens / (seconds + trained)) / (base_tokens / base_s),
            "alpha": alpha,
            "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else math.nan,
            "tau": tokens / run["target_forwards"] if drafts else math.nan,
            "nodes": nodes,
            "c": c,
            "verify_ratio": verify_ratio,
            "predicted_speedup": metrics.predicted_speedup(alpha, c, k) if chain else math.nan,
            "predicted_speedup_verify": metrics.predicted_speedup_verify(alpha, c, k, verify_ratio)
            if chain
            else math.nan,
            **(totals if drafts else dict.fromkeys(totals, math.nan)),
            "outputs_match": sum(r["outputs_match"] for r in rs),
            "first_divergence": min(divergences, default=-1),
        }
        if cfg.random_weights:
            values.update(dict.fromkeys(WEIGHT_DEPENDENT, math.nan))
        rows.append({name: values[name] for name in schema.SUMMARY})
    return rows


def online_row(rec: dict, learned: Learned) -> dict:
    """online.csv: after each prompt of a method that learns, how its draft did and what it learned."""
    return {
        "method": rec["method"],
        "k": rec["k"],
        "prompt_index": rec["prompt_index"],
        "prompt_id": rec["prompt_id"],
        "alpha": rec["alpha"],
        "acceptance_rate": rec["acceptance_rate"],
        "lessons": learned.lessons,
        "updates": learned.updates,
        "train_s": learned.train_s,
    }


def acceptance_rows(records: list[dict]) -> list[dict]:
    """acceptance.csv: per method, K and tree, how often each draft depth was accepted per verify
    step (``by`` depth), and for trees which sibling an accepted node was (``by`` rank: the share of
    accepted nodes that were the 1st, 2nd, ... child of their parent)."""
    depths: dict[tuple, list[int]] = {}
    ranks: dict[tuple, list[int]] = {}
    for r in records:
        key = (r["method"], r["k"], r["tree"])
        for hists, cell in ((depths, r["accept_hist"]), (ranks, r["rank_hist"])):
            counts = [int(x) for x in cell.split()] if cell else []
            total = hists.setdefault(key, [])
            total += [0] * (len(counts) - len(total))
            hists[key] = [a + b for a, b in zip(total, counts + [0] * (len(total) - len(counts)), strict=True)]
    rows = []
    for (method, k, tree), hist in sorted(depths.items(), key=str):
        for i, rate in enumerate(metrics.acceptance_by_position(hist) if hist else []):
            rows.append(
                dict(method=method, k=k, tree=tree, by="depth", position=i + 1, acceptance=rate, verify_steps=sum(hist))
            )
        for i, count in enumerate(ranks[(method, k, tree)]):
            share = count / sum(ranks[(method, k, tree)])
            rows.append(
                dict(method=method, k=k, tree=tree, by="rank", position=i + 1, acceptance=share, verify_steps=sum(hist))
            )
    return rows


def predicted_by_k(alpha: float, c: float, costs: ForwardCosts) -> dict[int, float]:
    """predicted_speedup_verify at every K whose verification cost was measured (1..max K), so a
    one-K run can say whether a smaller K would have done better."""
    return {
        k: metrics.predicted_speedup_verify(alpha, c, k, costs.verify_ratio(k)) for k in range(1, max(costs.target))
    }


def predicted_rows(alphas: list[float], costs: ForwardCosts) -> list[dict]:
    """predicted.csv: the speedup an assumed alpha would give at each K whose verification cost was
    measured, from the measured forward costs (for random weights, where alpha means nothing)."""
    return [
        {
            "alpha": alpha,
            "k": k,
            "c": costs.c,
            "verify_ratio": costs.verify_ratio(k),
            "predicted_speedup": metrics.predicted_speedup(alpha, costs.c, k),
            "predicted_speedup_verify": metrics.predicted_speedup_verify(alpha, costs.c, k, costs.verify_ratio(k)),
        }
        for alpha in alphas
        for k in range(1, max(costs.target))
    ]


def best_ks(summary: list[dict]) -> dict:
    """Per method with K: the best K by measured speedup and by each prediction."""
    picks: dict[str, dict] = {}
    for row in summary:
        if not METHODS[row["method"]].takes_k:
            continue
        for label, column in [
            ("measured", "speedup"),
            ("predicted", "predicted_speedup"),
            ("predicted_verify", "predicted_speedup_verify"),
        ]:
            if not math.isnan(row[column]):
                picks.setdefault(row["method"], {}).setdefault(label, {"by_k": {}})["by_k"][row["k"]] = row[column]
    for by_label in picks.values():
        for pick in by_label.values():
            pick["k"] = metrics.best_k(pick["by_k"])
            pick["speedup"] = pick["by_k"][pick["k"]]
    return picks


def suggestions(summary: list[dict], costs: ForwardCosts, ks: list[int]) -> list[str]:
    """After a one-K run: where the measured alpha and costs predict a better K, say so."""
    if len(ks) != 1:
        return []
    lines = []
    for row in summary:
        if not METHODS[row["method"]].takes_k or math.isnan(row["alpha"]) or math.isnan(row["c"]):
            continue
        by_k = predicted_by_k(row["alpha"], row["c"], costs)
        best = metrics.best_k(by_k)
        if best != ks[0]:
            lines.append(
                f"{row['method']}: at this alpha and the measured forward costs, K={best} predicts {by_k[best]:.2f}x "
                f"against {by_k[ks[0]]:.2f}x at K={ks[0]}: `specbench run --k 1,2,3,4` measures each K"
            )
    return lines


NOISY = 0.1  # a forward-cost ratio whose interquartile range exceeds this share of it is noisy


def noisy_costs(costs: ForwardCosts) -> list[str]:
    """A warning when the forward costs moved too much between repeats to be trusted."""
    one = costs.target[1].seconds
    noisy = [n for n, cost in costs.target.items() if cost.ratio_iqr > NOISY * cost.seconds / one]
    if not noisy:
        return []
    return [
        f"forward costs are noisy (the ratio's interquartile range is over {NOISY:.0%} of it at {noisy} tokens, "
        f"see verify_cost.csv): the machine is busy, or torch runs more threads ({torch.get_num_threads()}) than "
        "there are free cores: try --threads 1"
    ]


def prepare(cfg: BenchConfig) -> tuple[Pair, list[Prompt], list[torch.Tensor]]:
    """Validate, load the pair and the prompts; every input error surfaces here, before timing."""
    cfg.validate()
    prompts = load_prompts(cfg.dataset, cfg.num_prompts, cfg.prompt_field, cfg.context_tokens, cfg.seed)
    pair = load_pair(cfg)
    return pair, prompts, encode_prompts(pair, prompts, cfg)


# ---------------------------------------------------------------- the whole run


@dataclass
class Step:
    """What the benchmark is doing: a stage, and for decoding how far it got."""

    stage: str
    done: int = 0
    total: int = 0
    label: str = ""


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
    if resume and cfg.learns:
        raise SpecbenchError(
            "--resume cannot restore what --method online learned before the interruption: run it again without --resume"
        )
    writer = report.RunWriter(out)  # fails on an unusable directory before anything is loaded
    previous = writer.previous_run(cfg.as_dict()) if resume else None
    yield Step("loading models and prompts")
    pair, prompts, prompt_ids = prepare(cfg)
    for lm in (pair.target_lm, pair.draft_lm):
        if lm is not None:
            lm.prefill_chunk, lm.progress = cfg.prefill_chunk, prefill_progress
    run_hash = prompts_hash(prompt_ids)
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
        "prompts_hash": run_hash,
    }
    resolved = {
        **run_info,
        "target_path": str(pair.target.path),
        "draft_path": str(pair.draft.path) if pair.draft else None,
        "weights": "random" if cfg.random_weights else "checkpoint",
        # Where accelerate put each module of the target (None: all on the device above).
        "device_map": placement(pair.target.model) if cfg.device_map else None,
    }
    writer.write_json("meta.json", {**environment(pair.device), "config": cfg.as_dict(), "resolved": resolved})

    plan = cfg.plan  # one plan for the run: a method that learns keeps its state in its decoder
    for step in plan:
        step.method.begin_run(pair, cfg, step)
    if previous is not None and previous.costs:
        costs = ForwardCosts.from_rows(previous.costs)
    else:
        yield Step("measuring forward costs (c, verify_ratio)")
        costs = measure_costs(pair, prompt_ids, cfg, plan)
        writer.write_csv("verify_cost.csv", costs.rows())
    done = previous.complete_prompts(1 + len(plan)) if previous is not None else set()
    records = writer.start_records([r for r in previous.records if r["prompt_index"] in done] if previous else [], done)
    todo = [i for i in range(len(prompts)) if i not in done]
    if todo:  # a resumed run with nothing left to decode only writes its summary again
        yield Step("warming up")
        warm_up(pair, cfg, prompt_ids, plan)
    total, finished, written = len(todo) * (1 + len(plan)), 0, time.monotonic()
    learning: list[dict] = []  # online.csv
    try:
        for index in todo:
            prompt, ids = prompts[index], prompt_ids[index]
            baseline = decode(pair, cfg, ids, index, Decoder(BASELINE))
            for decoder in [Decoder(BASELINE), *plan]:
                measured = baseline if decoder.method is BASELINE else decode(pair, cfg, ids, index, decoder)
                learned = decoder.method.after_prompt(decoder, ids, measured.result)
                tokens = measured.result.tokens
                text = pair.target.tokenizer.decode(tokens) if pair.target.tokenizer else ""
                writer.output(prompt.id, index, decoder.k, decoder.method.name, tokens, text, shape_text(decoder.tree))
                records.append(record(prompt, index, ids, baseline, decoder, measured, learned))
                if cfg.random_weights:
                    records[-1].update((name, math.nan) for name in WEIGHT_DEPENDENT if name in records[-1])
                writer.append_record(records[-1])
                if learned is not None:
                    learning.append(online_row(records[-1], learned))
                    writer.write_csv("online.csv", learning)
                finished += 1
                yield Step("decoding", finished, total, decoder.label)
                if time.monotonic() - written > SUMMARY_EVERY_S:
                    writer.write_csv("summary.csv", summarize(records, costs, cfg, run_info, plan))
                    written = time.monotonic()
    finally:
        summary = summarize(records, costs, cfg, run_info, plan)
        writer.write_csv("summary.csv", summary)
        writer.write_csv("acceptance.csv", acceptance_rows(records))
        writer.close()
        if cfg.save_draft:  # what was learned is kept, also when the run was interrupted
            learners = [step for step in plan if step.method.learns]
            for step in learners:
                step.method.save(step, Path(cfg.save_draft) / (f"k{step.k}" if len(learners) > 1 else ""))
    picks = {} if cfg.random_weights else best_ks(summary)
    predicted = predicted_rows(cfg.assume_alpha, costs) if costs.draft_single is not None else []
    if predicted:
        writer.write_csv("predicted.csv", predicted)
    from .plot import plot_online, plot_phases, plot_run

    if picks:
        writer.write_json("best_k.json", picks)
    plots = (
        [path for path in (plot_phases(out), plot_run(out), plot_online(out)) if path is not None] if summary else []
    )
    title = f"{cfg.target} <- {cfg.draft}" if pair.draft else cfg.target
    if cfg.random_weights:
        lengths = f"{cfg.prompt_tokens} tokens" if cfg.prompt_tokens else f"{cfg.dataset}'s lengths"
        title += f" with random weights ({len(prompts)} random prompts of {lengths})"
    else:
        title += f" on {cfg.dataset} ({len(prompts)} prompts)"
    notes = suggestions(summary, costs, cfg.ks) + noisy_costs(costs)
    yield Results(out, title, summary, picks, notes, plots, cfg.sampling.greedy, predicted)
