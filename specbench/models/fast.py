"""specbench's own forward for Llama-shaped models (Llama, Mistral, Qwen2, Qwen3): the fast path (``--compile``), and
the static path's arithmetic (models/static.py).

transformers' eager modeling runs each linear layer through a plain matrix product. On a CPU
that product streams the weights in a layout that suits neither one row nor a few: on the 2-core
AMD EPYC the LM head of SmolLM2-135M took 9.6 ms for one row, 22 ms for two and 32 ms for three,
so a 3-token verification cost two one-token forwards. Here every weight is reordered once, at
load, into oneDNN's blocked layout (what inductor's weight freezing does inside torch.compile):
the same head then takes about 4 ms for any of 1 to 8 rows, the one-token forward half the time
(29.9 against 59.8 ms), and forwards of 2 to 6 tokens about as long as one. Where a CPU's own
kernels run a row count faster on the modules' own weights (a Xeon's MKL, for one to three rows), the
plan measured at load runs it there (row_plan). On CUDA the
elementwise work is compiled by torch.compile (inductor), which fuses the small kernels that
bound an eager forward at batch 1; on an H100 that did not pay for a 7B target, whose steps are
bound by launches (docs/results.md, On a GPU).

The forward is written against the transformers model's own modules and cache object, so
everything the decode loop does with a cache (append, crop, keep a tree path, the partial views of
models/lm.py) works unchanged, and the arithmetic is transformers' own: with the plain weights its
logits are bit-identical to the eager model's (a test checks); the packed kernels move them by
float rounding only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specbench.core.errors import first_said
from specbench.decoding.sampling import as_float32
from specbench.models.load import available_memory

log = logging.getLogger("specbench")

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # static: inv_freq is fixed at load
# Llama's decoder and its kin: Mistral's is Llama's with a sliding window (covered without one), Qwen2's
# adds biases to the query, key and value products (Llama's attention_bias and mlp_bias add their own),
# Qwen3's norms each head's queries and keys before RoPE.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported(model) -> str | None:
    """Why ``model`` cannot take the fast path, or None when it can."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"the fast path covers {', '.join(FAMILIES[:-1])} and {FAMILIES[-1]} models, not {config.model_type}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"the fast path covers models with SiLU, not {config.hidden_act}"
    if sliding_window(config) is not None or set(getattr(config, "layer_types", None) or ["full_attention"]) != {
        "full_attention"
    }:
        return "the fast path covers full attention in every layer, not sliding windows"
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        return "the fast path covers LM heads without a bias"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in ROPE_TYPES:
        return f"the fast path covers static RoPE ({', '.join(ROPE_TYPES)}), not {rope}"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "the fast path runs a model on one device, not spread by --device-map"
    return None


def sliding_window(config) -> int | None:
    """The window that some of ``config``'s layers attend over, None where every layer sees the whole
    context: transformers' Mistral slides every layer whenever it has a window, other families the
    layers that layer_types names."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    kinds = getattr(config, "layer_types", None)
    if window is None or (kinds is not None and config.model_type != "mistral" and "sliding_attention" not in kinds):
        return None
    return window


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered for oneDNN's linear kernel (CPU). The layout depends on the
    row count it is packed for: packed for one row, SmolLM2-135M's linears took 27 ms for one row
    and 38 for five on the 2-core AMD EPYC; packed for eight, 23 and 19."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PLANNED_UP_TO)


@dataclass(frozen=True)
class Rows:
    """How a CPU runs a product of some row count: with ``count`` rows (zeros padded past the input's,
    their outputs dropped), on the packed copy of the weights or on the modules' own."""

    count: int
    packed: bool

    def __str__(self) -> str:
        return f"{self.count} {'packed' if self.packed else 'own'}"


