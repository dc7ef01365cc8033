"""The drafters of specbench's loop: what proposes the tokens a round verifies.

A drafter (engine.Drafter) starts on a prompt, proposes a chain or a tree of tokens with the rows
they were drawn from (its q), and hears the verdict. Here: a small model sampling a chain
(ModelDrafter), prompt lookup (PromptLookupDrafter), lookup where the sequence repeats and the model
elsewhere (LookupOrModelDrafter), a cascade of levels each verified by the one
above (CascadeDrafter), and trees of either kind (TreeDrafter, LookupTreeDrafter).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .engine import CausalLM, Draft, LowerDrafter, speculative_round
from .sampling import SamplingConfig, Verdict, adjust, argmax, confident, context_mask, sample, warp
from .tree import tree_inputs


class ModelDrafter:
    """Drafts a chain by sampling a small model autoregressively (it keeps its own KV cache).

    With ``p_min`` it stops a round early, before the first token its row there is not confident of
    (sampling.confident): the confidence policy's drafter. The forward that found that row counts
    as drafting, and its cache then holds every token it drafted, with none pending.
    """

    def __init__(self, model: CausalLM, cfg: SamplingConfig, generator: torch.Generator, p_min: float | None = None):
        self.model, self.cfg, self.generator, self.p_min = model, cfg, generator, p_min

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.model.prefill(prompt_ids)
        self.pending = first  # tokens the draft has not read yet
        # Under a repetition penalty, the context's tokens (adjust reads them); the mask is made at the
        # first forward, which gives the vocabulary's width.
        self.context, self.seen = torch.cat([prompt_ids, first]), None

    def propose(self, k: int) -> Draft:
        if k == 0:  # a cascade may ask for nothing; what it has not read stays unread
            return Draft.chain(self.pending[:0], None)
        drafted, q_rows, forwards = [], [], 0
        seen = None  # each row's context: the drafts so far too
        for _ in range(k):
            logits = self.model.forward(self.pending, last=1)[-1]
            if self.seen is None and self.cfg.repetition_penalty != 1.0:
                self.seen = context_mask(self.context, logits.shape[-1], self.cfg)
            if seen is None and self.seen is not None:
                seen = self.seen.clone()
            logits = adjust(logits, self.cfg, seen)
            forwards += 1
            q = None if self.cfg.greedy else warp(logits, self.cfg)
            if self.p_min is not None and not confident(logits.float().softmax(-1) if q is None else q, self.p_min):
                self.pending = self.pending[:0]  # it has read every token it drafted
                break
            if q is None:
                self.pending = argmax(logits)
            else:
                self.pending, q = self.draw(logits, q)
                q_rows.append(q)
            drafted.append(self.pending)
            if seen is not None:
                seen[self.pending] = True
        tokens = torch.cat(drafted) if drafted else self.pending
        return Draft.chain(tokens, torch.stack(q_rows) if q_rows else None, forwards=forwards)

    def draw(self, logits: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafted token, and the row it is verified against: a sample of ``q``, and ``q``. (The
        audit's deliberately broken drafters draw from one row and report another.)"""
        return sample(q, self.generator), q

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        n, k = verdict.accepted, len(draft.tokens)
        if self.seen is not None:
            self.seen[draft.tokens[:n]] = True
            self.seen[verdict.next_token] = True
        if n < k:
            # Its cache holds the drafts it read: all but the last, or all when it stopped early.
            self.model.keep(range(n), k - len(self.pending))
            self.pending = verdict.next_token
        else:
            # It reads what it has not yet (its last draft, if it did not stop early), then the target's token.
            self.pending = torch.cat([self.pending, verdict.next_token])

    def read_later(self, tokens: torch.Tensor) -> None:
        """Tokens of a round another drafter proposed, as the target kept them: read with the next forward."""
        if self.seen is not None:
            self.seen[tokens] = True
        self.pending = torch.cat([self.pending, tokens])

    def rewind_to(self, length: int, tokens: torch.Tensor) -> None:
        read = self.model.length  # the sequence it holds is what it read, then what is pending
        if read > length:
            self.model.keep([], read - length)
            self.pending = tokens
        else:
            self.pending = torch.cat([self.pending[: length - read], tokens])


class PromptLookupDrafter:
    """Drafts by n-gram lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from ``max_ngram`` down to 1). Its candidates are deterministic
    (q is None), which verification treats as a one-hot q, so it stays exact under sampling."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.device = prompt_ids.device
        self.seen = prompt_ids.tolist() + first.tolist()

    def propose(self, k: int) -> Draft:
        return Draft.chain(torch.tensor(self.match(k), dtype=torch.long, device=self.device), None)

    def match(self, k: int, shortest: int = 1) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n
        tokens, for the longest n from ``max_ngram`` down to ``shortest`` that occurred; [] when none did."""
        seen = self.seen
        for n in range(min(self.max_ngram, len(seen) - 1), shortest - 1, -1):
            tail = seen[-n:]
            for start in range(len(seen) - n - 1, -1, -1):
                if seen[start : start + n] == tail:
                    return seen[start + n : start + n + k]  # empty when k is 0
        return []

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        if verdict.emitted_ids is not None:  # read by the verification already: no transfer of its own
            self.seen += verdict.emitted_ids
        else:
            self.seen += draft.on_path(verdict.path).tolist() + verdict.next_token.tolist()

    def rewind_to(self, length: int, tokens: torch.Tensor) -> None:
        del self.seen[length:]
        self.seen += tokens.tolist()


