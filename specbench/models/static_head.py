"""An EAGLE head (models/eagle_head.EagleHead) on the static path (models/static.py): its cache a
StaticKV allocated once, its steps compiled as a model's forwards are and, on CUDA, replayed as CUDA
graphs, with the same machinery (compile_forms, graphed, capture_all), and a chain's steps and draws
replayed as one graph, as a draft model's are (draft_chain)."""

from __future__ import annotations

import time

import torch

from specbench.decoding.kv import StaticKV, static_mask
from specbench.decoding.sampling import Sampling
from specbench.models import static  # its compile_forms and draw_chain called through it: tests replace them there
from specbench.models.fast import attend
from specbench.models.static import (
    CAPTURED_AT_LEAST,
    CHAINED_UP_TO,
    GRAPHED_UP_TO,
    Graph,
    capture_all,
    captured_up_to,
    chain_tree,
    chain_warp,
    compile_options,
    graphed,
    outputs_mb,
    replay_chain,
    replay_inputs,
)


class StaticHeadCache:
    """An EAGLE head's cache on the static path: a StaticKV of one layer, read as eagle_head.HeadCache
    is (``update`` appends and returns the held keys and values, ``crop`` moves ``length``), so the
    head's own step runs over it unchanged where the static step does not (a sequence's first read, a
    tree level wider than the static step tells apart)."""

    def __init__(self, kv: StaticKV):
        self.kv = kv

    @property
    def length(self) -> int:
        return self.kv.length

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, start = keys.shape[2], self.kv.length
        if start + n > self.kv.capacity:
            raise ValueError(f"the head's static cache holds {self.kv.capacity} positions: reserve more")
        self.kv.keys[0][:, :, start : start + n] = keys
        self.kv.values[0][:, :, start : start + n] = values
        self.kv.length = start + n
        return self.kv.keys[0][:, :, : start + n], self.kv.values[0][:, :, : start + n]

    def crop(self, length: int) -> None:
        self.kv.length = length


# A head's step on the static path tells apart the last this many slots (its own, and the round's tree
# nodes read before them: a level's ancestors); every earlier slot it sees. A tree level whose round has
# read more runs the head's own step.
TREE_SLOTS = GRAPHED_UP_TO


def head_step(head, kv: StaticKV, ids, hidden, depth, tree, start):
    """The EAGLE head's decoder layer over ``ids`` [n] with ``hidden`` [n, h], written at slots
    ``start`` [1] onwards, each at position start + ``depth`` and seeing what ``tree`` [n, TREE_SLOTS]
    allows of the slots ending with its own (static_mask). Returns its outputs [n, h] and the scores of
    the token after each [n, draft_vocab]: the head's product inside the compiled step, which on CUDA
    inductor lowers to a tuned reduction (models/static.py, scores_inside)."""
    n = ids.shape[0]
    slots = start + torch.arange(n, device=ids.device)
    mask = static_mask(start, tree, kv.capacity, head.dtype)[None, None]

    def attend_static(q, k, v):
        keys, values = kv.write(0, slots, k, v)
        return attend(q, keys, values, mask)

    out = head.layer(head.embed[ids], hidden, start + depth, attend_static)
    return out, head.draft_logits(out)


def _head_one(head, kv, ids, hidden, depth, tree, start):  # a single pair
    return head_step(head, kv, ids, hidden, depth, tree, start)


def _head_many(head, kv, ids, hidden, depth, tree, start):  # 2..GRAPHED_UP_TO pairs, the count dynamic
    return head_step(head, kv, ids, hidden, depth, tree, start)


