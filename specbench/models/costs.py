"""Forward costs: how long one forward of each model takes, measured where decoding runs.

verify_cost.csv, c and verify_ratio come from here: single-token forwards of the target, the draft
and each drafting level a method uses, and target forwards of 1..K+1 tokens, timed in turns. So does
the bound a one-token step works against: the device's copy bandwidth, and the bytes a target step
reads (the summary's baseline_mbu).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specbench.core import metrics
from specbench.decoding.timing import synchronize
from specbench.models.lm import HFCausalLM, SparseView
from specbench.models.load import available_memory
from specbench.models.pair import Pair
from specbench.models.vocab import VocabView


def seconds_of(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, with the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


# The copy that copy_bandwidth times: buffers larger than any cache (a CPU's last level, a GPU's L2),
# with room for both left beside the loaded models.
COPY_BYTES = {"cuda": 2**30}  # a GiB, as benchmarks/gpu_check.py first measured it
CPU_COPY_BYTES = 2**28  # 256 MiB: 0.22 s for the whole measurement on the 2-core AMD EPYC
COPY_LEAST = 2**26  # never below this: a smaller buffer would be timed from a cache


def copy_bandwidth(device: torch.device | str, repeats: int = 10) -> float:
    """Bytes per second that copying one buffer into another moves on ``device``, read and written
    counted: the median of ``repeats`` timed copies after two untimed ones, each synchronised. The
    buffers are COPY_BYTES (a quarter of the free memory where that is less, but at least
    COPY_LEAST); the source is written first, since pages never written all read as the kernel's
    one zero page, from the cache. On a CPU the copy runs on torch's threads, as the run's forwards do."""
    device = torch.device(device)
    size = COPY_BYTES.get(device.type, CPU_COPY_BYTES)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    if free:
        size = max(COPY_LEAST, min(size, free // 4))
    source = torch.ones(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = [copy_seconds(device, target, source) for _ in range(2 + repeats)][2:]
    return 2 * size / metrics.median(times)


def copy_seconds(device: torch.device, target: torch.Tensor, source: torch.Tensor) -> float:
    """Seconds of one copy of ``source`` into ``target``. On CUDA the device's own time, between two
    events on its stream: a host timer around synchronisations adds their latency, a few percent of
    a GiB's copy on an H100, which would read the bandwidth low and every MBU against it high."""
    if device.type != "cuda":
        return seconds_of(device, lambda: target.copy_(source))
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    target.copy_(source)
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # milliseconds


@dataclass(frozen=True)
class Roofline:
    """What bounds the target's one-token step: the device's copy bandwidth, and the bytes the step
    reads (streamed_bytes). The summary's baseline_mbu is the baseline's decode read against it."""

    bandwidth: float  # bytes per second (copy_bandwidth)
    weight_bytes: int  # the target's weights one step reads (streamed_bytes)
    kv_bytes_per_token: int  # the KV cache one step reads per token of context


def streamed_bytes(model) -> tuple[int, int]:
    """(weight bytes, KV cache bytes per token of context) that one one-token forward of the
    transformers ``model`` reads, as loaded (each parameter's own dtype). Every parameter is read
    once, except the input embedding, of which a step reads one row: where the LM head is tied to it,
    the head reads the matrix whole, once. The cache: a key and a value per layer and key/value head,
    in the model's dtype, every layer attending over the whole context (0 where the configuration
    does not name its layers and heads)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head is one parameter
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not embedding:
        weights -= (embedding.numel() - embedding.shape[-1]) * embedding.element_size()
    config = model.config.get_text_config()
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads if heads else 0)
    if not layers or not head_dim:
        return weights, 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return weights, 2 * layers * kv_heads * head_dim * model.dtype.itemsize


def roofline(pair: Pair, bandwidth: float | None = None) -> Roofline:
    """The target's Roofline on the pair's device, its copy ``bandwidth`` measured now unless given (a
    resumed run's, which its first records were measured against)."""
    weights, kv = streamed_bytes(pair.target.model)
    return Roofline(bandwidth or copy_bandwidth(pair.device), weights, kv)


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
    levels: dict[str, Cost] = field(default_factory=dict)  # one-token forwards of drafting levels (Method.levels)

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
        levels = {r["model"]: cost(r) for r in rows if r["model"] not in ("target", "draft")}
        return cls(int(rows[0]["context_tokens"]), target, draft[0] if draft else None, int(rows[0]["repeats"]), levels)


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
    times = [[seconds_of(device, step) for step in steps] for _ in range(2 + repeats)]
    return times[2:]


def measure_costs(
    pair: Pair, prompt_ids: list[torch.Tensor], levels: dict[str, HFCausalLM], widest: int, generated: int, repeats: int
) -> ForwardCosts:
    """Single-token forward times of both models and of each drafting ``levels`` model (by name, built
    as its method builds it), and target forward times for 1..max(``widest``, COST_SIZES) tokens.

    Measured at the context length decoding actually runs at: the median prompt plus half the
    ``generated`` tokens, built from real prompt tokens; ``repeats`` timed rounds.
    """
    lengths = sorted(len(ids) for ids in prompt_ids)
    length = lengths[len(lengths) // 2] + generated // 2
    windows = [m.context_window for m in (pair.target, pair.draft) if m is not None and m.context_window]
    room = min(windows, default=length + COST_SIZES) - length  # K + 1 always fits (encode_prompts made sure)
    sizes = range(1, max(widest, min(COST_SIZES, room)) + 1)
    # On the device, as the loop's forwards read their ids (drafted tokens never leave it): ids on the
    # host would add a copy from pageable memory, and a wait for it, to every forward timed.
    tokens = torch.cat(prompt_ids).to(pair.device)
    context = tokens.repeat(length // len(tokens) + 2)[: length + sizes[-1]]
    prefix, probe = context[:length], context[length:]
    models = [pair.target_lm] + ([draft_reading_target_ids(pair)] if pair.draft_lm else [])
    with torch.inference_mode():
        for view in levels.values():
            if isinstance(view, SparseView):
                view.watch()
        for lm in models:
            lm.prefill(prefix)
        for view in levels.values():
            view.prefill(prefix)  # a sparse view is built from the target's cache; a window reads the prefix
        probes = [(pair.target_lm, n) for n in sizes] + [(lm, 1) for lm in [*models[1:], *levels.values()]]
        times = _forward_seconds(probes, probe, repeats, pair.device)
    costs = []
    for column in zip(*times, strict=True):
        ratios = [t / repeat[0] for t, repeat in zip(column, times, strict=True)]
        costs.append(Cost(metrics.median(column), metrics.iqr(column), metrics.iqr(ratios)))
    draft = costs[len(sizes)] if pair.draft_lm else None
    return ForwardCosts(
        length,
        dict(zip(sizes, costs, strict=False)),
        draft,
        repeats,
        dict(zip(levels, costs[len(costs) - len(levels) :], strict=True)),
    )


def draft_reading_target_ids(pair: Pair):
    """The draft model as the cost measurement feeds it the target's ids: itself, or for a draft with
    its own tokenizer its models/vocab.VocabView, which reads them as its own ids, as the methods that
    cross vocabularies draft."""
    if pair.bridge is None:
        return pair.draft_lm
    return VocabView(pair.draft_lm, pair.bridge, pair.target_lm.width)


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
