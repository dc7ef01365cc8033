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
- the forward (models/fast.py's arithmetic, the same weights) is compiled whole: one graph for a
  single token, one with a dynamic token count for every wider forward (K + 1 for each K, a tree's
  size, a draft catching up), so K, prompts and rounds never recompile it;
- on CUDA each token count the run uses is captured once as a CUDA graph over fixed input buffers,
  and a forward is a few copies into them and one replay. The random draws of sampling and the
  acceptance test stay outside, on the run's generators; the host still reads once a round.

A prompt's prefill runs the same forward uncompiled (its length changes with every prompt, and a
graph per length would only cost memory). On a CPU the path runs compiled without graphs: that is
where its exactness and its freedom from recompilation are tested; it is not the CPU's default.
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from specbench.decoding.kv import StaticKV, static_mask
from specbench.decoding.transfer import ids_to_device
from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM

log = logging.getLogger("specbench")

GRAPHED_UP_TO = 64  # forwards of at most this many tokens run compiled (and graphed); wider ones, prefills, run eagerly
DEFAULT_CAPACITY = 1024  # cache positions before the run reserves its own (StaticLM.reserve)


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


def tapped(lm: StaticLM, ids, depth, tree, start, layers: tuple[int, ...] | None):
    """``step`` compiled: the final normed states, and the inputs of ``layers`` side by side [n,
    len(layers) * hidden] (FastLlama.hidden's taps: an EAGLE head's features), or None without layers."""
    taps = None if layers is None else dict.fromkeys(layers)
    hidden = step(lm, ids, depth, tree, start, None, taps)
    return hidden, None if taps is None else torch.cat([taps[i] for i in layers], dim=-1)


def _one(lm, ids, depth, tree, start, layers):  # a single token, all shapes static
    return tapped(lm, ids, depth, tree, start, layers)


def _many(lm, ids, depth, tree, start, layers):  # 2..GRAPHED_UP_TO tokens: one graph with a dynamic count
    return tapped(lm, ids, depth, tree, start, layers)