@dataclass
class Linear:
    """Linear maps with one input, their outputs concatenated (q, k and v; gate and up), over the
    modules' own weights, shared rather than copied (a GPU holds the weights once) and, where asked
    (a CPU), a packed copy for oneDNN: one weight for all (new memory either way). ``plan`` says how a
    CPU runs a product of n rows (row_plan; a count it lacks runs as it comes, packed where there is a
    copy). ``biases``: one per weight (None: none); ``packed_bias``: the packed product's, for the
    concatenated outputs."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    plan: dict[int, Rows]
    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None

    @classmethod
    def of(cls, *weights: torch.Tensor, packed: bool, plan: dict[int, Rows], biases=None) -> Linear:
        weights = [w.detach() for w in weights]
        biases = [None if b is None else b.detach() for b in biases or [None] * len(weights)]
        if not packed:
            return cls(weights, biases, plan)
        bias = None
        if any(b is not None for b in biases):  # the outputs without one add zeros
            bias = torch.cat(
                [w.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases, strict=True)]
            )
        return cls(weights, biases, plan, pack(torch.cat(weights)), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The plan is empty on CUDA and where the forward is compiled: a count's lookup would guard on it.
        return self.run(x, self.plan.get(x.shape[0]) if self.plan else None)

    def run(self, x: torch.Tensor, how: Rows | None) -> torch.Tensor:
        """The product of ``x`` run as ``how`` says (None: as it comes, packed where there is a copy)."""
        rows = x.shape[0]
        count, packed = (rows, self.packed is not None) if how is None else (how.count, how.packed)
        if count > rows:
            x = F.pad(x, (0, 0, 0, count - rows))
        if packed:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.packed_bias, "none", [], "")
        elif len(self.weights) == 1:
            out = F.linear(x, self.weights[0], self.biases[0])
        else:
            out = torch.cat([F.linear(x, w, b) for w, b in zip(self.weights, self.biases, strict=True)], dim=-1)
        return out[:rows] if count > rows else out

    @property
    def bytes(self) -> int:
        """What a product reads: the weights once."""
        return sum(w.numel() * w.element_size() for w in self.weights)


PLANNED_UP_TO = 8  # the row counts planned (a verification's sizes); products may run with more rows
PLAN_GAIN = 0.9  # a simpler way stands when the fastest takes more than this share of its time
# The row counts are timed over the first layers' products whose weights reach this many bytes (and
# the LM head): more than a CPU's caches hold, so they stream from memory as the forward's do, and all
# of a SmolLM2-135M's; a 7B's 13 GB would take half a minute a way.
PLAN_SAMPLE_BYTES = 2**30


def row_plan(linears: list[Linear], dtype: torch.dtype, repeats: int = 5) -> dict[int, Rows]:
    """For each row count n up to PLANNED_UP_TO, how its products run fastest: on the packed copy
    (where ``linears`` have one) or on the modules' own weights, with n rows or padded to more,
    measured on ``linears`` (all of a model's, in forward order) with zero inputs.

    oneDNN picks its kernel by the row count, and on a CPU the choice is uneven: on the 2-core
    AMD EPYC SmolLM2-135M's packed linears took 22.7 ms for one row, 26.5 for two and 19-20 for three
    to six, so a one-token forward is faster with its row padded to four. And which weights are
    faster depends on the CPU: on that AMD EPYC the packed ones (a one-token forward took 19 ms against
    36 on the modules' own); on a 2-core Xeon with AMX the own ones for one to three rows, which MKL
    runs (the linears of one row took 30 ms against 41 packed), and the packed ones from four rows (40
    against 53). The ways take turns within every repeat, so a change in machine load moves them alike."""
    sizes = range(1, PLANNED_UP_TO + 1)
    ways = [Rows(n, packed) for n in sizes for packed in ((True, False) if linears[0].packed is not None else (False,))]
    widths = {linear.weights[0].shape[1] for linear in linears}
    inputs = {(n, width): torch.zeros(n, width, dtype=dtype) for n in sizes for width in widths}

    def stack(how: Rows) -> None:
        for linear in linears:
            linear.run(inputs[how.count, linear.weights[0].shape[1]], how)

    seconds = {how: [] for how in ways}
    for repeat in range(repeats + 1):  # the first round lets each way's kernel settle
        for how in ways:
            start = time.perf_counter()
            stack(how)
            if repeat:
                seconds[how].append(time.perf_counter() - start)
    return fastest_ways({how: sorted(times)[len(times) // 2] for how, times in seconds.items()})


def plan_sample(layers: list[Linear], head: Linear) -> list[Linear]:
    """What row_plan times: ``layers`` (a model's products in forward order) up to the first whose
    weights bring the total to PLAN_SAMPLE_BYTES, then ``head``."""
    sample, total = [], 0
    for linear in layers:
        if total >= PLAN_SAMPLE_BYTES:
            break
        sample.append(linear)
        total += linear.bytes
    return [*sample, head]


def fastest_ways(seconds: dict[Rows, float]) -> dict[int, Rows]:
    """For each row count n, how to run n rows, of the ways timed in ``seconds`` (a count of at least n,
    packed or own): the simplest whose time is within 1 / PLAN_GAIN of the fastest's, simplest meaning
    as n comes (packed, where ``seconds`` has packed ways), then the other weights, then each padded
    count in turn. So noise between two ways that take about as long does not choose between them."""
    packed = any(how.packed for how in seconds)
    plan = {}
    for n in sorted({how.count for how in seconds}):
        ways = sorted((how for how in seconds if how.count >= n), key=lambda how: (how.count, how.packed != packed))
        fastest = min(seconds[how] for how in ways)
        plan[n] = next(how for how in ways if PLAN_GAIN * seconds[how] <= fastest)
    return plan


def join(modules: Sequence[torch.nn.Module], name: str) -> torch.Tensor:
    """The parameters ``name`` of ``modules`` as one tensor, concatenated along the first dimension, with
    each module's own parameter made a view of its rows: the weights stay held once, and one product
    over them reads what the modules' several did, in one launch instead of several (q, k and v of a 7B
    layer: three products of 32 MB, or one of 96). Parameters that are such views already (a forward
    built again over the same model) are joined without a copy."""
    parts = [getattr(m, name).detach() for m in modules]
    rows = sum(p.shape[0] for p in parts)
    first = parts[0]
    offsets = [first.storage_offset() + sum(p.numel() for p in parts[:i]) for i in range(len(parts))]
    if all(
        p.is_contiguous()
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.storage_offset() == o
        for p, o in zip(parts, offsets, strict=True)
    ):
        return first.as_strided((rows, *first.shape[1:]), first.stride())
    whole = torch.cat(parts)
    start = 0
    for module, part in zip(modules, parts, strict=True):
        getattr(module, name).data = whole[start : start + part.shape[0]]
        start += part.shape[0]
    return whole


@dataclass
class Layer:
    attention_norm: torch.Tensor
    qkv: Linear
    out: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    query_norm: torch.Tensor | None = None  # Qwen3's per-head norms of queries and keys [head_dim]
    key_norm: torch.Tensor | None = None


# Models narrower than this run on their own weights. oneDNN's packed call has a fixed cost that a
# narrow model's products never repay: on the 2-core Xeon @ 2.50GHz, one row through a [192, 64]
# weight took 16 us own and 107 us packed, through [384, 128] 23 and 51 us. A decode of the tests'
# 32- to 128-wide models is mostly such calls. From 256 wide (the shipped draft, SmolLM2 and every
# target alias) the weights are packed, as docs/results.md's figures of real models were measured.
PACKED_FROM_WIDTH = 256


def packable(model, width: int) -> bool:
    """Whether oneDNN's packed kernels suit ``model``, ``width`` wide: on a CPU, in float32 or bfloat16,
    at least PACKED_FROM_WIDTH wide (memory aside)."""
    cpu, dtype = model.device.type == "cpu", model.dtype
    return (
        cpu
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and width >= PACKED_FROM_WIDTH
    )


def can_pack(model, width: int) -> bool:
    """Whether ``model``'s weights, ``width`` wide, are held packed for oneDNN: packable, with memory for
    the packed copy (transformers' modules keep theirs: hf-generate runs on them)."""
    if not packable(model, width):
        return False
    dtype = model.dtype
    need, free = sum(p.numel() for p in model.parameters()) * dtype.itemsize, available_memory()
    if free is not None and need > 0.8 * free:
        log.warning(
            "no memory for a packed copy of the weights (%.1f of %.1f GB free): the fast path runs unpacked",
            need / 1e9,
            free / 1e9,
        )
        return False
    return True


class FastLlama:
    """A Llama-shaped model's decoder (FAMILIES), run by specbench: ``hidden(ids, positions, cache, mask)`` returns
    the final normed hidden states, as ``model.model(...).last_hidden_state`` would."""

    def __init__(
        self,
        model,
        packed: bool | None = None,
        compiled: bool | None = None,
        plan: dict[int, Rows] | None = None,
        joined: bool | None = None,
    ):
        """``packed`` and ``compiled`` None: as suits the device (can_pack; compiled on CUDA). ``plan``:
        how products of each row count run, measured before for this model (a rebuild); None: measured
        here where a CPU's kernels call for it. ``joined``: products of one input (q, k and v; gate and
        up) on the modules' own weights run as one, over one weight that the modules' own parameters
        become views of (join); None: on CUDA, where every product is a launch. Not on a CPU: there the
        weights are mapped from their file, and joining them copies them into new memory (the
        CI benchmark's peak rose from 1.97 to 2.16 GB), for products the plan runs one to three rows
        of at most."""
        start = time.perf_counter()
        config, base = model.config, model.model
        self.device, self.dtype = model.device, model.dtype
        self.packed = can_pack(model, config.hidden_size) if packed is None else packed
        self.joined = self.device.type == "cuda" if joined is None else joined
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.embedding = base.embed_tokens.weight.detach()
        self.rotary = base.rotary_emb
        self.norm = base.norm.weight.detach()
        self.plan: dict[int, Rows] = {}  # rows -> how their products run (row_plan), shared by every Linear
        self.layers = [
            Layer(
                layer.input_layernorm.weight.detach(),  # plain tensors, as self.norm: one compiled graph for all
                self.products(attention.q_proj, attention.k_proj, attention.v_proj),
                self.products(attention.o_proj),
                layer.post_attention_layernorm.weight.detach(),
                self.products(layer.mlp.gate_proj, layer.mlp.up_proj),
                self.products(layer.mlp.down_proj),
                *[
                    norm.weight.detach()
                    for norm in (getattr(attention, "q_norm", None), getattr(attention, "k_norm", None))
                    if norm is not None
                ],
            )
            for layer, attention in ((layer, layer.self_attn) for layer in base.layers)
        ]
        self.head = self.linear(model.get_output_embeddings().weight)
        # Packed, or left unpacked for want of memory: a CPU's kernels choose by the row count either way
        # (a 7B's bfloat16 products ran one row 12% slower than two on the 2-core AMD EPYC). A forward
        # asked to run unpacked (the static path, tests of transformers' arithmetic) runs as it comes.
        if plan is not None:
            self.plan.update(plan)
        elif self.packed or (packed is None and packable(model, config.hidden_size)):
            linears = [m for layer in self.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down)]
            self.plan.update(row_plan(plan_sample(linears, self.head), self.dtype))
        self.intermediate = config.intermediate_size
        self._rms, self._rope, self._swiglu = rms_norm, rope, swiglu
        self.compiled = self.device.type == "cuda" if compiled is None else compiled
        if self.compiled:  # the elementwise work around the matrix products, fused (launches bound batch 1)
            self.compiled = self._compile()
        self.build_seconds = time.perf_counter() - start  # compiling included: it never lands in a timed decode

    def _compile(self) -> bool:
        """Compile the elementwise functions and run them once at each shape class the loop uses (one
        token; several, which dynamic shapes cover with one graph), so that compilation happens here,
        before anything is timed, and not lazily in the first forward (a decode timed with --warmup 0).
        Whether it worked: a missing compiler or Triton is one log line, and the eager functions run."""
        try:
            compiled = tuple(torch.compile(f, dynamic=True) for f in (rms_norm, rope, swiglu))
            for n in (1, 2):
                self._warm(n, *compiled)
        except Exception as e:  # noqa: BLE001 - whatever the compiler raises, the eager path still runs
            reason = first_said(e)
            log.warning("torch.compile failed, the fast path runs its elementwise work eagerly: %s", reason)
            return False
        self._rms, self._rope, self._swiglu = compiled
        return True

    @torch.inference_mode()  # as the loop decodes: grad mode is part of what a compiled graph guards on
    def _warm(self, n: int, rms, rotate, gated) -> None:
        """Each compiled function once on zeros shaped as in an ``n``-token forward."""
        hidden = self.embedding.shape[1]
        x = torch.zeros(n, hidden, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(x, torch.arange(n, device=self.device)[None])
        qkv = torch.zeros(n, (self.heads + 2 * self.kv_heads) * self.head_dim, dtype=self.dtype, device=self.device)
        rms(x, self.norm, self.eps)
        first = self.layers[0]
        if first.query_norm is not None:  # Qwen3's per-head norms: over head views of the fused product
            heads, kv, d = self.heads, self.kv_heads, self.head_dim
            rms(qkv[:, : heads * d].view(n, heads, d), first.query_norm, self.eps)
            rms(qkv[:, heads * d : (heads + kv) * d].view(n, kv, d), first.key_norm, self.eps)
        rotate(qkv, cos[:, None], sin[:, None], self.heads, self.kv_heads, self.head_dim)
        gated(torch.zeros(n, 2 * self.intermediate, dtype=self.dtype, device=self.device))

    def linear(self, *weights: torch.Tensor) -> Linear:
        """The linear maps of ``weights`` (same input) as this forward runs them."""
        return Linear.of(*weights, packed=self.packed, plan=self.plan)

    def products(self, *modules: torch.nn.Linear) -> Linear:
        """The linear ``modules`` (same input), their biases included, as this forward runs them."""
        if self.joined and len(modules) > 1:
            weights, biases = join(modules, "weight"), [None if modules[0].bias is None else join(modules, "bias")]
            return Linear.of(weights, packed=self.packed, plan=self.plan, biases=biases)
        weights, biases = [m.weight for m in modules], [m.bias for m in modules]
        return Linear.of(*weights, packed=self.packed, plan=self.plan, biases=biases)

    @property
    def route(self) -> str:
        """What runs the forward: the compile column's value."""
        return "inductor" if self.compiled else "packed" if self.packed else "own"

    def _decoder_layer(self, x, layer: Layer, i: int, cos, sin, cache, mask, queries):
        n, heads, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = layer.qkv(self._rms(x, layer.attention_norm, self.eps))
        if layer.query_norm is not None:  # Qwen3: each head's query and key normed over head_dim
            q = self._rms(qkv[:, : heads * d].view(n, heads, d), layer.query_norm, self.eps).view(n, heads * d)
            k = self._rms(qkv[:, heads * d : (heads + kv) * d].view(n, kv, d), layer.key_norm, self.eps).view(n, kv * d)
            qkv = torch.cat([q, k, qkv[:, (heads + kv) * d :]], dim=-1)
        if queries is not None:
            queries[i] = qkv[-1, : heads * d].clone()  # before RoPE, as lm.take_queries expects
        q, k, v = self._rope(qkv, cos, sin, heads, kv, d)
        keys, values = cache.update(k, v, i)  # the cache object stays outside compiled code
        attended = attend(q, keys, values, mask)
        x = x + layer.out(attended[0].transpose(0, 1).reshape(n, heads * d))
        gate_up = layer.gate_up(self._rms(x, layer.mlp_norm, self.eps))
        return x + layer.down(self._swiglu(gate_up))

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        mask: torch.Tensor | None,
        last: int,
        queries: list | None = None,
        taps: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """``ids`` [n] at ``positions`` [n] on top of ``cache``; ``mask`` an additive [n, past + n] float
        mask or None (one token, which attends to everything cached). Returns [last, hidden].

        ``taps``' keys name layers whose input (the residual stream, [n, hidden]) is stored under
        them, every row; key len(layers) takes the final normed states (an EAGLE head's features)."""
        x = self.embedding[ids]
        cos, sin = self.rotary(x, positions[None])  # transformers' own tables: same values as eager
        cos, sin = cos[:, None], sin[:, None]
        if mask is not None:
            mask = mask[None, None]
        for i, layer in enumerate(self.layers):
            if taps is not None and i in taps:
                taps[i] = x
            x = self._decoder_layer(x, layer, i, cos, sin, cache, mask, queries)
        if taps is not None and len(self.layers) in taps:
            taps[len(self.layers)] = x = self._rms(x, self.norm, self.eps)
            return x[-last:]
        return self._rms(x[-last:], self.norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, operation for operation (in float32, scaled in the input dtype)."""
    dtype = x.dtype
    x = as_float32(x)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x if dtype == torch.float32 else x.to(dtype))  # a no-op cast still costs a call


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv: int, d: int):
    """Queries, keys and values [1, heads, n, d] from one fused projection [n, (heads + 2 kv) d],
    queries and keys rotated by their positions' ``cos`` and ``sin`` [1, 1, n, d]."""
    n = qkv.shape[0]
    # Queries and keys rotated together: half the operations of rotating each.
    qk = qkv[:, : (heads + kv) * d].view(n, heads + kv, d).transpose(0, 1)[None]
    v = qkv[:, (heads + kv) * d :].view(n, kv, d).transpose(0, 1)[None]
    rotated = qk * cos + _rotate_half(qk) * sin
    return rotated[:, :heads], rotated[:, heads:], v


def kernel_takes_masked_groups(device: torch.device) -> bool:
    """Whether SDPA attends grouped heads under a mask without falling back to its math kernel."""
    return device.type != "cuda"


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, grouped: bool | None = None
) -> torch.Tensor:
    """Attention of queries [b, heads, n, d] over a cache of fewer key/value heads (grouped-query).

    With ``grouped`` the kernel reads each key/value head for its group of queries (enable_gqa): on a
    CPU that saves copying the cache. On CUDA only the flash kernel takes grouped heads, and it takes
    no mask: a masked grouped call (every verification, and every step on the static path, whose
    mask hides stale slots) would fall back to the slow math kernel. So there each key/value head's
    group of queries is folded into one sequence of group * n queries (fold_groups), which the
    memory-efficient kernel attends under the mask without copying the cache; a one-token forward
    without a mask stays grouped, on flash. ``grouped`` None: whichever the device's kernels favour."""
    heads, kv = q.shape[1], keys.shape[1]
    if grouped is None:
        grouped = kernel_takes_masked_groups(q.device)
    if kv == heads:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    if grouped or mask is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return fold_groups(q, keys, values, mask)


def fold_groups(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention as ordinary attention without repeating the cache: query head h reads
    key/value head h // group, so the queries [b, heads, n, d] are viewed as [b, kv, group * n, d]
    (group-major) and the mask [..., n, L] is repeated over the group; what is copied is the mask's
    n * group rows, instead of (group - 1) copies of every cached key and value."""
    b, heads, n, d = q.shape
    kv = keys.shape[1]
    group = heads // kv
    while mask.dim() < 4:
        mask = mask[None]
    if mask.shape[1] != 1:
        raise ValueError(f"a mask per head {tuple(mask.shape)} cannot be folded over grouped heads")
    folded = F.scaled_dot_product_attention(
        q.reshape(b, kv, group * n, d), keys, values, attn_mask=mask.repeat(1, 1, group, 1)
    )
    # reshape, not view: CUDA's memory-efficient kernel lays its output out as [b, group * n, kv, d]
    # transposed, which no view regroups into heads (it then copies the n * heads rows, no more).
    return folded.reshape(b, heads, n, d)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
