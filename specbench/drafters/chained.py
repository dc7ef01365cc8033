"""Drafters tried in turn, the first that drafts winning the round (llama.cpp chains its speculative
implementations so): lookup-or-draft is prompt lookup, then the draft model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specbench.decoding.decode import Beneath, Draft
from specbench.decoding.sampling import Verdict


class FirstThatDrafts:
    """Each round asks its drafters in order and takes the first draft with a token (the last drafter's
    in any case). The choice reads only the sequence so far, never the target's check of this round,
    and each round's draft is verified as its drafter's own (deterministic candidates, or against its
    q), so every round is exact. The drafters that did not draft read the round's kept tokens
    (``read_round``), a model with its next forward. ``beneath`` counts the rounds of every drafter but
    the last: what they proposed, and what the target kept of it."""

    def __init__(self, drafters: Sequence):
        self.drafters = tuple(drafters)

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        for drafter in self.drafters:
            drafter.start(prompt_ids, first)
        self.beneath = Beneath()

    def propose(self, k: int) -> Draft:
        for drafter in self.drafters:
            draft = drafter.propose(k)
            if len(draft.tokens) or drafter is self.drafters[-1]:
                self.drafted_by = drafter
                break
        if self.drafted_by is not self.drafters[-1]:
            self.beneath.drafted += len(draft.tokens)
            self.beneath.forwards += draft.forwards
        return draft

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        if self.drafted_by is not self.drafters[-1]:
            self.beneath.accepted += verdict.accepted
            self.beneath.kept += verdict.accepted
        for drafter in self.drafters:
            if drafter is self.drafted_by:
                drafter.accepted(draft, verdict)
            else:
                drafter.read_round(draft, verdict)
