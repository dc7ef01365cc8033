"""KV caches as tensors (pure tensor code, no models): buffers that grow in place, and which cached
positions a partial view of a cache keeps.

Two policies, both keeping the first tokens, on which attention piles up whatever they hold
(StreamingLLM's attention sinks):
- window (StreamingLLM): the sinks and the most recent tokens;
- retrieval (TriForce): the sinks and the chunks of consecutive tokens whose mean key the last
  query scores highest, chosen per layer and per key/value head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbench.core.options import SINKS

CHUNK = 8  # tokens per retrieval chunk (TriForce's default)
EVICT_SLACK = 32  # a window may outgrow its budget by this much before it is cut back (one copy per 32 tokens)


class GrowingKV:
    """Keys and values [batch, kv_heads, length, head_dim] appended in place: views of two buffers with
    room to spare, reallocated a quarter larger only when full. Concatenating instead copies the whole
    cache at every forward: at 8k tokens of SmolLM2-135M on a CPU, a fifth of a step. One serves each
    layer of a model's cache (models/lm.py) and of an EAGLE head's (models/eagle_head.py)."""

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(
        self, held: tuple[torch.Tensor, torch.Tensor] | None, length: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys`` and ``values`` after the first ``length`` positions of ``held`` (the cache's
        keys and values as its owner holds them: these buffers' views, or tensors that replaced them,
        as a crop or an eviction does) and return views of the ``length + n`` positions."""
        n = keys.shape[-2]
        ours = held is not None and self.buffers is not None and held[0].data_ptr() == self.buffers[0].data_ptr()
        if not ours or length + n > self.buffers[0].shape[-2]:
            room = length + n + max(256, (length + n) // 4)
            olds = held if held is not None else (None, None)
            self.buffers = tuple(_grown(old, new, length, room) for old, new in zip(olds, (keys, values), strict=True))
        for buffer, new in zip(self.buffers, (keys, values), strict=True):
            buffer[:, :, length : length + n] = new
        return tuple(buffer[:, :, : length + n] for buffer in self.buffers)


def _grown(old: torch.Tensor | None, new: torch.Tensor, length: int, room: int) -> torch.Tensor:
    buffer = new.new_empty(*new.shape[:2], room, new.shape[-1])
    if length:
        buffer[:, :, :length] = old[:, :, :length]
    return buffer


def window_positions(length: int, budget: int, sinks: int = SINKS) -> torch.Tensor:
    """The first ``sinks`` and the last ``budget - sinks`` of ``length`` positions (all when they fit)."""
    if length <= budget:
        return torch.arange(length)
    return torch.cat([torch.arange(sinks), torch.arange(length - (budget - sinks), length)])


@dataclass
class Window:
    """The account a partial view keeps of a sequence: ``budget`` cached positions, the first ``sinks``
    among them, and ``read``, the tokens of the sequence read so far (the view's length, more than it
    holds). A streaming view lets its cache outgrow the budget by ``slack`` before cutting it back to
    the sinks and the newest positions, so it copies its cache once per ``slack`` tokens, not per token."""

    budget: int
    sinks: int = SINKS
    slack: int = EVICT_SLACK
    read: int = 0

    def overflows(self, held: int, incoming: int) -> bool:
        """Whether ``incoming`` positions on top of ``held`` ones outgrow the budget and its slack."""
        return held + incoming > self.budget + self.slack

    def kept(self, held: int, incoming: int = 0) -> torch.Tensor:
        """The positions of ``held`` that a cut keeps, the sinks and the newest, leaving room for
        ``incoming`` within the budget (the sinks stay even when ``incoming`` alone fills it)."""
        return window_positions(held, max(self.budget - incoming, self.sinks), self.sinks)


def retrieval_positions(query: torch.Tensor, keys: torch.Tensor, budget: int, chunk: int = CHUNK) -> torch.Tensor:
    """Per key/value head, the positions of the chunks that ``query`` scores highest.

    query: [heads, d] the last token's query (after RoPE); keys: [kv_heads, length, d] the cached keys
    (after RoPE). Each whole chunk is scored by the query's dot product with its mean key; under
    grouped-query attention the scores of a group's query heads are summed, as the group reads one
    cache. Chunk 0 (the sinks) and the newest partial chunk are always kept. Returns [kv_heads, n]
    ascending positions, n <= budget and equal for every head (all positions when they fit).
    """
    kv_heads, length, d = keys.shape
    if length <= budget:
        return torch.arange(length, device=keys.device).expand(kv_heads, length)
    whole = length // chunk
    means = keys[:, : whole * chunk].float().view(kv_heads, whole, chunk, d).mean(2)
    grouped = query.float().view(kv_heads, -1, d)  # the query heads that share each key/value head
    scores = torch.einsum("hgd,hcd->hc", grouped, means)
    scores[:, 0] = float("inf")
    tail = torch.arange(whole * chunk, length, device=keys.device)  # the newest tokens, a partial chunk
    picked = scores.topk(min(max((budget - len(tail)) // chunk, 1), whole), dim=-1).indices.sort(-1).values
    positions = (picked[..., None] * chunk + torch.arange(chunk, device=keys.device)).flatten(1)
    return torch.cat([positions, tail.expand(kv_heads, -1)], dim=1)


class StaticKV:
    """Keys and values of every layer in buffers of ``capacity`` positions, allocated once and never
    moved (the static path, models/static.py): a forward writes its tokens at the slots it is given,
    attention reads the whole buffer under a mask, and dropping positions only moves ``length``. A
    buffer that never moves is what a CUDA graph can replay on, and what a compiled forward sees with
    one shape. Zeros at first, so slots never written hold no NaN that a masked score could carry."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.capacity = capacity
        self.length = 0  # positions held, on the host: the next forward writes from here

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Write ``keys`` and ``values`` [1, kv_heads, n, head_dim] at ``slots`` [n] of ``layer``; return
        the layer's whole buffers (stale slots included: the forward's mask hides them)."""
        self.keys[layer].index_copy_(2, slots, keys)
        self.values[layer].index_copy_(2, slots, values)
        return self.keys[layer], self.values[layer]

    def keep(self, offsets: torch.Tensor | None, kept: int, new: int) -> None:
        """Of the newest ``new`` positions keep ``kept``: those at ``offsets`` (ascending, on the
        buffers' device) moved to the front, or None when they are already there (a chain's accepted
        prefix, which costs no copy at all)."""
        start = self.length - new
        if offsets is not None:
            index = offsets + start
            for states in (*self.keys, *self.values):
                states[:, :, start : start + kept] = states.index_select(2, index)
        self.length = start + kept


def static_mask(start: torch.Tensor, tree: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [n, capacity] of ``n`` new tokens written at slots ``start`` [1]
    onwards of a StaticKV. ``tree`` [n, m] (bool, m >= n) says which of the m slots that end with the
    new ones each sees: [n, n] is among the new ones only (a chain's is lower triangular); wider, it
    also tells apart the slots just before them (a tree level's ancestors among the nodes read
    before it). Every slot before those m is seen; slots after the new ones are stale and hidden.
    Built on the device from these two tensors, so a compiled or graphed forward builds it itself
    and the host sends no mask."""
    n, m = tree.shape
    relative = torch.arange(capacity, device=tree.device) - (start + n - m)
    told = (relative >= 0) & (relative < m)
    allowed = (relative < 0) | (tree.index_select(1, relative.clamp(0, m - 1)) & told)
    return torch.zeros(allowed.shape, dtype=dtype, device=tree.device).masked_fill(~allowed, torch.finfo(dtype).min)
