"""Prompt lookup: drafts copied from where the sequence repeats itself."""

from __future__ import annotations

import torch

from specbench.decoding.decode import Draft
from specbench.decoding.sampling import Verdict
from specbench.decoding.transfer import ids_to_device


class PromptLookupDrafter:
    """Drafts by n-gram lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from ``max_ngram`` down to ``shortest``). Its candidates are
    deterministic (q is None), which verification treats as a one-hot q, so it stays exact under
    sampling. With ``lookahead`` it copies up to that many tokens whatever K a round asks for (a copy
    costs no forward, so before a draft model it may run longer than K)."""

    def __init__(self, max_ngram: int = 3, shortest: int = 1, lookahead: int | None = None):
        self.max_ngram, self.shortest, self.lookahead = max(max_ngram, shortest), shortest, lookahead

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.device = prompt_ids.device
        self.seen = prompt_ids.tolist() + first.tolist()

    def propose(self, k: int) -> Draft:
        found = self.continuations(k if self.lookahead is None else self.lookahead, every=False)
        copied = found[0] if found else []  # empty when k is 0
        return Draft.chain(ids_to_device(copied, self.device), None)

    def continuations(self, k: int, every: bool = True) -> list[list[int]]:
        """The one n-gram scan of every lookup drafter: up to ``k`` tokens that followed each earlier
        occurrence of the sequence's last n tokens, most recent first (the latest alone unless
        ``every``), for the longest n from ``max_ngram`` down to ``shortest`` that occurred."""
        seen = self.seen
        for n in range(min(self.max_ngram, len(seen) - 1), self.shortest - 1, -1):
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
        self.read_round(draft, verdict)

    def read_round(self, draft: Draft, verdict: Verdict) -> None:
        """The tokens the target kept of a round, whoever drafted it."""
        if verdict.emitted_ids is not None:  # read by the verification already: no transfer of its own
            self.seen += verdict.emitted_ids
        else:
            self.seen += draft.on_path(verdict.path).tolist() + verdict.next_token.tolist()

    def rewind_to(self, length: int, tokens: torch.Tensor) -> None:
        del self.seen[length:]
        self.seen += tokens.tolist()
