"""Token trees: their shape, a level drawn from a model's rows, and trees drafted by a model or by lookup."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specbench.decoding.decode import CausalLM, Draft
from specbench.decoding.sampling import SamplingConfig, Verdict, sample, warp
from specbench.decoding.tree import tree_inputs
from specbench.drafters.lookup import PromptLookupDrafter


def tree_parents(shape: Sequence[int]) -> list[int]:
    """Parents of a full tree in level order: ``shape[d]`` children for every node at depth d
    (the root, the last accepted token, is -1). ``(1,) * K`` is a chain of K."""
    parents, level = [], [-1]
    for branching in shape:
        start = len(parents)
        parents += [parent for parent in level for _ in range(branching)]
        level = list(range(start, len(parents)))
    return parents


def tree_level(
    rows: torch.Tensor, branching: int, cfg: SamplingConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``branching`` children for each row of logits [n, V], each row's together (as tree_parents
    numbers them): its top-b ids under greedy, b independent draws from its warped row under
    sampling. Returns the ids [n * b] and the q row each was drawn from (None under greedy)."""
    if cfg.greedy:
        return rows.topk(branching, dim=-1).indices.flatten(), None
    q = warp(rows, cfg)
    drawn = sample(q.unsqueeze(1).expand(-1, branching, -1), generator).flatten()  # b races per row: no host read
    return drawn, q.repeat_interleave(branching, dim=0)


class TreeDrafter:
    """Drafts a token tree of a fixed shape with a small model, one forward per level.

    Under greedy a node's children are the draft's top-b tokens there; under sampling they are b
    independent draws from its warped distribution (the q row all b share). Each level is read in
    one forward with the tree mask, so a node sees only its own ancestors; the leaves are never read.
    """

    def __init__(self, model: CausalLM, cfg: SamplingConfig, generator: torch.Generator, shape: Sequence[int]):
        self.model, self.cfg, self.generator, self.shape = model, cfg, generator, tuple(shape)
        self.parents = tree_parents(self.shape)
        self.inner = len(self.parents) - math.prod(self.shape)  # the nodes it reads: all but the leaves

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.model.prefill(prompt_ids)
        self.pending = first

    def propose(self, k: int) -> Draft:
        self.read = len(self.pending)
        rows = self.model.forward(self.pending, last=1)
        base = self.model.length
        positions, mask = tree_inputs(self.parents, base, rows.device)
        tokens, q_rows, start = [], [], 0
        for depth, branching in enumerate(self.shape):
            level, q = tree_level(rows, branching, self.cfg, self.generator)
            if q is not None:
                q_rows.append(q)
            tokens.append(level)
            end = start + len(level)
            if depth + 1 < len(self.shape):
                rows = self.model.forward(
                    level, last=len(level), positions=positions[start:end], mask=mask[start:end, : base + end]
                )
            start = end
        q = torch.cat(q_rows) if q_rows else None
        return Draft(torch.cat(tokens), self.parents, q, forwards=len(self.shape))

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        kept = [n for n in verdict.path if n < self.inner]
        self.model.keep(list(range(self.read)) + [self.read + n for n in kept], self.read + self.inner)
        leaf = [n for n in verdict.path if n >= self.inner]  # an accepted leaf, which the draft never read
        self.pending = torch.cat([draft.tokens[leaf], verdict.next_token])


class LookupTreeDrafter(PromptLookupDrafter):
    """Prompt lookup with several candidates: the continuations of every earlier occurrence of the
    sequence's last n tokens (the longest n that occurs), most recent first, merged into a trie of
    at most ``nodes`` tokens and ``depth`` levels. Deterministic candidates, so exact under sampling."""

    def __init__(self, nodes: int, depth: int, max_ngram: int = 3):
        super().__init__(max_ngram)
        self.nodes, self.depth = nodes, depth

    def propose(self, k: int) -> Draft:
        tokens, parents, index = [], [], {}
        for continuation in self.continuations(self.depth):
            parent = -1
            for token in continuation:
                if (parent, token) not in index:
                    if len(tokens) == self.nodes:
                        break
                    index[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                parent = index[(parent, token)]
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device), parents, None)