class StaticHead:
    """An EAGLE head (models/eagle_head.EagleHead) on the static path: its cache a StaticKV allocated
    once, its steps (the pending pairs it reads, each drafted token, a tree's levels) and the scores
    after them compiled as StaticLM's are and, on CUDA, replayed as CUDA graphs. Everything else is the
    head's."""

    def __init__(self, head, capacity: int, compiled: bool = True):
        self.head, self.compiling = head, compiled
        self.graphed = compiled and head.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.graphed else None
        self.start = torch.zeros(1, dtype=torch.long, device=head.device)
        self.chain_start = torch.zeros_like(self.start)  # that of each step inside a drafted chain's graph
        self.kv, self.forms, self.graphs, self.capture_seconds, self.build_seconds = None, None, {}, 0.0, 0.0
        self.chained: dict[tuple, Graph] = {}  # draft_chain's graphs, by K and the warp they draw under
        self.chaining = True  # until capturing a chain fails
        self.captured_up_to = CAPTURED_AT_LEAST  # as StaticLM's (reserve)
        self.allocate(capacity)

    def forward_facts(self) -> dict:
        """What meta.json says of the head's steps, as StaticLM.forward_facts does of a model's forward."""
        route = "graphs" if self.graphed and self.compiling else "static-inductor" if self.compiling else "static"
        return {
            "route": route,
            "build_s": self.build_seconds,
            "graphs": sorted(self.graphs),
            "captured": len(self.graphs),
            "chains": len(self.chained),  # its chains captured as one graph each (draft_chain)
            "capture_s": self.capture_seconds,
            "graphs_mb": outputs_mb(self.graphs),
            "cache_positions": self.kv.capacity,
            "cache_mb": 2 * self.kv.keys[0].numel() * self.kv.keys[0].element_size() / 2**20,
        }

    def __getattr__(self, name: str):  # config, fuse, draft_logits, draft_ids, embed, ...: the head's
        return getattr(self.head, name)

    def allocate(self, capacity: int) -> None:
        if self.kv is not None and self.kv.capacity == capacity:
            return
        c = self.head.config
        self.kv = StaticKV(1, c.kv_heads, c.head_dim, capacity, self.head.dtype, self.head.device)
        self.forms, self.graphs, self.chained = None, {}, {}  # compiled for the old capacity

    def reserve(self, tokens: int, widest: int = 1) -> None:
        """Room for sequences of ``tokens``, the steps compiled for it and on CUDA captured, as
        StaticLM.reserve does (before anything is timed). The head holds a pair per position read and,
        within a round, what it drafted: a dynamic tree reads up to its width times its depth, so
        GRAPHED_UP_TO positions more are kept."""
        self.allocate(static.cache_positions(tokens + GRAPHED_UP_TO))
        self.captured_up_to = captured_up_to(widest)
        self.ready()
        capture_all(self.captured_up_to, self.start, self._graph)

    def ready(self) -> None:
        if not self.compiling or self.forms is not None:
            return
        began = time.perf_counter()
        try:
            self.forms = self._compile()
        finally:
            self.build_seconds += time.perf_counter() - began

    def _compile(self):
        """The steps compiled (compile_forms); None when the compiler fails."""
        head = self.head

        def inputs(n: int):
            return [(tensor, [0]) for tensor in self._chain_buffers(n)]

        self.start.fill_(0)
        forms = static.compile_forms(
            _head_one,
            _head_many,
            inputs,
            lambda form, *t: form(head, self.kv, *t, self.start),
            "the EAGLE head runs its steps",
            compile_options(head.device),
        )
        self.compiling = forms is not None
        return forms

    def new_cache(self) -> StaticHeadCache:
        """The cache for a new sequence: the one StaticKV, emptied (one sequence at a time)."""
        self.kv.length = 0
        return StaticHeadCache(self.kv)

    def scored_step(
        self, tokens, hidden, cache: StaticHeadCache, last: int = 1, positions=None, mask=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """EagleHead.scored_step on the static step, compiled and on CUDA graphed, chains and tree levels
        alike. A sequence's first read (the prompt's pairs, of a new length each time: see
        StaticLM.forward) and a tree level whose ``mask`` tells apart more than TREE_SLOTS slots run
        the head's own."""
        if (positions is None) != (mask is None):  # the static step reads a chain's positions from its slots
            raise ValueError("the head's static step takes positions with a mask (a tree level) or neither (a chain)")
        n, start = len(tokens), cache.length
        self.ready()
        if self.forms is None or n > GRAPHED_UP_TO or start == 0 or (mask is not None and mask.shape[1] > TREE_SLOTS):
            return self.head.scored_step(tokens, hidden, cache, last, positions, mask)
        if start + n > self.kv.capacity:
            raise ValueError(f"the head's static cache holds {self.kv.capacity} positions: reserve more")
        self.start.fill_(start)  # a kernel with the value as its argument: no copy from the host, no wait
        depth = tree = None  # a chain
        if mask is not None:  # a tree level: every slot before the mask's it sees
            depth, tree = positions - start, torch.cat([mask.new_ones(n, TREE_SLOTS - mask.shape[1]), mask], dim=1)
        graph = self._graph(n)
        if graph is not None:
            depth, tree = replay_inputs(graph, depth, tree, lambda: self._chain_shape(n))
            out, logits = graph(tokens, hidden, depth, tree)
            if last < n:  # a view costs the host too: none for a draft's step
                out, logits = out[-last:], logits[-last:]
        else:  # compiled
            inputs = (tokens, hidden) + ((depth, tree) if mask is not None else self._chain_shape(n))
            inputs = (t if t.is_inference() else t.clone() for t in inputs)  # the compiled forms guard on it
            out, logits = (t[-last:] for t in self.forms[n > 1](self.head, self.kv, *inputs, self.start))
        self.kv.length = start + n
        return out, logits

    def _chain_shape(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The depth and tree of an ``n``-pair chain step."""
        return torch.arange(n, device=self.head.device), chain_tree(n, self.head.device, TREE_SLOTS)

    def _chain_buffers(self, n: int) -> tuple[torch.Tensor, ...]:
        """Inputs of an ``n``-pair chain step: ids, features (zeros: any), depth and tree."""
        head = self.head
        ids, hidden = torch.zeros(n, dtype=torch.long, device=head.device), head.embed.new_zeros(n, head.config.hidden)
        return ids, hidden, *self._chain_shape(n)

    def _graph(self, n: int) -> Graph | None:
        """The CUDA graph of ``n``-pair steps, captured now (at ``start``, over a chain's buffers) if it is
        not yet; None where such steps are not graphed (as StaticLM._graph)."""
        if not self.graphed or self.forms is None or n > self.captured_up_to:
            return None
        run, head = self.forms[n > 1], self.head
        graph, seconds = graphed(
            self.graphs,
            n,
            lambda *inputs: run(head, self.kv, *inputs, self.start),
            lambda: self._chain_buffers(n),
            self.pool,
            "the EAGLE head runs its steps compiled",
        )
        self.capture_seconds += seconds
        if graph is None:  # the capture failed: the compiled forms run, and no graph is kept
            self.graphed, self.graphs, self.chained = False, {}, {}
        return graph

    def chains(self, k: int, sampling: Sampling) -> bool:
        """Whether draft_chain drafts ``k`` tokens under ``sampling``: on CUDA's graphs, K up to
        CHAINED_UP_TO, room in the cache, and no capture of a chain failed. A warp not captured yet is
        captured now, its steps writing slots past the sequence, which the round crops anyway."""
        if not (
            self.chaining
            and self.graphed
            and self.forms is not None
            and 1 <= k <= CHAINED_UP_TO
            and self.kv.length + CHAINED_UP_TO <= self.kv.capacity
        ):
            return False
        if (k, chain_warp(sampling)) not in self.chained:
            self._capture_chains(sampling, self.kv.length)
        return self.chaining

    def reserve_chains(self, sampling: Sampling) -> None:
        """The chains' graphs of every K under ``sampling``'s warp, captured now where they serve: after
        reserve, before any sequence and anything timed (as StaticLM.reserve_chains)."""
        if self.chaining and self.graphed and self.forms is not None and (1, chain_warp(sampling)) not in self.chained:
            self._capture_chains(sampling, 0)

    @torch.inference_mode()
    def draft_chain(
        self, first: torch.Tensor, out: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A chain of ``k`` draft ids drawn after the scores ``first`` [draft_vocab] and the layer's
        output ``out`` [1, h] of the step that read the round's pending pairs, as sampling.draw_chain
        draws one: its k - 1 steps (each reading the last draft with the output before it) and every
        draw replayed as one CUDA graph, as StaticLM.draft_chain replays a draft model's. The randomness
        is drawn on ``generator`` outside the graph, into its buffer, in one call. The cache then holds
        the drafts it read. Only where ``chains`` said so. Returns the ids [k] and their q rows [k,
        draft_vocab] (None under greedy); None when the chain's graph is gone (a capture failed since)."""
        graph = self.chained.get((k, chain_warp(sampling)))
        if graph is None:
            return None
        return replay_chain(self, graph, 2, (first, out, None, None, None), k, sampling, generator)

    @torch.inference_mode()  # as the loop's steps run: the compiled form guards on how its inputs were made
    def _capture_chains(self, sampling: Sampling, slot: int) -> None:
        """draft_chain's graphs of every K up to CHAINED_UP_TO under ``sampling``'s warp, their steps
        writing from ``slot``; a failure (one log line, graphed says) ends chaining."""
        self.start.fill_(slot)
        one_step = self._graph(1)  # its outputs give the chain's widths and dtypes
        if one_step is None:
            self.chaining = False
            return
        head, step, warp = self.head, self.forms[0], chain_warp(sampling)
        # Made once; each graph holds them among its buffers: a CUDA graph keeps nothing it reads alive.
        (out, scores), depth, tree = one_step.out, *self._chain_shape(1)

        def run(first, before, draws, n):
            state = before

            def row_after(token: torch.Tensor, i: int) -> torch.Tensor:
                nonlocal state
                # Written into a tensor made as self.start was: a new one would be compiled for anew.
                torch.add(self.start, i - 1, out=self.chain_start)
                state, scores = step(head, self.kv, head.draft_ids[token], state, depth, tree, self.chain_start)
                return scores[-1]

            return static.draw_chain(first, n, sampling, draws, row_after)

        for n in range(1, CHAINED_UP_TO + 1):

            def buffers(n=n):
                width = scores.shape[-1]
                draws = torch.ones(n if not sampling.greedy else 0, width, device=head.device)
                return scores.new_zeros(width), out.new_zeros(1, out.shape[-1]), draws, depth, tree

            graph, seconds = graphed(
                self.chained,
                (n, warp),
                lambda first, before, draws, _depth, _tree, n=n: run(first, before, draws, n),
                buffers,
                self.pool,
                "the EAGLE head's chains are drawn a token at a time",
            )
            self.capture_seconds += seconds
            if graph is None:
                self.chained, self.chaining = {}, False
                return
