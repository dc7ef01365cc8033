"""Cascades: levels of drafters, each verified by the one above before the target sees its tokens."""

from __future__ import annotations

import torch

from specbench.decoding.decode import Beneath, CausalLM, Draft, LowerDrafter, speculative_round
from specbench.decoding.sampling import Sampling, Verdict
from specbench.drafters.lookup import PromptLookupDrafter


class CascadeDrafter:
    """A draft model sped up by a drafter beneath it (a vertical cascade): the lower level proposes,
    the model checks the proposal in one forward by exact speculative sampling against its own
    distribution, until it has its tokens. They are distributed as the model's own samples, and the
    model's rows where they were chosen are the q of the verification above, so the cascade is
    exact. With ``split`` M the model drafts only the first M positions and the lower level the
    rest, unchecked (a horizontal cascade), judged as deterministic candidates: exact for any
    proposal drawn independently of the target's check.

    ``lower`` is prompt lookup unless given (a ModelDrafter makes TriForce's bottom level);
    ``inner_k`` caps its proposal per check (None: as many tokens as positions are left). What the
    lower level proposed and what the model and the target kept of it is counted in ``beneath``.
    """

    def __init__(
        self,
        model: CausalLM,
        sampling: Sampling,
        generator: torch.Generator,
        split: int | None = None,
        ngram: int = 3,
        lower: LowerDrafter | None = None,
        inner_k: int | None = None,
    ):
        self.model, self.sampling, self.generator, self.split, self.inner_k = model, sampling, generator, split, inner_k
        self.lower = lower if lower is not None else PromptLookupDrafter(ngram)

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.model.prefill(prompt_ids)
        self.lower.start(prompt_ids, first)
        self.pending = first  # tokens the model has not read yet
        self.length = len(prompt_ids) + len(first)  # the sequence so far, pending tokens included
        self.beneath = Beneath()

    def propose(self, k: int) -> Draft:
        self.unread = len(self.pending)
        self.drafted = k if self.split is None else min(self.split, k)  # the model's tokens; it reads all but the last
        tokens, rows, from_lower, have = [], [], [], 0
        while have < self.drafted:
            # A round with m lower tokens emits at most m + 1: never more than the positions left.
            ask = self.drafted - have - 1
            inner = speculative_round(
                self.model,
                self.lower,
                self.pending,
                ask if self.inner_k is None else min(ask, self.inner_k),
                self.sampling,
                self.generator,
            )
            emitted = inner.emitted
            tokens.append(emitted)
            if inner.p is not None:
                rows.append(inner.p[: len(emitted)])  # the row each emitted token was chosen from
            # The accepted lower tokens came from beneath; the model itself chose the last one.
            from_lower += [True] * inner.verdict.accepted + [False]
            self.beneath.drafted += len(inner.draft.tokens)
            self.beneath.accepted += inner.verdict.accepted
            self.beneath.forwards += inner.draft.forwards
            self.pending, have = inner.verdict.next_token, have + len(emitted)
        tail = self.lower.propose(k - self.drafted).tokens if k > self.drafted else tokens[0][:0]
        if rows and len(tail):
            rows.append(torch.nn.functional.one_hot(tail, rows[0].shape[-1]).to(rows[0].dtype))
        self.from_lower = from_lower + [True] * len(tail)  # which of the draft's tokens came from beneath
        return Draft.chain(torch.cat([*tokens, tail]), torch.cat(rows) if rows else None, forwards=len(tokens))

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        n = verdict.accepted
        self.beneath.kept += sum(self.from_lower[:n])
        if n < self.drafted:
            self.model.keep(range(self.unread + n), self.unread + self.drafted - 1)
            self.pending = verdict.next_token
        else:  # it never read its last token, nor the lower tokens the target accepted after it
            self.pending = torch.cat([draft.tokens[self.drafted - 1 : n], verdict.next_token])
        # The inner rounds told the lower level of the model's tokens; the target decides which stand.
        kept = min(n, self.drafted)
        self.lower.rewind_to(self.length + kept, torch.cat([draft.tokens[kept:n], verdict.next_token]))
        self.length += n + 1
