"""A small model drafting a chain of K tokens, sampled from its own warped rows (its q)."""

from __future__ import annotations

import torch

from specbench.decoding.decode import CausalLM, Draft
from specbench.decoding.sampling import Sampling, Verdict, adjust, context_mask, sample
from specbench.drafters.propose import propose_chain


class ModelDrafter:
    """Drafts a chain by sampling a small model autoregressively (it keeps its own KV cache).

    With ``p_min`` it stops a round early, before the first token its row there is not confident of
    (sampling.confident): the confidence policy's drafter. The forward that found that row counts
    as drafting, and its cache then holds every token it drafted, with none pending.
    """

    def __init__(self, model: CausalLM, sampling: Sampling, generator: torch.Generator, p_min: float | None = None):
        self.model, self.sampling, self.generator, self.p_min = model, sampling, generator, p_min

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.model.prefill(prompt_ids)
        self.pending = first  # tokens the draft has not read yet
        # Under a repetition penalty, the context's tokens (adjust reads them); the mask is made at the
        # first forward, which gives the vocabulary's width.
        self.context, self.seen = torch.cat([prompt_ids, first]), None

    def propose(self, k: int) -> Draft:
        if k == 0:  # a cascade may ask for nothing; what it has not read stays unread
            return Draft.chain(self.pending[:0], None)
        seen = None  # each row's context: the drafts so far too

        def row_after(token: torch.Tensor | None) -> torch.Tensor:
            nonlocal seen
            if token is not None:
                self.pending = token
                if seen is not None:
                    seen[token] = True
            logits = self.model.forward(self.pending, last=1)[-1]
            if self.seen is None and self.sampling.repetition_penalty != 1.0:
                self.seen = context_mask(self.context, logits.shape[-1], self.sampling)
            if seen is None and self.seen is not None:
                seen = self.seen.clone()
            return adjust(logits, self.sampling, seen)

        if self._chains(k):  # its forwards and draws replayed as one CUDA graph (models/static.py)
            first = row_after(None)
            drafted = self.model.draft_chain(first, k, self.sampling, self.generator)
            if drafted is not None:
                tokens, q = drafted
                self.pending = tokens[-1:]
                return Draft.chain(tokens, q, forwards=k)
            read = row_after  # the chain's graph is gone: a token at a time, from the row already read

            def row_after(token: torch.Tensor | None) -> torch.Tensor:
                return first if token is None else read(token)

        chain = propose_chain(k, row_after, self.sampling, self.generator, self.p_min, self.draw)
        # It has read every token it drafted when it stopped early; else all but the last.
        self.pending = self.pending[:0] if chain.stopped else chain.tokens[-1]
        tokens = torch.cat(chain.tokens) if chain.tokens else self.pending
        return Draft.chain(tokens, chain.q, forwards=chain.forwards)

    def _chains(self, k: int) -> bool:
        """Whether the model drafts this round's chain in one go (StaticLM.draft_chain): a chain with no
        stop and this class's own draw (the audit's broken drafters draw otherwise), where the model
        says it can."""
        if self.p_min is not None or type(self).draw is not ModelDrafter.draw:
            return False
        chains = getattr(self.model, "chains", None)
        return chains is not None and chains(k, self.sampling, len(self.pending))

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

    def read_round(self, draft: Draft, verdict: Verdict) -> None:
        """A round another drafter proposed (drafters.chained): the tokens the target kept are read
        with the next forward."""
        tokens = torch.cat([draft.on_path(verdict.path), verdict.next_token])
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
