"""A transformers model speaking the decode loop's protocol (decoding.decode.CausalLM): its KV cache, shortlisted head, and views of
the cache. (transformers' own generate, as an engine, is engines/hf.py.)"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from functools import cache

import torch

from specbench.decoding.decode import cache_keyword
from specbench.decoding.kv import GrowingKV, Window, retrieval_positions
from specbench.decoding.transfer import ids_to_device, to_device
from specbench.models.fast import FastLlama, unsupported

log = logging.getLogger("specbench")


@cache
def growing_layer():
    """transformers' DynamicLayer, appending in place (decoding.kv.GrowingKV) where DynamicLayer concatenates."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        grown: GrowingKV | None = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.grown is None:
                self.grown = GrowingKV()
            # keys and values may have been cut (crop) or replaced (a window's eviction) since the last update
            length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            held = (self.keys, self.values) if length else None
            self.keys, self.values = self.grown.append(held, length, key_states, value_states)
            return self.keys, self.values

    return GrowingLayer


def host_reads_free(device: torch.device) -> bool:
    """Whether reading a value back to the host costs no wait (the tensors are already there)."""
    return device.type == "cpu"


SPARE_ROWS = 256  # rows a shortlisted head holds free for the ids a sequence reads, unless told (hold)


class ShortlistedHead:
    """A vocabulary shortlist as a head scores it: the shortlisted ``ids`` plus every id read since
    ``reset``, each with its row of the output embeddings ``weight``; the rest of the ``width`` ids
    score -inf.

    The rows sit in buffers of a fixed size that ``read`` appends to on the device, so reading costs no
    host read: on CUDA one a forward would make the host wait for each draft step before it queues
    the next. The host keeps a bound on the rows filled (every id read counts) and reads the true
    count only when the spare rows could run out, then grows the buffers if they must; a new sequence
    keeps them. Unfilled rows score a column past ``width``, which is dropped. Where the host reads for
    free (a CPU) only the filled rows are scored."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, width: int):
        self.weight, self.width, self.device = weight.detach(), width, weight.device
        self.base = torch.zeros(0, dtype=torch.long, device=self.device)
        self.extend(ids)
        # Scratch for ``read``: which of an id's reads in one call is the one that adds it.
        self.claims = torch.zeros(width, dtype=torch.long, device=self.device)
        self.version = 0  # counts the buffers' allocations (a new one invalidates a packed copy)
        self.spare = SPARE_ROWS
        self.reset()

    def hold(self, rows: int) -> None:
        """Keep ``rows`` rows free for the new ids a sequence reads (as many as the vocabulary leaves), in
        buffers allocated now. StaticLM.reserve asks for a row per position of its cache: a draft reads
        new ids only in its prompt and the target's tokens (what it drafts it already scores), so no
        sequence of the run grows the buffers, which would drop the CUDA graphs captured over the old
        ones and capture them again inside a timed decode. Spare rows cost nothing where only the
        filled ones are scored (a CPU); on CUDA every row is scored, a row a position more (at 8,192
        positions, twice the shipped draft's 8,192 shortlisted rows)."""
        self.spare = max(SPARE_ROWS, min(rows, self.width - len(self.base)))
        if len(self.ids) - 1 != len(self.base) + self.spare:
            self.moved = True
        self.reset()

    def extend(self, ids: torch.Tensor) -> None:
        """Add ``ids`` to the shortlist itself, their rows (and the others') gathered from the weights as
        they are now (online updates change them): from the next ``reset``."""
        ids = ids.to(self.device)
        ids = ids[(ids >= 0) & (ids < self.width)]
        self.base = torch.cat([self.base, ids]).unique()
        self.base_mask = torch.zeros(self.width, dtype=torch.bool, device=self.device)
        self.base_mask[self.base] = True
        self.base_rows = self.weight[self.base]
        self.moved = True  # the next reset allocates new buffers: a packed copy of the old rows is stale

    def reset(self) -> None:
        """Back to the shortlist's own ids, before a new sequence: in the buffers it has where they hold
        them with rows to spare (a CUDA graph that scores the shortlist reads those buffers)."""
        n = self.bound = len(self.base)
        if self.moved or n + self.spare > len(self.ids) - 1:
            self.seen, self.count = self.base_mask.clone(), torch.tensor(n, device=self.device)
            self._allocate(n + self.spare, self.base, self.base_rows)
            self.moved = False
            return
        with torch.inference_mode():  # buffers grown within a forward are inference tensors: changed in place here only
            self.seen.copy_(self.base_mask)
            self.count.fill_(n)
            self.ids.fill_(self.width)
            self.ids[:n], self.rows[:n] = self.base, self.base_rows

    def _allocate(self, capacity: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        # One row past ``capacity`` takes the writes of ids that are not new; it is never filled.
        self.ids = torch.full((capacity + 1,), self.width, dtype=torch.long, device=self.device)
        self.rows = torch.zeros(capacity + 1, self.weight.shape[1], dtype=self.weight.dtype, device=self.device)
        self.ids[: len(ids)], self.rows[: len(rows)] = ids, rows
        self.version += 1

    def filled(self) -> int:
        """The rows filled: a host read."""
        return int(self.count)

    def read(self, token_ids: torch.Tensor) -> None:
        """Add the ids of ``token_ids`` not yet scored, each once, in the next free rows."""
        if host_reads_free(self.device) and self.seen[token_ids].all():
            return  # most reads, checked where the check is free: the appending below is a dozen small kernels
        self.make_room(len(token_ids))
        self.append(token_ids)

    def make_room(self, n: int) -> None:
        """Make sure the next ``n`` ids read find free rows: on the host, reading the true count only when
        the spare rows could run out, and growing the buffers (a new ``version``) if they must."""
        capacity = len(self.ids) - 1
        if self.bound + n > capacity:
            filled = self.filled()
            if filled + n > capacity:
                self._allocate(filled + n + self.spare, self.ids[:filled], self.rows[:filled])
            self.bound = filled
        self.bound += n

    def append(self, token_ids: torch.Tensor) -> None:
        """``read``'s work on the device, after ``make_room``: no host read, no new buffer, so a CUDA
        graph can hold it."""
        n = len(token_ids)
        order = torch.arange(n, device=self.device)
        self.claims[token_ids] = order  # of repeated ids one read is kept, whichever
        new = ~self.seen[token_ids] & (self.claims[token_ids] == order)
        slots = torch.where(new, self.count + new.cumsum(0) - 1, len(self.ids) - 1)
        self.ids[slots] = torch.where(new, token_ids, self.width)
        self.rows[slots] = self.weight[token_ids] * new[:, None].to(self.rows.dtype)
        self.seen.index_fill_(0, token_ids, True)  # the value a kernel argument: nothing copied from the host
        self.count += new.sum()

    @contextlib.contextmanager
    @torch.inference_mode()
    def unchanged(self):
        """Within it, ``append`` leaves no trace: a graph's capture runs its forward on made-up ids. (The
        rows it writes lie past the count, and score nothing once their ids are ``width`` again.)"""
        held = [t.clone() for t in (self.seen, self.count, self.ids)]
        try:
            yield
        finally:
            for t, kept in zip((self.seen, self.count, self.ids), held, strict=True):
                t.copy_(kept)

    def scored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids and rows to score: on a CPU the filled ones, elsewhere all (no host read)."""
        if host_reads_free(self.device):
            filled = self.filled()
            return self.ids[:filled], self.rows[:filled]
        return self.ids, self.rows

    def logits(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits [rows, width] from the ``scores`` [rows, len(ids)] of the rows of ``ids``."""
        out = torch.full((scores.shape[0], self.width + 1), float("-inf"), dtype=scores.dtype, device=self.device)
        out[:, ids] = scores
        return out[:, : self.width]


class HFCausalLM:
    """A transformers model with its own DynamicCache, speaking the decode loop's protocol (decoding.decode.CausalLM).

    With ``head_tokens`` the vocabulary projection covers only those ids plus every id the
    model has read since ``reset`` (so identifiers in the prompt stay predictable); the rest get
    logit -inf. For a small draft the full projection is most of a forward's cost. Verification
    stays exact: drafts come from, and are judged against, this restricted distribution.
    """

    prefill_chunk = 0  # a plain forward over more tokens than this runs in chunks of it (0: whole)
    progress: Callable[[int, int], None] | None = None  # told (tokens done, tokens) after each chunk
    feature_layers: tuple[int, ...] | None = None  # see record_features
    features: torch.Tensor | None = None  # [n, len(feature_layers) * hidden]: the last forward's, every token
    _taps: dict | None = None  # the forward under way fills it: layer -> [n, hidden]

    def __init__(self, model, width: int, head_tokens: torch.Tensor | None = None, fast: FastLlama | None = None):
        self.model = model
        self.fast = fast  # specbench's own forward over the same weights (models/fast.py), or None: transformers'
        self.fast_head = None  # (the shortlisted head, its linear map in the fast forward)
        self.width = width  # logits beyond the shared width are dropped so p and q align
        self.device = model.device
        self.queries: list[torch.Tensor] | None = None  # see watch_queries
        self.shortlist = None
        if head_tokens is not None:
            self.shortlist = ShortlistedHead(self.model.get_output_embeddings().weight, head_tokens, width)
        self.reset()

    @classmethod
    def loaded(cls, model, width: int, head_tokens: torch.Tensor | None, compile: bool, name: str) -> HFCausalLM:
        """``model`` (called ``name`` in the log) on specbench's own forward where ``compile`` asks
        for it and models/fast.py covers the model, else on transformers' eager one."""
        fast = None
        if compile and (reason := unsupported(model)):
            log.info("%s runs transformers' eager forward: %s", name, reason)
        elif compile:
            fast = FastLlama(model)
        return cls(model, width, head_tokens, fast)

    @property
    def route(self) -> str:
        """What runs the forward (the compile column's value): transformers' eager one, or the fast one's route."""
        return "eager" if self.fast is None else self.fast.route

    def forward_facts(self) -> dict:
        """What meta.json and the run's last line say of this model's forward: its route, what building
        it took, and how a CPU runs its products of each row count."""
        facts = {"route": self.route, "build_s": self.fast.build_seconds if self.fast else 0.0}
        if self.fast is not None and self.fast.plan:
            facts["row_plan"] = {n: str(how) for n, how in self.fast.plan.items()}
        return facts

    def release(self) -> None:
        """Drop what this model's forward holds on its device beside the module (specbench's forward over
        its weights, the cache, a shortlisted head): before another engine loads the model onto the same
        memory. It decodes no more."""
        self.fast = self.fast_head = self.shortlist = None
        self.drop_cache()

    def drop_cache(self) -> None:
        """release's part for the cache."""
        self.cache = None

    def refresh(self, more_tokens: torch.Tensor) -> None:
        """After the weights changed (online updates): gather the shortlisted head again from them,
        with ``more_tokens`` added to the shortlist. Takes effect at the next ``reset``."""
        if self.fast is not None:  # its packed copies of the weights are stale; its row counts hold
            self.fast = FastLlama(self.model, self.fast.packed, self.fast.compiled, self.fast.plan, self.fast.joined)
        if self.shortlist is None:
            return  # the full projection reads the weights themselves
        self.shortlist.extend(more_tokens)

    @property
    def head_tokens(self) -> torch.Tensor | None:
        """The shortlist's own ids (None: the whole vocabulary is scored)."""
        return None if self.shortlist is None else self.shortlist.base

    def reset(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.cache = DynamicCache(config=self.model.config)
        grow = growing_layer()
        self.cache.layers = [grow() if type(layer) is DynamicLayer else layer for layer in self.cache.layers]
        self.reset_shortlist()

    def reset_shortlist(self) -> None:
        """The shortlisted head back to its own ids, before a new sequence (a no-op without one)."""
        if self.shortlist is not None:
            self.shortlist.reset()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def _inputs(self, token_ids: torch.Tensor, positions: torch.Tensor | None, mask: torch.Tensor | None) -> dict:
        """Keyword arguments of the model call; without positions and mask, exactly the linear decode's."""
        inputs = {"input_ids": token_ids.view(1, -1), cache_keyword(type(self.model)): self.cache, "use_cache": True}
        if positions is None and mask is None:
            return inputs
        n, past = token_ids.shape[0], self.cache.get_seq_length()
        if positions is None:
            positions = torch.arange(past, past + n, device=self.device)
        inputs["position_ids"] = positions.to(self.device).view(1, -1)  # transformers feeds these to RoPE as given
        if mask is not None:  # a 4D mask reaches attention untouched
            inputs["attention_mask"] = self._additive(mask, past)[None, None]
        return inputs

    def _additive(self, mask: torch.Tensor, past: int) -> torch.Tensor:
        """A bool mask [n, past + n] as attention takes it: additive, in the model's dtype (eager
        attention adds a mask to the scores, so a bool would be added as 0/1; sdpa accepts this too)."""
        n = mask.shape[0]
        if mask.shape != (n, past + n):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected ({n}, {past + n})")
        dtype = self.model.dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=self.device)
        return additive.masked_fill_(~mask.to(self.device), torch.finfo(dtype).min)

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        """Start a new sequence with the prompt."""
        self.reset()
        self.forward(prompt_ids, last=1)

    def record_features(self, layers: tuple[int, ...] | None) -> None:
        """From the next forward on, keep in ``features`` the inputs of these decoder layers (index
        len(layers): the final normed states) side by side, for every token a forward reads, as an
        EAGLE head drafts from them; None stops (the copies cost a little, so only a head's decode pays)."""
        self.feature_layers, self.features = layers, None

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        last: int = 1,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n, chunk = len(token_ids), self.prefill_chunk
        if positions is not None or mask is not None or not chunk or n <= chunk:
            return self._forward(token_ids, last, positions, mask)
        # A long prompt in chunks: attention's memory grows with chunk x context, not context^2.
        tail = max(last, n - (n - 1) // chunk * chunk)  # the final chunk, which yields the logits
        features = []
        for start in range(0, n - tail, chunk):
            self._forward(token_ids[start : min(start + chunk, n - tail)], 1, None, None)
            features.append(self.features)
            if self.progress is not None:
                self.progress(min(start + chunk, n - tail), n)
        logits = self._forward(token_ids[n - tail :], last, None, None)
        if self.feature_layers is not None:
            self.features = torch.cat([*features, self.features])
        if self.progress is not None:
            self.progress(n, n)
        return logits

    def watch_queries(self) -> None:
        """Record each layer's query at the newest position of the next forwards (a retrieval view
        of this cache scores its chunks with them)."""
        self.queries = [None] * len(self.model.base_model.layers)

    def take_queries(self) -> list[torch.Tensor]:
        """The recorded queries, [heads, head_dim] per layer, rotated to the newest position as
        attention rotates them (RoPE); recording stops."""
        config = self.model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        position = ids_to_device([[self.length - 1]], self.device)
        queries, self.queries = self.queries, None
        rotated = []
        for query in queries:
            q = query.view(1, heads, 1, head_dim)
            cos, sin = self.model.base_model.rotary_emb(q, position_ids=position)
            halves = torch.cat([-q[..., head_dim // 2 :], q[..., : head_dim // 2]], dim=-1)
            rotated.append((q * cos[:, None] + halves * sin[:, None])[0, :, 0])
        return rotated

    def _forward(
        self, token_ids: torch.Tensor, last: int, positions: torch.Tensor | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        self._taps = None if self.feature_layers is None else dict.fromkeys(self.feature_layers)
        hooks = [] if self.fast is not None else self._hooks()  # the fast forward records them itself
        try:
            logits = self._call(token_ids, last, positions, mask)
        finally:
            for hook in hooks:
                hook.remove()
        if self._taps is not None:
            self.features = torch.cat([self._taps[i] for i in self.feature_layers], dim=-1)
        return logits

    def _hooks(self) -> list:
        """Forward hooks on transformers' modules that record queries and features (see watch_queries
        and record_features)."""
        base, hooks = self.model.base_model, []
        if self.queries is not None:
            hooks += [
                layer.self_attn.q_proj.register_forward_hook(
                    lambda _module, _inputs, output, i=i: self.queries.__setitem__(i, output[0, -1].detach().clone())
                )
                for i, layer in enumerate(base.layers)
            ]
        for i in self._taps or ():
            if i < len(base.layers):
                hook = base.layers[i].register_forward_pre_hook(
                    lambda _module, args, kwargs, i=i: self._taps.__setitem__(
                        i, (args[0] if args else kwargs["hidden_states"])[0]
                    ),
                    with_kwargs=True,
                )
            else:
                hook = base.norm.register_forward_hook(lambda _m, _i, out, i=i: self._taps.__setitem__(i, out[0]))
            hooks.append(hook)
        return hooks

    def _call(
        self, token_ids: torch.Tensor, last: int, positions: torch.Tensor | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if self.fast is not None:
            return self._fast_call(token_ids, last, positions, mask)
        inputs = self._inputs(token_ids, positions, mask)
        if self.shortlist is None:
            out = self.model(**inputs, logits_to_keep=last)
            return out.logits[0, :, : self.width]
        self.shortlist.read(token_ids.to(self.device))
        hidden = self.model.base_model(**inputs).last_hidden_state[0, -last:]
        ids, rows = self.shortlist.scored()
        return self.shortlist.logits(hidden @ rows.T, ids)

    def _fast_call(
        self, token_ids: torch.Tensor, last: int, positions: torch.Tensor | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        n, past = token_ids.shape[0], self.cache.get_seq_length()
        if positions is None:
            positions = torch.arange(past, past + n, device=self.device)
        if mask is None and n > 1:  # a causal append: each token sees the cache and the tokens before it
            mask = torch.ones(n, past + n, dtype=torch.bool, device=self.device).tril(past)
        if mask is not None:
            mask = self._additive(mask, past)
        ids = token_ids.to(self.device)
        hidden = self.fast.hidden(ids, positions.to(self.device), self.cache, mask, last, self.queries, self._taps)
        return self._fast_head(hidden, ids)

    def _fast_head(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits [rows, width] of the fast forward's final states ``hidden`` [rows, hidden] after it read
        ``ids``: the whole projection, or the shortlist (which ``ids`` may grow)."""
        if self.shortlist is None:
            return self.fast.logits(hidden)[:, : self.width]
        self.shortlist.read(ids)
        scored, rows = self.shortlist.scored()
        # A packed copy (a CPU's, where counting is free) is a snapshot: made again when a row is
        # filled. An unpacked map reads the buffers themselves: only new buffers need a new map.
        key = (self.shortlist.version, len(rows), self.shortlist.filled() if self.fast.packed else None)
        if self.fast_head is None or self.fast_head[0] != key:
            self.fast_head = key, self.fast.linear(rows)
        return self.shortlist.logits(self.fast_head[1](hidden), scored)

    @torch.inference_mode()  # the cache holds inference tensors, which only change in place in this mode
    def keep(self, path: Sequence[int], new: int) -> None:
        """Of the newest ``new`` cache positions keep those at offsets ``path`` (ascending), in order.

        The shortlist keeps every id read, dropped ones included: it stays exact because drafts
        are sampled from, and verified against, the same restricted distribution.
        """
        path = list(path)
        if path != list(range(len(path))):
            offsets = ids_to_device(path, self.device)
            for layer in self.cache.layers:
                if not layer.is_initialized:
                    continue
                start = layer.keys.shape[-2] - new
                index = (offsets + start).to(layer.keys.device)  # a device map may put layers on other GPUs
                for states in (layer.keys, layer.values):  # [batch, heads, length, dim]
                    states[:, :, start : start + len(path)] = states.index_select(2, index)
        if new > len(path):
            self.cache.crop(-(new - len(path)))  # transformers 5.x: a negative count removes that many positions


class PartialLM(HFCausalLM):
    """A model whose cache holds part of the sequence it reads, as ``window`` (a kv.Window) keeps
    account; ``length`` is the sequence's."""

    def __init__(self, model, width: int, head_tokens, window: Window, fast: FastLlama | None = None):
        self.window = window
        super().__init__(model, width, head_tokens, fast)

    def reset(self) -> None:
        super().reset()
        self.window.read = 0

    @property
    def length(self) -> int:
        return self.window.read

    @torch.inference_mode()
    def keep(self, path: Sequence[int], new: int) -> None:
        super().keep(path, new)
        self.window.read -= new - len(path)


class CacheView(PartialLM):
    """A model over a part of a sequence's KV cache. Its cache holds fewer positions than the
    sequence, so it gives each token its true position (RoPE) itself. With ``streaming`` it keeps
    only the sinks and the most recent positions, ``budget`` in all, cutting the window back every
    EVICT_SLACK tokens (the target over a window of its own cache)."""

    def __init__(
        self,
        model,
        width: int,
        head_tokens=None,
        budget: int = 0,
        streaming: bool = False,
        fast: FastLlama | None = None,
    ):
        self.streaming = streaming
        super().__init__(model, width, head_tokens, Window(budget), fast)

    def _call(self, token_ids, last, positions, mask):
        if mask is not None:
            raise ValueError("a cache view drafts chains: it takes no tree mask")
        if self.streaming:
            self._evict(len(token_ids))
        read = self.window.read
        positions = torch.arange(read, read + len(token_ids), device=self.device)
        logits = super()._call(token_ids, last, positions, None)
        self.window.read += len(token_ids)
        return logits

    def _evict(self, incoming: int) -> None:
        """Cut the window back to the sinks and the newest positions, leaving room for ``incoming``."""
        held = self.cache.get_seq_length()
        if not self.window.overflows(held, incoming):
            return
        kept = on_each_device(self.window.kept(held, incoming))
        for layer in self.cache.layers:
            if layer.is_initialized:
                index = kept(layer.keys.device)
                layer.keys, layer.values = layer.keys.index_select(2, index), layer.values.index_select(2, index)


def on_each_device(host: torch.Tensor) -> Callable[[torch.device], torch.Tensor]:
    """``host`` (positions the host computed) on a device, sent once to each device asked for and
    without a wait (to_device): a device map may put a cache's layers on several GPUs, and a copy per
    layer from pageable memory would wait for the device at each."""
    return cache(lambda device: to_device(host, device))


class SparseView(CacheView):
    """The target over a part of its own KV cache (self-speculation): the sinks and the chunks its
    last query scores highest (TriForce's retrieval cache), or a recent window. Built from the full
    cache after the target's prefill, once per sequence; the tokens it drafts are appended.

    As in TriForce, every token the target has read since is held with the target's own keys and
    values (computed over the whole cache), not the view's: before each forward the view takes them
    over from the target's cache, in place of its own entries for those positions, and skips the
    input tokens they cover. So after a round that accepted every draft it reads only the target's
    bonus token, never its own last draft with it (a 2-token forward costs 1.5-2 one-token ones on
    some CPUs). Its drafts stay its own samples, so verification stays exact."""

    def __init__(self, full: HFCausalLM, budget: int, policy: str):
        self.full, self.policy = full, policy
        super().__init__(full.model, full.width, None, budget, streaming=policy == "window", fast=full.fast)

    def watch(self) -> None:
        """Call before the target's prefill: retrieval scores chunks with the last prompt token's queries."""
        if self.policy == "retrieval":
            self.full.watch_queries()

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor) -> None:
        if self.full.length != len(prompt_ids):
            raise ValueError("a sparse view is built from the target's cache right after its prefill")
        self.reset()
        queries = self.full.take_queries() if self.policy == "retrieval" else None
        kept = on_each_device(self.window.kept(len(prompt_ids)))
        for i, layer in enumerate(self.full.cache.layers):
            keys, values = layer.keys, layer.values  # [1, kv_heads, length, head_dim]
            kv_heads = keys.shape[1]
            if queries is None:
                chosen = kept(keys.device).expand(kv_heads, -1)
            else:
                chosen = retrieval_positions(queries[i], keys[0], self.window.budget)
            index = chosen[None, :, :, None].expand(-1, -1, -1, keys.shape[-1])
            self.cache.update(keys.gather(2, index), values.gather(2, index), i)
        self.window.read = self.verified = len(prompt_ids)

    def _call(self, token_ids, last, positions, mask):
        read = self.window.read
        self._take_verified()
        return super()._call(token_ids[self.window.read - read :], last, positions, mask)

    def _take_verified(self) -> None:
        """Hold the positions the target has read since the last call with the target's keys and values."""
        upto = self.full.length
        if upto <= self.verified or self.window.read > upto:  # nothing new, or drafts of its own past it (mid-round)
            return
        # The view's entries from the last verified position on are its newest (its own reading of
        # those tokens, and drafts): they give way to the target's.
        drop = self.window.read - self.verified
        if drop:
            self.cache.crop(-drop)
        for i, layer in enumerate(self.full.cache.layers):
            self.cache.update(layer.keys[:, :, self.verified : upto], layer.values[:, :, self.verified : upto], i)
        self.window.read = self.verified = upto


class WindowLM(PartialLM):
    """A (small) model over a streaming window of the sequence (StreamingLLM; TriForce's bottom
    level): its cache holds the first tokens and the most recent ones, ``budget`` in all. As in
    StreamingLLM, positions are those within its cache, not in the sequence, so a draft trained on
    short sequences never reads a position beyond ``budget + EVICT_SLACK`` (the shipped draft, trained
    on 256-token sequences, accepts 0.58 at 200 tokens of context and 0.26 at 800 with true
    positions). When the window is full it reads itself again from its tokens, the sinks and the
    newest, at positions 0..: a forward of at most ``budget`` tokens every ``EVICT_SLACK`` tokens.
    A long prompt is read the same way, as its window only. ``length`` is the sequence's."""

    def __init__(self, model, width: int, head_tokens=None, budget: int = 256, fast: FastLlama | None = None):
        super().__init__(model, width, head_tokens, Window(budget), fast)

    def reset(self) -> None:
        super().reset()
        # The tokens in its cache, in order, on the device: the drafted ones never go through the host,
        # which reads once a round.
        self.ids = torch.empty(0, dtype=torch.long, device=self.device)

    def _call(self, token_ids, last, positions, mask):
        if mask is not None:
            raise ValueError("a window model drafts chains: it takes no tree mask")
        read = self.window.read + len(token_ids)
        token_ids = token_ids.to(self.device)
        if self.window.overflows(len(self.ids), len(token_ids)):
            every = torch.cat([self.ids, token_ids])
            token_ids = every[to_device(self.window.kept(len(every)), self.device)]
            HFCausalLM.reset(self)  # empties the cache only: the window still counts the whole sequence read
            self.ids = self.ids[:0]
        logits = super()._call(token_ids, last, None, None)  # positions follow the cache: within the window
        self.ids = torch.cat([self.ids, token_ids])
        self.window.read = read
        return logits

    @torch.inference_mode()
    def keep(self, path: Sequence[int], new: int) -> None:
        super().keep(path, new)
        if new:
            path = list(path)
            kept = self.ids[len(self.ids) - new :][ids_to_device(path, self.device)] if path else self.ids[:0]
            self.ids = torch.cat([self.ids[: len(self.ids) - new], kept])