class LookupOrModelDrafter:
    """Prompt lookup where the sequence repeats itself, the draft model elsewhere. A round drafts
    by lookup when the sequence's last ``shortest`` or more tokens occurred before: up to
    ``lookup_k`` tokens that followed them (a copy costs no forward, so it may run longer than K);
    otherwise the model drafts K. The choice reads only the sequence so far, never the target's
    check of this round, and each round's draft is verified as its drafter's own (lookup's as
    deterministic candidates, the model's against its q), so every round is exact. The model reads
    the tokens of lookup's rounds with its next forward. ``from_inner`` marks lookup's tokens.
    """

    def __init__(self, model: ModelDrafter, lookup_k: int, shortest: int = 2, max_ngram: int = 3):
        self.model, self.lookup_k, self.shortest = model, lookup_k, shortest
        self.lookup = PromptLookupDrafter(max(max_ngram, shortest))

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.model.start(prompt_ids, first)
        self.lookup.start(prompt_ids, first)

    def propose(self, k: int) -> Draft:
        copied = self.lookup.match(self.lookup_k, self.shortest)
        self.by_lookup = bool(copied)
        if self.by_lookup:
            tokens = torch.tensor(copied, dtype=torch.long, device=self.lookup.device)
            return Draft.chain(tokens, None, from_inner=[True] * len(copied), inner_drafted=len(copied))
        draft = self.model.propose(k)
        draft.from_inner = [False] * len(draft.tokens)
        return draft

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        self.lookup.accepted(draft, verdict)
        if self.by_lookup:
            self.model.read_later(torch.cat([draft.tokens[: verdict.accepted], verdict.next_token]))
        else:
            self.model.accepted(draft, verdict)


class CascadeDrafter:
    """A draft model sped up by a drafter beneath it (a vertical cascade): the lower level proposes,
    the model checks the proposal in one forward by exact speculative sampling against its own
    distribution, until it has its tokens. They are distributed as the model's own samples, and the
    model's rows where they were chosen are the q of the verification above, so the cascade is
    exact. With ``split`` M the model drafts only the first M positions and the lower level the
    rest, unchecked (a horizontal cascade), judged as deterministic candidates: exact for any
    proposal drawn independently of the target's check.

    ``lower`` is prompt lookup unless given (a ModelDrafter makes TriForce's bottom level);
    ``inner_k`` caps its proposal per check (None: as many tokens as positions are left).
    """

    def __init__(
        self,
        model: CausalLM,
        cfg: SamplingConfig,
        generator: torch.Generator,
        split: int | None = None,
        ngram: int = 3,
        lower: LowerDrafter | None = None,
        inner_k: int | None = None,
    ):
        self.model, self.cfg, self.generator, self.split, self.inner_k = model, cfg, generator, split, inner_k
        self.lower = lower if lower is not None else PromptLookupDrafter(ngram)

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.model.prefill(prompt_ids)
        self.lower.start(prompt_ids, first)
        self.pending = first  # tokens the model has not read yet
        self.length = len(prompt_ids) + len(first)  # the sequence so far, pending tokens included

    def propose(self, k: int) -> Draft:
        self.unread = len(self.pending)
        self.drafted = k if self.split is None else min(self.split, k)  # the model's tokens; it reads all but the last
        tokens, rows, from_inner, have, offered, taken, lower_forwards = [], [], [], 0, 0, 0, 0
        while have < self.drafted:
            # A round with m lower tokens emits at most m + 1: never more than the positions left.
            ask = self.drafted - have - 1
            inner = speculative_round(
                self.model,
                self.lower,
                self.pending,
                ask if self.inner_k is None else min(ask, self.inner_k),
                self.cfg,
                self.generator,
            )
            emitted = inner.emitted
            tokens.append(emitted)
            if inner.p is not None:
                rows.append(inner.p[: len(emitted)])  # the row each emitted token was chosen from
            # The accepted lower tokens came from beneath; the model itself chose the last one.
            from_inner += [True] * inner.verdict.accepted + [False]
            offered, taken = offered + len(inner.draft.tokens), taken + inner.verdict.accepted
            lower_forwards += inner.draft.forwards
            self.pending, have = inner.verdict.next_token, have + len(emitted)
        tail = self.lower.propose(k - self.drafted).tokens if k > self.drafted else tokens[0][:0]
        if rows and len(tail):
            rows.append(torch.nn.functional.one_hot(tail, rows[0].shape[-1]).to(rows[0].dtype))
        return Draft.chain(
            torch.cat([*tokens, tail]),
            torch.cat(rows) if rows else None,
            forwards=len(tokens),
            from_inner=from_inner + [True] * len(tail),
            inner_drafted=offered,
            inner_accepted=taken,
            inner_forwards=lower_forwards,
        )

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        n = verdict.accepted
        if n < self.drafted:
            self.model.keep(range(self.unread + n), self.unread + self.drafted - 1)
            self.pending = verdict.next_token
        else:  # it never read its last token, nor the lower tokens the target accepted after it
            self.pending = torch.cat([draft.tokens[self.drafted - 1 : n], verdict.next_token])
        # The inner rounds told the lower level of the model's tokens; the target decides which stand.
        kept = min(n, self.drafted)
        self.lower.rewind_to(self.length + kept, torch.cat([draft.tokens[kept:n], verdict.next_token]))
        self.length += n + 1


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
        seen, continuations = self.seen, []
        for n in range(min(self.max_ngram, len(seen) - 1), 0, -1):
            tail = seen[-n:]
            continuations = [
                seen[start + n : start + n + self.depth]
                for start in range(len(seen) - n - 1, -1, -1)
                if seen[start : start + n] == tail
            ]
            if continuations:
                break
        tokens, parents, index = [], [], {}
        for continuation in continuations:
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
