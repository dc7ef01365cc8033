"""Prompt lookup, and lookup where the sequence repeats with the draft model elsewhere."""

from __future__ import annotations

import torch

from specbench.decoding.decode import Draft
from specbench.decoding.sampling import Verdict
from specbench.drafters.model import ModelDrafter


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
        found = self.continuations(k, shortest, every=False)
        return found[0] if found else []  # empty when k is 0

    def continuations(self, k: int, shortest: int = 1, every: bool = True) -> list[list[int]]:
        """The one n-gram scan of every lookup drafter: up to ``k`` tokens that followed each earlier
        occurrence of the sequence's last n tokens, most recent first (the latest alone unless
        ``every``), for the longest n from ``max_ngram`` down to ``shortest`` that occurred."""
        seen = self.seen
        for n in range(min(self.max_ngram, len(seen) - 1), shortest - 1, -1):
            tail, found = seen[-n:], []
            for start in range(len(seen) - n - 1, -1, -1):
                if seen[start : start + n] == tail:
                    found.append(seen[start + n : start + n + k])
                    if not every:
                        break
            if found:
                return found
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
