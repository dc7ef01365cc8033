"""Token trees drafted by a small model, one forward per level, or by prompt lookup."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specbench.decoding.decode import CausalLM, Draft
from specbench.decoding.sampling import Sampling, Verdict
from specbench.decoding.transfer import ids_to_device
from specbench.drafters.lookup import PromptLookupDrafter
from specbench.drafters.propose import propose_tree, tree_parents


class TreeDrafter:
    """Drafts a token tree of a fixed shape with a small model, one forward per level.

    Under greedy a node's children are the draft's top-b tokens there; under sampling they are b
    independent draws from its warped distribution (the q row all b share). Each level is read in
    one forward with the tree mask, so a node sees only its own ancestors; the leaves are never read.
    """

    def __init__(self, model: CausalLM, sampling: Sampling, generator: torch.Generator, shape: Sequence[int]):
        self.model, self.sampling, self.generator, self.shape = model, sampling, generator, tuple(shape)
        self.parents = tree_parents(self.shape)
        self.inner = len(self.parents) - math.prod(self.shape)  # the nodes it reads: all but the leaves

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.model.prefill(prompt_ids)
        self.pending = first

    def propose(self, k: int) -> Draft:
        self.read = len(self.pending)
        rows = self.model.forward(self.pending, last=1)

        def read(level, rows, branching, positions, mask):
            return self.model.forward(level, last=len(level), positions=positions, mask=mask)

        tokens, parents, q = propose_tree(
            self.shape, self.model.length, rows, lambda rows: rows, read, self.sampling, self.generator
        )
        return Draft(tokens, parents, q, forwards=len(self.shape))

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        kept = [n for n in verdict.path if n < self.inner]
        self.model.keep(list(range(self.read)) + [self.read + n for n in kept], self.read + self.inner)
        # An accepted leaf (at most one: a path's last node), which the draft never read. A slice, not a
        # list index: on CUDA that would copy the list from the host and wait.
        leaf = verdict.path[-1] if verdict.path and verdict.path[-1] >= self.inner else len(draft.tokens)
        self.pending = torch.cat([draft.tokens[leaf : leaf + 1], verdict.next_token])


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
        return Draft(ids_to_device(tokens, self.device), parents, None)