def own_code(function: types.FunctionType) -> types.FunctionType:
    """``function`` with a code object of its own. torch.compile keeps compiled graphs on the code
    object, so two models of different shapes (a target and its draft, a Llama and a Qwen3 in one
    process) compiling one function would each recompile the other's graph."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)


class Graph:
    """One token count's forward (``run``: a compiled ``tapped``) captured as a CUDA graph over fixed
    input buffers."""

    def __init__(self, lm: StaticLM, run, n: int, pool):
        device = lm.device
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.depth = torch.arange(n, device=device)
        self.tree = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        self.chain = True  # the buffers hold a chain's depth and tree
        start = lm.start
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # capture needs the kernels chosen and compiled first
            for _ in range(2):
                run(lm, self.ids, self.depth, self.tree, start)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = run(lm, self.ids, self.depth, self.tree, start)

    def __call__(self, ids, depth, tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.ids.copy_(ids)
        if depth is not None or not self.chain:
            self.depth.copy_(depth if depth is not None else torch.arange(len(ids), device=ids.device))
            self.tree.copy_(tree if tree is not None else torch.ones_like(self.tree).tril())
            self.chain = depth is None
        self.graph.replay()
        return tuple(None if out is None else out.clone() for out in self.out)  # the next replay overwrites them


class StaticLM(HFCausalLM):
    """A model on the static path: a StaticKV cache and compiled, on CUDA graphed, forwards
    (module docstring). Speaks the decode loop's protocol as HFCausalLM does, over the same weights."""

    def __init__(self, model, width: int, head_tokens: torch.Tensor | None, fast: FastLlama, compiled: bool = True):
        self.kv: StaticKV | None = None
        super().__init__(model, width, head_tokens, fast)
        config = model.config
        self.layers, self.kv_heads, self.head_dim = len(fast.layers), fast.kv_heads, fast.head_dim
        self.window = getattr(config, "max_position_embeddings", None)
        self.graphed = compiled and self.device.type == "cuda"
        self.start = torch.zeros(1, dtype=torch.long, device=self.device)  # the first slot a forward writes
        self.graphs: dict[int, Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphed else None
        self.capture_seconds = 0.0
        self.compiling = compiled  # wanted; self.compiled holds them once built (ready)
        self.compiled = None
        self.allocate(min(DEFAULT_CAPACITY, self.window or DEFAULT_CAPACITY))
        self.reset()

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
        """The forwards compiled, each a ``tapped`` of its own code object with ``layers`` bound, and run
        once so that compiling happens now; None, with one log line, when the compiler fails. The
        cache's capacity is part of what they compile (the mask's width)."""
        forms = tuple(
            functools.partial(torch.compile(own_code(function), fullgraph=True, dynamic=dynamic), layers=layers)
            for function, dynamic in ((_one, False), (_many, None))  # _many: the token count marked dynamic below
        )
        # The warm-up forwards write two slots from here: past every position the cache holds.
        self.start.fill_(min(self.kv.length, self.kv.capacity - 2))
        try:
            with torch.inference_mode():
                for n, run in ((1, forms[0]), (2, forms[1])):
                    ids = torch.zeros(n, dtype=torch.long, device=self.device)
                    depth = torch.arange(n, device=self.device)
                    tree = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
                    if n > 1:
                        for tensor, dims in ((ids, [0]), (depth, [0]), (tree, [0, 1])):
                            torch._dynamo.mark_dynamic(tensor, dims, min=2, max=GRAPHED_UP_TO)
                    run(self, ids, depth, tree, self.start)
        except Exception as e:  # noqa: BLE001 - whatever the compiler raises, the eager path still runs
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            log.warning("torch.compile failed, the static path runs its forwards eagerly: %s", reason)
            return None
        return forms

    def refresh(self, more_tokens: torch.Tensor) -> None:
        super().refresh(more_tokens)
        self.graphs = {}  # captured over the old forward's weights

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
            "cache_positions": self.kv.capacity,
            "cache_mb": self.memory_bytes / 2**20,
        }

    def allocate(self, capacity: int) -> None:
        """A cache of ``capacity`` positions; graphs captured on the old one are dropped."""
        if self.kv is not None and self.kv.capacity == capacity:
            return
        self.kv, self.graphs, self.compiled = None, {}, None  # compiled for the old capacity: again, at ready()
        dtype = self.fast.dtype
        self.kv = StaticKV(self.layers, self.kv_heads, self.head_dim, capacity, dtype, self.device)

    def reserve(self, tokens: int) -> None:
        """Room for sequences of ``tokens`` (the run's longest prompt, --max-new-tokens and K + 1): the
        cache is allocated once at that size, and the forwards compiled for it, before anything is timed."""
        tokens = min(tokens, self.window) if self.window else tokens
        self.allocate(tokens)  # no larger than needed either: attention reads every position
        self.ready()

    @property
    def memory_bytes(self) -> int:
        """Bytes of the cache's buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.kv.keys, *self.kv.values))

    def reset(self) -> None:
        if self.kv is None:  # HFCausalLM.__init__'s call, before the cache exists
            return
        self.kv.length = 0
        if self.head_tokens is not None:
            self.in_head = self.shortlist_mask.clone()
            self.head_ids, self.head = self.head_tokens, self.shortlist_head

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
        ids = token_ids.to(self.device)
        depth = tree = None
        if positions is not None:  # a tree (tree_inputs): it sees the whole past, then its own ancestors
            depth = positions.to(self.device) - start
            tree = mask[:, start:].to(self.device) if mask is not None else None
        hidden = self._hidden(ids, depth, tree, start)
        return self._fast_head(hidden[-last:], ids)

    def _hidden(self, ids, depth, tree, start: int) -> torch.Tensor:
        n = ids.shape[0]
        self.ready()
        self.start.fill_(start)  # a kernel with the value as its argument: no copy from the host, no wait
        layers = None if self._taps is None else tuple(self.feature_layers)
        forms = None if n > GRAPHED_UP_TO or self.queries is not None else self._forms(layers)
        if forms is not None and self.graphed:
            graph = self.graphs.get((n, layers))
            if graph is None:
                began = time.perf_counter()
                graph = self.graphs[n, layers] = Graph(self, forms[n > 1], n, self.pool)
                self.capture_seconds += time.perf_counter() - began
            hidden, features = graph(ids, depth, tree)
        else:
            if depth is None:
                depth = torch.arange(n, device=self.device)
            if tree is None:
                tree = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            if forms is None:
                hidden, features = step(self, ids, depth, tree, self.start, self.queries, self._taps), None
            else:  # the compiled graph guards on the kind of tensor too: all made in inference mode, as the loop's
                ids, depth, tree = (t if t.is_inference() else t.clone() for t in (ids, depth, tree))
                hidden, features = forms[n > 1](self, ids, depth, tree, self.start)
        if features is not None:  # the taps, as HFCausalLM._forward reads them
            for i, tap in zip(layers, features.chunk(len(layers), dim=-1), strict=True):
                self._taps[i] = tap
        self.kv.length = start + n
        return hidden

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
