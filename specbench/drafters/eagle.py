"""EAGLE drafting: chains, trees and EAGLE-2's dynamic trees from an EAGLE head
(models/eagle_head.py) reading the target's own features.
"""

from __future__ import annotations

import torch

from specbench.decoding.decode import Draft
from specbench.decoding.sampling import Sampling, Verdict
from specbench.decoding.transfer import ids_to_device, to_device
from specbench.drafters.propose import propose_chain, propose_tree
from specbench.models.eagle_head import EagleHead


class EagleDrafter:
    """Drafts with an EAGLE head from the features ``target`` records (a chain of K, or a tree).

    Between rounds it holds the pairs it has not read: the accepted tokens and the next one, each
    with the target's feature of the position before it. ``shape`` drafts a tree of that shape
    (as drafters.TreeDrafter: top-b children under greedy, b draws from q under sampling);
    ``dynamic`` = (nodes, width) drafts EAGLE-2's dynamic tree (see ``_dynamic``); with ``p_min`` a
    chain stops before the first token the head is not confident of (sampling.confident)."""

    def __init__(
        self,
        head: EagleHead,
        target,
        width: int,
        sampling: Sampling,
        generator: torch.Generator,
        shape: tuple[int, ...] | None = None,
        dynamic: tuple[int, int] | None = None,
        p_min: float | None = None,
    ):
        self.head, self.target, self.width, self.sampling, self.generator = head, target, width, sampling, generator
        self.shape, self.dynamic, self.p_min = shape, dynamic, p_min

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.cache = self.head.new_cache()
        # The pair at position t: the target's feature there, and the token at t + 1.
        self.tokens, self.features = torch.cat([prompt_ids[1:], first]), self.target.features

    def _full(self, q: torch.Tensor) -> torch.Tensor:
        """Rows over the draft vocabulary [n, draft_vocab] as rows over the target's [n, width]: zero
        beyond it. Warping over the draft vocabulary is warping the full row with -inf beyond it."""
        rows = q.new_zeros(len(q), self.width)
        rows[:, self.head.draft_ids] = q
        return rows

    def _read_pending(self) -> torch.Tensor:
        """Read the pairs not yet read; returns the layer's output at the newest [1, h]."""
        self.base = self.cache.length
        n = len(self.tokens)
        positions = torch.arange(self.base, self.base + n, device=self.tokens.device)
        out = self.head.step(self.tokens, self.head.fuse(self.features), positions, self.cache)
        self.base += n
        return out[-1:]

    def propose(self, k: int) -> Draft:
        if k == 0:
            self.read = False
            return Draft.chain(self.tokens[:0], None)
        self.read = True
        with torch.inference_mode():
            out = self._read_pending()
            if self.dynamic is not None:
                return self._dynamic(out, k)
            if self.shape is not None:
                return self._tree(out)
            return self._chain(out, k)

    def _chain(self, out: torch.Tensor, k: int) -> Draft:
        def row_after(token: torch.Tensor | None) -> torch.Tensor:
            nonlocal out
            if token is not None:  # the head reads its last draft with its own output
                position = ids_to_device([self.cache.length], out.device)
                out = self.head.step(self.head.draft_ids[token], out, position, self.cache)
            return self.head.draft_logits(out)[0]

        chain = propose_chain(k, row_after, self.sampling, self.generator, self.p_min)
        tokens = self.head.draft_ids[torch.cat(chain.tokens)] if chain.tokens else self.tokens[:0]
        return Draft.chain(tokens, None if chain.q is None else self._full(chain.q), forwards=chain.forwards)

    def _tree(self, out: torch.Tensor) -> Draft:
        def read(level, out, branching, positions, mask):  # each child reads its parent's output
            return self.head.step(level, out.repeat_interleave(branching, dim=0), positions, self.cache, mask)

        tokens, parents, q = propose_tree(
            self.shape, self.base, out, self.head.draft_logits, read, self.sampling, self.generator, self.head.draft_ids
        )
        return Draft(tokens, parents, None if q is None else self._full(q), forwards=len(self.shape))

    def _dynamic(self, out: torch.Tensor, depth: int) -> Draft:
        """EAGLE-2's dynamic tree, ``depth`` levels deep: at each level the ``width`` most probable
        nodes of the last (by the product of the draft's probabilities along their branch) are read
        in one forward and offer their ``width`` most probable children; of every node offered, the
        ``nodes`` most probable make the tree. A node is never more probable than its parent (ties go
        to the shallower), so the tree holds every chosen node's ancestors. The candidates are
        deterministic given the draft (q is None), which tree verification takes exactly, under
        sampling too."""
        nodes, width = self.dynamic
        tokens, parents, scores = [], [], []  # every node offered (a draft id), with its branch's log-probability
        outs, frontier, read = {-1: out}, [-1], []  # the layer's output per node read; nodes in the cache
        for level in range(depth):
            rows = torch.cat([outs[n] for n in frontier])
            offered = torch.log_softmax(self.head.draft_logits(rows).float(), dim=-1).topk(width)
            new = []
            for row, parent in enumerate(frontier):
                above = scores[parent] if parent >= 0 else 0.0
                for value, token in zip(offered.values[row].tolist(), offered.indices[row].tolist(), strict=True):
                    new.append(len(tokens))
                    tokens.append(token)
                    parents.append(parent)
                    scores.append(above + value)
            if level + 1 == depth:
                break
            frontier = sorted(new, key=lambda n: -scores[n])[:width]
            read += frontier
            # Each reads the pending pairs and its ancestors (all read at earlier levels) and itself.
            mask = torch.zeros(len(frontier), self.base + len(read), dtype=torch.bool)  # built on the host
            mask[:, : self.base] = True
            lineages = [_lineage(n, parents) for n in frontier]
            for row, lineage in enumerate(lineages):
                mask[row, [self.base + read.index(n) for n in lineage]] = True
            mask = to_device(mask, out.device)
            positions = ids_to_device([self.base + len(lineage) - 1 for lineage in lineages], out.device)
            ids = self.head.draft_ids[ids_to_device([tokens[n] for n in frontier], out.device)]
            hidden = torch.cat([outs[parents[n]] for n in frontier])
            result = self.head.step(ids, hidden, positions, self.cache, mask)
            outs.update({n: result[row : row + 1] for row, n in enumerate(frontier)})
        ranked = sorted(range(len(tokens)), key=lambda n: (-scores[n], len(_lineage(n, parents))))
        chosen = sorted(ranked[:nodes])  # a parent was offered before its children: index order keeps it first
        index = {n: i for i, n in enumerate(chosen)}
        return Draft(
            self.head.draft_ids[ids_to_device([tokens[n] for n in chosen], out.device)],
            [index[parents[n]] if parents[n] >= 0 else -1 for n in chosen],
            None,
            forwards=depth,
        )

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        # Its own entries of the round give way: the accepted tokens are read again with the target's features.
        rows = [0] + [1 + i for i in verdict.path]
        tokens, features = torch.cat([draft.on_path(verdict.path), verdict.next_token]), self.target.features[rows]
        if self.read:
            self.cache.crop(self.base)
            self.tokens, self.features = tokens, features
        else:  # it read nothing this round: what it had not read comes first
            self.tokens, self.features = torch.cat([self.tokens, tokens]), torch.cat([self.features, features])

    def read_round(self, draft: Draft, verdict: Verdict) -> None:
        """A round another drafter proposed (drafters.chained): the tokens the target kept, with its
        features there, join what the head reads with its next forward."""
        self.read = False
        self.accepted(draft, verdict)


def _lineage(node: int, parents: list[int]) -> list[int]:
    """``node`` and its ancestors, the root's child first."""
    chain = []
    while node >= 0:
        chain.append(node)
        node = parents[node]
    return chain[::-1]
