"""EAGLE drafting: chains, trees and EAGLE-2's dynamic trees from an EAGLE head
(models/eagle_head.py) reading the target's own features.
"""

from __future__ import annotations

from operator import itemgetter

import torch

from specbench.decoding.decode import Draft
from specbench.decoding.sampling import Sampling, Verdict
from specbench.decoding.transfer import ids_to_device
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

    def _read_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the pairs not yet read; returns the layer's output at the newest [1, h] and the scores
        of the token after it [1, draft_vocab]."""
        out, logits = self.head.scored_step(self.tokens, self.head.fuse(self.features), self.cache)
        self.base = self.cache.length  # what a tree's nodes see before them; where the round's entries start
        return out, logits

    def propose(self, k: int) -> Draft:
        if k == 0:
            self.read = False
            return Draft.chain(self.tokens[:0], None)
        self.read = True
        with torch.inference_mode():
            out, logits = self._read_pending()
            if self.dynamic is not None:
                return self._dynamic(out, logits, k)
            if self.shape is not None:
                return self._tree(out, logits)
            return self._chain(out, logits, k)

    def _chain(self, out: torch.Tensor, logits: torch.Tensor, k: int) -> Draft:
        chains = getattr(self.head, "chains", None)  # a head on the static path (models/static_head.py)
        if self.p_min is None and chains is not None and chains(k, self.sampling):
            # Its steps and draws replayed as one CUDA graph.
            drafted = self.head.draft_chain(logits[0], out, k, self.sampling, self.generator)
            if drafted is not None:
                ids, q = drafted
                return Draft.chain(self.head.draft_ids[ids], None if q is None else self._full(q), forwards=k)

        def row_after(token: torch.Tensor | None) -> torch.Tensor:
            nonlocal out, logits
            if token is not None:  # the head reads its last draft with its own output
                out, logits = self.head.scored_step(self.head.draft_ids[token], out, self.cache)
            return logits[0]

        chain = propose_chain(k, row_after, self.sampling, self.generator, self.p_min)
        tokens = self.head.draft_ids[torch.cat(chain.tokens)] if chain.tokens else self.tokens[:0]
        return Draft.chain(tokens, None if chain.q is None else self._full(chain.q), forwards=chain.forwards)

    def _tree(self, out: torch.Tensor, logits: torch.Tensor) -> Draft:
        def read(level, state, branching, positions, mask):  # each child reads its parent's output
            parents = state[0].repeat_interleave(branching, dim=0)
            # What it sees among the round's nodes; every pair before the tree it sees.
            return self.head.scored_step(level, parents, self.cache, len(level), positions, mask[:, self.base :])

        tokens, parents, q = propose_tree(
            self.shape,
            self.base,
            (out, logits),
            itemgetter(1),
            read,
            self.sampling,
            self.generator,
            self.head.draft_ids,
        )
        return Draft(tokens, parents, None if q is None else self._full(q), forwards=len(self.shape))

    def _dynamic(self, out: torch.Tensor, logits: torch.Tensor, depth: int) -> Draft:
        """EAGLE-2's dynamic tree, ``depth`` levels deep: at each level the ``width`` most probable
        nodes of the last (by the product of the draft's probabilities along their branch) are read
        in one forward and offer their ``width`` most probable children; of every node offered, the
        ``nodes`` most probable make the tree. A node is never more probable than its parent (ties go
        to the earlier, so the shallower), so the tree holds every chosen node's ancestors. The
        candidates are deterministic given the draft (q is None), which tree verification takes
        exactly, under sampling too.

        Every choice is made on the device, so the host reads it once, for the tree's shape, when the
        tree is made (on CUDA each read would leave the GPU idle while the host waits, then queues the
        next level: a level per read made it 10 reads a round at K = 3)."""
        nodes, width = self.dynamic
        device = out.device
        # Per level, the nodes it offered: their draft ids, parents (-1: the root), branch log-probabilities.
        tokens, parents, scores = [], [], []
        # The nodes read last (at first the root): their outputs, indices, branch log-probabilities and lineages.
        rows, read, above, ancestors = out, None, torch.zeros(1, device=device), None
        for level in range(depth):
            offered = torch.log_softmax(logits.float(), dim=-1).topk(width)  # the scores after each row
            first = sum(len(t) for t in tokens)  # the level's first node
            branch = (above[:, None] + offered.values).flatten()  # node first + i is child i % width of row i // width
            tokens.append(offered.indices.flatten())
            parents.append(torch.full_like(tokens[-1], -1) if read is None else read.repeat_interleave(width))
            scores.append(branch)
            if level + 1 == depth:
                break
            # A stable sort, not topk, so ties go to the earlier node (topk's order among ties is not specified).
            frontier = branch.sort(descending=True, stable=True).indices[:width]
            parent_row = frontier // width
            # What each frontier node attends to among the round's nodes: its ancestors (read at earlier
            # levels, in the cache in the order they were read) and itself; and every pair before the tree.
            lineage = torch.eye(len(frontier), dtype=torch.bool, device=device)
            if ancestors is not None:
                lineage = torch.cat([ancestors[parent_row], lineage], dim=1)
            positions = torch.full((len(frontier),), self.base + level, dtype=torch.long, device=device)
            ids = self.head.draft_ids[tokens[-1][frontier]]
            rows, logits = self.head.scored_step(ids, rows[parent_row], self.cache, len(ids), positions, lineage)
            read, above, ancestors = first + frontier, branch[frontier], lineage
        tokens, parents, scores = torch.cat(tokens), torch.cat(parents), torch.cat(scores)
        # Levels were offered in order, so a stable sort ranks ties shallower first: a parent before its children.
        chosen = scores.sort(descending=True, stable=True).indices[:nodes].sort().values
        index = torch.full_like(parents, -1)
        index[chosen] = torch.arange(len(chosen), device=device)
        chosen_parents = parents[chosen]
        shape = torch.where(chosen_parents >= 0, index[chosen_parents.clamp(min=0)], -1)
        return Draft(self.head.draft_ids[tokens[chosen]], shape.tolist(), None, forwards=depth)

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        # Its own entries of the round give way: the accepted tokens are read again with the target's features.
        # The features of the round's pending token and of the path's: a chain's are a prefix (a view), a
        # tree's are indexed from the device (a Python list would be a host sync on CUDA).
        features = self.target.features
        if draft.is_chain:
            features = features[: len(verdict.path) + 1]
        else:
            features = features[ids_to_device([0] + [1 + i for i in verdict.path], features.device)]
        tokens = torch.cat([draft.on_path(verdict.path), verdict.next_token])
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
