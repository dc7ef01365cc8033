"""The static path (--graphs): a KV cache allocated once at the run's longest sequence, forwards
compiled per shape class and, on CUDA, replayed as CUDA graphs.

At batch 1 a GPU forward is bound by reading the weights only when nothing else is: an eager loop
pays one kernel launch per operation on the host, and on an H100 and three H200s llama-7b's step ran
at 10-18% of the copy bandwidth that way (docs/results.md, On a GPU). The systems that reach the
bound (gpt-fast, vLLM, SGLang) do what this module does:

- the cache never moves (decoding.kv.StaticKV): a forward writes its tokens at given slots and
  attends over the whole buffer under a mask that it builds itself on the device from the first
  slot and the tokens' own tree; a rejected draft only moves the host's ``length``, so nothing is
  copied for a chain, and stale slots are masked, then overwritten;
- the forward (models/fast.py's arithmetic, the same weights) is compiled whole, LM head included
  (a shortlisted head scores outside it): one graph for a single token, one with a dynamic token
  count for every wider forward (K + 1 for each K, a tree's size, a draft catching up), so K, prompts
  and rounds never recompile it;
- on CUDA the forwards of 1 to 16 tokens (more where the run verifies more) are captured as CUDA
  graphs over fixed input buffers (a shortlisted head's appending and scoring too), when the
  run reserves its cache, before anything is timed, and a forward is a few copies into them and one
  replay; wider forwards run compiled. The random draws of sampling and the acceptance test stay
  outside, on the run's generators; the host still reads once a round;
- a draft model's chain of K tokens, its forwards after the first and every draw, replays as one
  graph (StaticLM.draft_chain, as SGLang captures a draft's K steps): a small draft's step is mostly
  the host's dispatches, a dozen a token drafted one at a time. Its randomness is drawn outside the
  graph in one call, into the graph's buffer.

An EAGLE head's steps take the same path (models/static_head.py).

A sequence's first forward (its prompt) runs the same forward uncompiled: its length changes with
every prompt, and a graph per length would be captured inside the timed run and hold memory. On a
CPU the path runs compiled without graphs: that is where its exactness and its freedom from
recompilation are tested, and where tests replay its graphs' bookkeeping; it is not the CPU's default.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from specbench.core.errors import first_said
from specbench.decoding.kv import StaticKV, static_mask
from specbench.decoding.sampling import Sampling, draw_chain
from specbench.decoding.transfer import ids_to_device
from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM

log = logging.getLogger("specbench")

GRAPHED_UP_TO = 64  # forwards of at most this many tokens run compiled; wider ones, and prompts, run eagerly
# On CUDA, forwards of 1 to this many tokens at least are captured as graphs at reserve, before anything
# is timed: a run's K + 1, a draft catching up and verify_cost.csv's sizes (models/costs.COST_SIZES)
# fit. A graph holds little (its outputs; the pool is shared), and a capture takes three forwards.
CAPTURED_AT_LEAST = 16
# A draft model's chains of up to this many tokens replay as one CUDA graph each (StaticLM.draft_chain).
CHAINED_UP_TO = 8
DEFAULT_CAPACITY = 1024  # cache positions before the run reserves its own (StaticLM.reserve)
# A reservation is rounded up to a multiple of CAPACITY_STEP, at least CAPACITY_LEAST (cache_positions):
# runs of nearly the same length, and all short ones, then compile the same graphs, which inductor's
# cache serves. The step is small since attention reads every position, the stale ones too: in
# gpu-check's runs (261 tokens) a step of 256 read 512 positions a forward where 320 hold them all.
CAPACITY_STEP = 64
CAPACITY_LEAST = 256


def cache_positions(tokens: int) -> int:
    """The cache positions reserved for sequences of ``tokens`` (before the context window's cap)."""
    return max(CAPACITY_LEAST, -(-tokens // CAPACITY_STEP) * CAPACITY_STEP)


@dataclass
class Slots:
    """The cache as the fast forward's layers see it (``update(keys, values, layer)``): a StaticKV
    written at ``slots``."""

    kv: StaticKV
    slots: torch.Tensor

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int):
        return self.kv.write(layer, self.slots, keys, values)


def step(lm: StaticLM, ids, depth, tree, start, queries: list | None = None, taps: dict | None = None):
    """The final normed states [n, hidden] of ``ids`` [n] written at slots ``start`` [1] onwards, each
    at position start + ``depth`` and seeing the new tokens ``tree`` [n, n] allows; ``queries`` and
    ``taps`` as FastLlama.hidden records them (eager forwards only)."""
    n = ids.shape[0]
    slots = start + torch.arange(n, device=ids.device)
    mask = static_mask(start, tree, lm.kv.capacity, lm.fast.dtype)
    return lm.fast.hidden(ids, start + depth, Slots(lm.kv, slots), mask, n, queries, taps)


def chain_tree(n: int, device, slots: int | None = None) -> torch.Tensor:
    """The tree (static_mask) of a chain of ``n`` new tokens: each sees itself and those before it.
    [n, n], or [n, ``slots``] telling apart that many slots ending with the new ones, all seen before them."""
    slots = n if slots is None else slots
    return torch.ones(n, slots, dtype=torch.bool, device=device).tril(slots - n)


def tapped(lm: StaticLM, ids, depth, tree, start, layers: tuple[int, ...] | None):
    """``step`` compiled, LM head included: every row's logits [n, width], or for a shortlisted head
    (StaticLM.scores_inside) the final normed states; and the inputs of ``layers`` side by side [n,
    len(layers) * hidden] (FastLlama.hidden's taps: an EAGLE head's features), or None without layers."""
    taps = None if layers is None else dict.fromkeys(layers)
    hidden = step(lm, ids, depth, tree, start, None, taps)
    out = lm._fast_head(hidden, ids) if lm.scores_inside else hidden
    return out, None if taps is None else torch.cat([taps[i] for i in layers], dim=-1)


def _one(lm, ids, depth, tree, start, layers):  # a single token, all shapes static
    return tapped(lm, ids, depth, tree, start, layers)


def _many(lm, ids, depth, tree, start, layers):  # 2..GRAPHED_UP_TO tokens: one graph with a dynamic count
    return tapped(lm, ids, depth, tree, start, layers)


def own_code(function: types.FunctionType) -> types.FunctionType:
    """``function`` with a code object of its own. torch.compile keeps compiled graphs on the code
    object, so two models of different shapes (a target and its draft, a Llama and a Qwen3 in one
    process) compiling one function would each recompile the other's graph."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)


def compile_options(device: torch.device) -> dict | None:
    """inductor's options for the static path's forwards on ``device``. On CUDA, coordinate-descent
    tuning of the kernels it generates, as gpt-fast compiles its decoder (82% of an A100's bandwidth
    at batch 1): with it inductor also lowers a product of one row (every product of a one-token
    forward) to a reduction of its own, tuned and fused with the elementwise work around it, instead
    of cuBLAS's kernel, whose one-row products do not reach the bandwidth (torch's
    _inductor/decomposition.py, mm). Compiling takes longer, once. None on a CPU, where the option
    changes nothing."""
    return {"coordinate_descent_tuning": True} if device.type == "cuda" else None


def compile_forms(
    one, many, inputs: Callable[[int], list[tuple[torch.Tensor, list[int]]]], run, what: str, options: dict | None
):
    """``one`` (a single token, every shape static) and ``many`` (2..GRAPHED_UP_TO tokens, the count
    dynamic) compiled with inductor's ``options`` (compile_options), each under its own code object,
    and run once through ``run(form, *tensors)`` on ``inputs(n)`` (each tensor with its token-count
    dimensions) so that compiling happens now. None, with one log line ("torch.compile failed, ``what``
    eagerly: ...") when the compiler fails (no Triton, no C compiler: torch.compile fails at the first call)."""
    forms = (
        torch.compile(own_code(one), fullgraph=True, dynamic=False, options=options),
        torch.compile(own_code(many), fullgraph=True, options=options),  # only the dimensions marked below are dynamic
    )
    try:
        with torch.inference_mode():
            for n, form in ((1, forms[0]), (2, forms[1])):
                tensors = inputs(n)
                if n > 1:
                    for tensor, dims in tensors:
                        torch._dynamo.mark_dynamic(tensor, dims, min=2, max=GRAPHED_UP_TO)
                run(form, *(tensor for tensor, _ in tensors))
    except Exception as e:  # noqa: BLE001 - whatever the compiler raises, the eager path still runs
        reason = first_said(e)
        log.warning("torch.compile failed, %s eagerly: %s", what, reason)
        return None
    return forms


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every CUDA graph on ``device`` is warmed up and captured on."""
    return torch.cuda.Stream(device)


class Graph:
    """``run`` (a compiled forward of one token count) captured as a CUDA graph over fixed input
    ``buffers``; a call copies its inputs into them (None: the buffer already holds it), replays, and
    returns copies of the outputs (a tuple)."""

    def __init__(self, run, buffers: tuple[torch.Tensor, ...], pool):
        self.buffers = buffers
        out = self.capture(run, pool)
        self.out = out if isinstance(out, tuple) else (out,)

    def capture(self, run, pool):
        """Run ``run`` twice over the buffers (its kernels chosen and compiled), then record it (a capture
        computes nothing) and return the outputs, tensors that every replay writes again. The CUDA half
        of the class, with ``replay``: tests replay a Graph on the CPU by overriding the two."""
        device = self.buffers[0].device
        side = capture_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # capture needs the kernels chosen and compiled first
            for _ in range(2):
                run(*self.buffers)
        current = torch.cuda.current_stream(device)
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        try:
            # Captured on the side stream, which is on the model's device: torch's own capture stream is
            # made once, on whichever device was current then, and captures nothing of a model on another.
            # One stream for every capture on a device: the graphs sharing a pool reuse each other's
            # scratch memory only where they were captured on the same stream.
            with torch.cuda.graph(self.graph, pool=pool, stream=side):
                return run(*self.buffers)
        except Exception:
            # When the capture fails, torch raises on ending it (cudaStreamEndCapture) before it makes the
            # capture stream current no more and before it tells its allocator the capture is over: the
            # compiled forwards that run instead must run where the loop's run, and an allocator still
            # capturing would assert at every later empty_cache (each capture begins with one) and never
            # free its cached blocks to retry an allocation. (A second ending, where torch's came, raises.)
            torch.cuda.set_stream(current)
            with contextlib.suppress(RuntimeError):
                torch._C._cuda_endAllocateToPool(device.index, pool)
            raise

    def replay(self) -> None:
        self.graph.replay()

    def __call__(self, *inputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        for buffer, value in zip(self.buffers, inputs, strict=True):
            if value is not None:
                buffer.copy_(value)
        self.replay()
        return tuple(None if out is None else out.clone() for out in self.out)  # the next replay overwrites them


def replay_inputs(graph: Graph, depth, tree, chain: Callable[[], tuple]) -> tuple:
    """The depth and tree a forward copies into ``graph``'s buffers: a tree's own; for a chain (``depth``
    None) nothing where they hold a chain's already (captured over one, or the last replay was one),
    else ``chain()``'s."""
    held_chain = getattr(graph, "chain", True)
    graph.chain = depth is None
    if depth is not None:
        return depth, tree
    return (None, None) if held_chain else chain()


def chain_warp(sampling: Sampling) -> tuple:
    """What of ``sampling`` a drafted chain's graph draws under (StaticLM.draft_chain): its warp; under
    greedy nothing, since an argmax ignores every truncation (one set of graphs for all greedy runs)."""
    if sampling.greedy:
        return ("greedy",)
    return sampling.temperature, sampling.top_k, sampling.top_p, sampling.eta, sampling.min_p


def replay_chain(model, graph: Graph, draws: int, inputs: tuple, k: int, sampling: Sampling, generator) -> tuple:
    """A drafted chain's ``graph`` of ``k`` tokens replayed for ``model`` (a StaticLM or a
    static_head.StaticHead) from ``inputs`` (None: a buffer that holds it): its first forward writes
    at the model's cache length, its Exp(1) draws go into buffer ``draws`` first, in one call on
    ``generator``, and the cache then holds every token but the last. Returns the graph's outputs."""
    start = model.kv.length
    model.start.fill_(start)  # the slot the chain's first forward writes; the graph counts on from it
    if not sampling.greedy:
        graph.buffers[draws].exponential_(generator=generator)
    out = graph(*inputs)
    model.kv.length = start + k - 1
    return out


def outputs_mb(graphs: dict) -> float:
    """MB of the output tensors that ``graphs`` hold (each graph's own; their pool's scratch is shared)."""
    return sum(out.numel() * out.element_size() for g in graphs.values() for out in g.out if out is not None) / 2**20


def captured_up_to(widest: int) -> int:
    """The token counts up to which a model's forwards are captured as graphs at reserve, for a run whose
    widest verification reads ``widest`` tokens: + 2 for a draft reading a round's tokens and its
    pending one, at least CAPTURED_AT_LEAST, at most GRAPHED_UP_TO."""
    return min(max(widest + 2, CAPTURED_AT_LEAST), GRAPHED_UP_TO)


def capture_all(up_to: int, start: torch.Tensor, capture: Callable[[int], object]) -> None:
    """``capture(n)`` for n = 1..``up_to``, each at slot 0 (``start``), in inference mode as the loop's
    forwards run (the compiled forms guard on it). The warm-up forwards write the cache's first slots:
    before any sequence only."""
    with torch.inference_mode():
        for n in range(1, up_to + 1):
            start.fill_(0)
            capture(n)


def graphed(graphs: dict, key, run, buffers: Callable[[], tuple], pool, what: str) -> tuple[Graph | None, float]:
    """The graph under ``key`` in ``graphs``, captured now (over the input buffers that ``buffers()``
    makes, only then: a replay allocates nothing) if it is not there yet, and the seconds capturing took.
    None, with one log line ("capturing a CUDA graph failed, ``what``: ..."), when the capture fails (an
    operation it cannot hold, in some torch version): the caller then stops graphing, and its route says so."""
    if key in graphs:
        return graphs[key], 0.0
    began = time.perf_counter()
    try:
        graphs[key] = Graph(run, buffers(), pool)
    except Exception as e:  # noqa: BLE001 - whatever the capture raises, the compiled forward still runs
        # An operation that fails inside a capture makes ending the capture fail too; torch raises that
        # second error, with the first, the cause worth a line, as its context.
        reason = first_said(e.__context__ or e)
        log.warning("capturing a CUDA graph failed, %s: %s", what, reason)
        return None, time.perf_counter() - began
    return graphs[key], time.perf_counter() - began


class StaticLM(HFCausalLM):
    """A model on the static path: a StaticKV cache and compiled, on CUDA graphed, forwards
    (module docstring). Speaks the decode loop's protocol as HFCausalLM does, over the same weights."""

    def __init__(self, model, width: int, head_tokens: torch.Tensor | None, fast: FastLlama, compiled: bool = True):
        self.kv: StaticKV | None = None
        self.prefilling = False  # within a sequence's first forward (forward): uncompiled
        super().__init__(model, width, head_tokens, fast)
        config = model.config
        self.layers, self.kv_heads, self.head_dim = len(fast.layers), fast.kv_heads, fast.head_dim
        self.window = getattr(config, "max_position_embeddings", None)
        self.graphed = compiled and self.device.type == "cuda"
        self.start = torch.zeros(1, dtype=torch.long, device=self.device)  # the first slot a forward writes
        self.chain_start = torch.zeros_like(self.start)  # that of each forward inside a drafted chain's graph
        self.graphs: dict[int, Graph] = {}
        self.chained: dict[tuple, Graph] = {}  # draft_chain's graphs, by K and the warp they draw under
        self.chaining = True  # until capturing a chain fails
        self.graphs_version = None  # the shortlist's buffers the graphs score (ShortlistedHead.version)
        self.captured_up_to = CAPTURED_AT_LEAST  # forwards of more tokens run compiled, not graphed (reserve)
        self.pool = torch.cuda.graph_pool_handle() if self.graphed else None
        self.capture_seconds = 0.0
        self.compiling = compiled  # wanted; self.compiled holds them once built (ready)
        self.compiled = None
        self.allocate(min(DEFAULT_CAPACITY, self.window or DEFAULT_CAPACITY))
        self.reset()

    @classmethod
    def of(cls, model, width: int, head_tokens: torch.Tensor | None = None, compiled: bool = True) -> StaticLM:
        """``model`` on the static path over its own forward: unpacked (inductor lowers its own products,
        not oneDNN's packed ones), each layer's products of one input joined (FastLlama's ``joined``) on
        every device, so that a CPU's runs test the arithmetic that CUDA's graphs replay."""
        return cls(model, width, head_tokens, FastLlama(model, packed=False, compiled=False, joined=True), compiled)

    def ready(self) -> None:
        """Compile the forwards for the cache as it is now, if they are wanted and not yet built (reserve
        does it, before anything is timed; else the first forward)."""
        if self.compiling and self.compiled is None:
            self.compiled = {}
            self._forms(None)

    def _forms(self, layers: tuple[int, ...] | None):
        """The compiled forwards (single token, wider) that record ``layers``' inputs (None: none), built
        the first time they are asked for, or None when the path runs eagerly (compiling not wanted, or
        it failed: one log line, and it is not tried again)."""
        if not self.compiling:
            return None
        if layers not in self.compiled:
            start = time.perf_counter()
            forms = self._compile(layers)
            self.fast.build_seconds += time.perf_counter() - start
            if forms is None:
                self.compiling, self.compiled = False, None
                return None
            self.compiled[layers] = forms
        return self.compiled[layers]

    def _compile(self, layers: tuple[int, ...] | None):
        """The forwards (compile_forms) of ``tapped`` with ``layers`` bound. The cache's capacity is part
        of what they compile (the mask's width)."""
        device = self.device

        def inputs(n: int):
            ids, depth = torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device)
            return [(ids, [0]), (depth, [0]), (chain_tree(n, device), [0, 1])]

        # The warm-up forwards write two slots from here: past every position the cache holds.
        self.start.fill_(min(self.kv.length, self.kv.capacity - 2))
        forms = compile_forms(
            _one,
            _many,
            inputs,
            lambda form, *t: form(self, *t, self.start, layers=layers),
            "the static path runs its forwards",
            compile_options(device),
        )
        return None if forms is None else tuple(functools.partial(form, layers=layers) for form in forms)

    def forward(self, token_ids, last=1, positions=None, mask=None) -> torch.Tensor:
        """HFCausalLM.forward; a sequence's first forward (into an empty cache: its prompt, every chunk
        of it) runs uncompiled. A prompt's length changes with every prompt: a graph captured per
        length would put a capture inside the timed run (paid by the first method to meet that length,
        not by the others) and hold memory for nothing."""
        if self.kv.length:
            return super().forward(token_ids, last, positions, mask)
        self.prefilling = True
        try:
            return super().forward(token_ids, last, positions, mask)
        finally:
            self.prefilling = False

    def refresh(self, more_tokens: torch.Tensor) -> None:
        super().refresh(more_tokens)
        self.graphs, self.chained = {}, {}  # captured over the old forward's weights

    def drop_cache(self) -> None:
        """The cache, and the compiled forwards and graphs made over it."""
        self.kv, self.graphs, self.chained, self.compiled, self.pool = None, {}, {}, None, None

    @property
    def route(self) -> str:
        """What runs the forward: the compile column's value."""
        return "graphs" if self.graphed and self.compiling else "static-inductor" if self.compiling else "static"

    def forward_facts(self) -> dict:
        """HFCausalLM's, with the CUDA graphs captured so far (their token counts, and how many), the
        seconds capturing took, and the cache's size."""
        return super().forward_facts() | {
            "graphs": sorted({n for n, _ in self.graphs}),  # token counts (an EAGLE target's also with taps)
            "captured": len(self.graphs),
            "capture_s": self.capture_seconds,
            "graphs_mb": outputs_mb(self.graphs),  # their logits
            "chains": len(self.chained),  # a draft's chains captured as one graph each (draft_chain)
            "cache_positions": self.kv.capacity,
            "cache_mb": self.memory_bytes / 2**20,
        }

    def allocate(self, capacity: int) -> None:
        """A cache of ``capacity`` positions; graphs captured on the old one are dropped."""
        if self.kv is not None and self.kv.capacity == capacity:
            return
        self.kv, self.graphs, self.chained, self.compiled = (
            None,
            {},
            {},
            None,
        )  # compiled for the old capacity: again, at ready()
        dtype = self.fast.dtype
        self.kv = StaticKV(self.layers, self.kv_heads, self.head_dim, capacity, dtype, self.device)

    def reserve(self, tokens: int, widest: int = 1, taps: Sequence[int] | None = None) -> None:
        """Room for sequences of ``tokens`` (the run's longest prompt, --max-new-tokens and K + 1): the
        cache is allocated once at that size (rounded up: cache_positions, within the context window), and
        the forwards compiled for it, before anything is timed. On CUDA the forwards of 1 to
        max(``widest`` + 2, CAPTURED_AT_LEAST) tokens are captured now too (``widest``: the run's widest
        verification, see captured_up_to), and with ``taps`` (an EAGLE head's, see record_features) the
        same forwards recording them; wider ones run compiled, not graphed, so that no capture falls
        inside a timed decode. A shortlisted head holds a row for each position (ShortlistedHead.hold),
        for the same reason. Comes before any sequence (capture_all)."""
        tokens = cache_positions(tokens)
        self.allocate(min(tokens, self.window) if self.window else tokens)
        if self.shortlist is not None:  # its buffers final before the graphs that score them are captured
            self.shortlist.hold(self.kv.capacity)
        self.captured_up_to = min(captured_up_to(widest), self.kv.capacity)
        self.ready()
        for layers in (None,) if taps is None else (None, tuple(taps)):
            capture_all(self.captured_up_to, self.start, lambda n, layers=layers: self._graph(n, layers))

    @property
    def memory_bytes(self) -> int:
        """Bytes of the cache's buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.kv.keys, *self.kv.values))

    def reset(self) -> None:
        if self.kv is None:  # HFCausalLM.__init__'s call, before the cache exists
            return
        self.kv.length = 0
        self.reset_shortlist()

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def cache(self) -> SimpleNamespace:
        """The held positions as transformers' cache layers show them (``layers[i].keys`` and
        ``.values``, [1, kv_heads, length, head_dim] views): what a models.lm.SparseView reads."""
        n = self.kv.length
        held = zip(self.kv.keys, self.kv.values, strict=True)
        return SimpleNamespace(layers=[SimpleNamespace(keys=k[:, :, :n], values=v[:, :, :n]) for k, v in held])

    def _fast_call(self, token_ids, last, positions, mask):
        n, start = token_ids.shape[0], self.kv.length
        if start + n > self.kv.capacity:  # beyond what the run reserved: a new cache (and new graphs)
            log.warning(
                "a sequence outgrew the static cache's %d positions: reallocated (reserve() was not told)",
                self.kv.capacity,
            )
            self._grow(start + n)
        # Each operation is a dispatch on the host, which a graphed draft step is mostly made of: ids
        # already on the device (every drafted token) are not sent through .to(), nor a whole output sliced.
        ids = token_ids if token_ids.device == self.device else token_ids.to(self.device)
        depth = tree = None
        if positions is not None:  # a tree (tree_inputs): it sees the whole past, then its own ancestors
            depth = positions.to(self.device) - start
            tree = mask[:, start:].to(self.device).contiguous() if mask is not None else None  # compiled: one layout
        return self._logits(ids, depth, tree, start, last)

    def _logits(self, ids, depth, tree, start: int, last: int) -> torch.Tensor:
        """The logits of the ``last`` rows of a forward of ``ids`` written from slot ``start``: a graph's
        replay or the compiled forward, head included (scores_inside), else the eager forward or the
        compiled one and then the head."""
        n = ids.shape[0]
        self.ready()
        self.start.fill_(start)  # a kernel with the value as its argument: no copy from the host, no wait
        layers = None if self._taps is None else tuple(self.feature_layers)
        eager = n > GRAPHED_UP_TO or self.prefilling or self.queries is not None
        if not eager and self.shortlist is not None and self.graphs_serve(n):
            self.shortlist.make_room(n)  # before the graph is looked up: new buffers drop the graphs over the old
        graph = None if eager else self._graph(n, layers)
        if graph is not None:
            depth, tree = replay_inputs(
                graph, depth, tree, lambda: (torch.arange(n, device=self.device), chain_tree(n, self.device))
            )
            logits, features = graph(ids, depth, tree)
            if last < n:
                logits = logits[-last:]
        else:
            forms = None if eager else self._forms(layers)
            if depth is None:
                depth = torch.arange(n, device=self.device)
            if tree is None:
                tree = chain_tree(n, self.device)
            if forms is None:  # the final states of the last rows only: a prompt's others are never scored
                out, features = step(self, ids, depth, tree, self.start, self.queries, self._taps), None
            else:  # the compiled graph guards on the kind of tensor too: all made in inference mode, as the loop's
                ids, depth, tree = (t if t.is_inference() else t.clone() for t in (ids, depth, tree))
                out, features = forms[n > 1](self, ids, depth, tree, self.start)
            scored = forms is not None and self.scores_inside
            logits = out[-last:] if scored else self._fast_head(out[-last:], ids)
        if features is not None:  # the taps, as HFCausalLM._forward reads them
            for i, tap in zip(layers, features.chunk(len(layers), dim=-1), strict=True):
                self._taps[i] = tap
        self.kv.length = start + n
        return logits

    @property
    def scores_inside(self) -> bool:
        """Whether the compiled forms score the whole vocabulary themselves (tapped): on CUDA inductor then
        lowers the one-token LM head to a tuned reduction (compile_options), as gpt-fast compiles its
        whole decoder, with the final norm's scaling fused into its loads; the eager head's cuBLAS
        product of one row is among what the first graphed run left short of the bandwidth. A
        shortlisted head appends ids to its buffers (make_room, append) and scores outside them."""
        return self.shortlist is None

    def _graphed_head(self, out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """_fast_head's logits of every row of a compiled form's ``out`` (tapped), as a graph holds them:
        the form's own, or a shortlist appends ``ids`` on the device and scores all its rows, no host read
        (make_room came before)."""
        if self.scores_inside:
            return out
        self.shortlist.append(ids)
        return self.shortlist.logits(F.linear(out, self.shortlist.rows), self.shortlist.ids)

    def graphs_serve(self, n: int) -> bool:
        """Whether forwards of ``n`` tokens replay graphs."""
        return self.graphed and self.compiling and n <= self.captured_up_to

    def _graph(self, n: int, layers: tuple[int, ...] | None) -> Graph | None:
        """The CUDA graph of ``n``-token forwards that record ``layers``' inputs, captured now (at
        ``start``) if it is not yet; None where such forwards are not graphed (a CPU, compiling off or
        failed, more tokens than reserve captures)."""
        forms = self._forms(layers) if self.graphs_serve(n) else None
        if forms is None:
            return None
        shortlist = self.shortlist
        if shortlist is not None and self.graphs_version != shortlist.version:
            self.graphs, self.graphs_version = {}, shortlist.version  # captured over the shortlist's old buffers

        def run(ids, depth, tree):
            out, features = forms[n > 1](self, ids, depth, tree, self.start)
            return self._graphed_head(out, ids), features

        def buffers():
            return (
                torch.zeros(n, dtype=torch.long, device=self.device),
                torch.arange(n, device=self.device),
                chain_tree(n, self.device),
            )

        capturing = shortlist is not None and (n, layers) not in self.graphs
        with shortlist.unchanged() if capturing else contextlib.nullcontext():  # its forwards read made-up ids
            graph, seconds = graphed(
                self.graphs, (n, layers), run, buffers, self.pool, "the static path runs its forwards compiled"
            )
        self.capture_seconds += seconds
        if graph is None:  # the capture failed: the compiled forms run, and no graph is kept
            self.graphed, self.graphs, self.chained = False, {}, {}
        return graph

    def chains(self, k: int, sampling: Sampling, reading: int) -> bool:
        """Whether draft_chain drafts ``k`` tokens under ``sampling`` after a forward of ``reading``
        tokens: where chaining serves the warp (chaining), K is up to CHAINED_UP_TO and the cache has
        room. A warp that reserve_chains did not capture is captured now, its forwards writing slots
        past the sequence, which the sequence overwrites later anyway."""
        if not (
            self.chaining_serves(sampling)
            and 1 <= k <= CHAINED_UP_TO
            and self.kv.length + reading + CHAINED_UP_TO <= self.kv.capacity
        ):
            return False
        if (k, chain_warp(sampling)) not in self.chained:
            self._capture_chains(sampling, self.kv.length + reading)
        return self.chaining

    def chaining_serves(self, sampling: Sampling) -> bool:
        """Whether a chain drafted under ``sampling`` replays as one graph: on CUDA's graphs, for a head
        of the whole vocabulary (a shortlist's appending stays out), rows that need no adjust(), and no
        capture of a chain has failed."""
        return (
            self.chaining
            and self.graphs_serve(1)
            and self.shortlist is None
            and self._taps is None
            and self.queries is None
            and not sampling.adjusts
        )

    def reserve_chains(self, sampling: Sampling) -> None:
        """The chains' graphs of every K under ``sampling``'s warp, captured now where they serve: after
        reserve, before any sequence and anything timed (a run's sampling; another warp's are captured
        at its first chain)."""
        if self.chaining_serves(sampling) and (1, chain_warp(sampling)) not in self.chained:
            self._capture_chains(sampling, 0)

    @torch.inference_mode()
    def draft_chain(
        self, first: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A chain of ``k`` tokens drawn after the logits row ``first`` [V] (the forward that read what
        the draft had not), as sampling.draw_chain draws it, its k - 1 one-token forwards and every draw
        replayed as one CUDA graph: the host dispatches a handful of operations a chain instead of a dozen
        a token. The randomness is drawn on ``generator`` outside the graph, into its buffer, in one call.
        The cache then holds every token but the last, as after propose_chain. Only where ``chains`` said
        so. Returns the tokens [k] and their q rows [k, V] (None under greedy); None, the cache as it
        was, when the chain's graph is gone (a capture failed since): the caller drafts a token at a time."""
        graph = self.chained.get((k, chain_warp(sampling)))
        if graph is None:  # dropped since chains() said so: a capture of the catch-up's forward failed
            return None
        return replay_chain(self, graph, 1, (first, None, None, None), k, sampling, generator)

    @torch.inference_mode()  # as the loop's forwards run: the compiled form guards on how its inputs were made
    def _capture_chains(self, sampling: Sampling, slot: int) -> None:
        """draft_chain's graphs of every K up to CHAINED_UP_TO under ``sampling``'s warp, their forwards
        writing from ``slot``; a failure (one log line, graphed says) ends chaining."""
        self.start.fill_(slot)
        head = self._graph(1, None)  # the chain's rows are as wide as a one-token forward's, in its dtype
        if head is None:
            self.chaining = False
            return
        warp = chain_warp(sampling)
        one, (width, dtype) = self._forms(None)[0], (head.out[0].shape[-1], head.out[0].dtype)
        # Built once and held by each graph (its buffers): a replay reads them where the capture found them.
        depth, tree = torch.zeros(1, dtype=torch.long, device=self.device), chain_tree(1, self.device)

        def row_after(token: torch.Tensor, i: int) -> torch.Tensor:
            # Written into a tensor made as self.start was (outside inference mode): the compiled form
            # guards on how its inputs were made, and a new tensor here would be compiled for anew.
            torch.add(self.start, i - 1, out=self.chain_start)
            out, _ = one(self, token, depth, tree, self.chain_start)
            return self._graphed_head(out, token)[-1]

        for n in range(1, CHAINED_UP_TO + 1):

            def run(first, draws, _depth, _tree, n=n):
                return draw_chain(first, n, sampling, draws, row_after)

            def buffers(n=n):
                draws = torch.ones(n if not sampling.greedy else 0, width, device=self.device)
                return torch.zeros(width, dtype=dtype, device=self.device), draws, depth, tree

            graph, seconds = graphed(
                self.chained, (n, warp), run, buffers, self.pool, "the draft's chains are drawn a token at a time"
            )
            self.capture_seconds += seconds
            if graph is None:
                self.chained, self.chaining = {}, False
                return

    def _grow(self, tokens: int) -> None:
        old, length = self.kv, self.kv.length
        self.allocate(max(tokens, 2 * old.capacity))
        for new, held in zip((*self.kv.keys, *self.kv.values), (*old.keys, *old.values), strict=True):
            new[:, :, :length] = held[:, :, :length]
        self.kv.length = length

    @torch.inference_mode()
    def keep(self, path: Sequence[int], new: int) -> None:
        path = list(path)
        offsets = None if path == list(range(len(path))) else ids_to_device(path, self.device)
        self.kv.keep(offsets, len(path), new)
