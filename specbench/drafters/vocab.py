"""Drafting across vocabularies: a draft whose tokenizer is not the target's.

Speculative sampling is exact for any proposal distribution q over the target's vocabulary, so a
draft with its own tokenizer keeps the target's law as long as what it proposes is put in target
ids and verified against the q it was really drawn from. Two ways to get there (after "Lossless
Speculative Decoding Algorithms for Heterogeneous Vocabularies", Timor et al., ICML 2025):

- token-level intersection (models/vocab.VocabView under a ModelDrafter): the draft's rows restricted to the
  tokens whose text both vocabularies hold, renormalised there, in target ids. q is that row, so the
  usual test min(1, p/q) applies at any temperature. A token outside the intersection is only ever
  emitted by the target's residual.
- text (TextDrafter): the draft writes K tokens of its own, their text is tokenized for the target,
  and the target checks those ids as fixed candidates (q one-hot, as prompt lookup's). Conditional on
  a fixed candidate x, accepting with probability p(x) and otherwise drawing from p without x gives
  exactly p, however x was chosen, so this too is exact at any temperature; greedy, it accepts the
  prefix the target's argmax agrees with.

Either way the draft reads the sequence as its own tokenizer writes it: the prompt re-tokenized once,
then each token the target emits as the draft's id of the same text, or that text tokenized afresh.
models/vocab.Bridge holds the two vocabularies and those conversions.
"""

from __future__ import annotations

import torch

from specbench.decoding.decode import Draft
from specbench.decoding.sampling import Sampling, Verdict
from specbench.drafters.propose import propose_chain
from specbench.models.vocab import Bridge, retokenizing


class TextDrafter:
    """Drafts by text: the draft model writes ``k`` tokens of its own vocabulary (its argmax under
    greedy, draws from its warped rows under sampling), their text is tokenized for the target, and the
    first ``k`` target ids are proposed as fixed candidates (q one-hot). After the verdict the draft
    keeps the drafted tokens whose text the target accepted whole and reads the rest of the accepted
    text, tokenized afresh, and the target's next token."""

    def __init__(self, model, bridge: Bridge, sampling: Sampling, generator: torch.Generator, clock=None):
        self.model, self.bridge, self.sampling, self.generator, self.clock = model, bridge, sampling, generator, clock
        self.device = model.device

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        with retokenizing(self.clock):
            prompt = self.bridge.draft_prompt(prompt_ids.tolist())
            self.pending = self.bridge.pieces(int(first))  # draft ids it has not read yet
        self.model.prefill(self._tensor(prompt))
        self.drafted: list[int] = []

    def propose(self, k: int) -> Draft:
        if k == 0:  # a cascade may ask for nothing; what it has not read stays unread
            self.drafted = []
            return Draft.chain(self._tensor([]), None)

        def row_after(token: torch.Tensor | None) -> torch.Tensor:
            return self.model.forward(self._tensor(self.pending) if token is None else token, last=1)[-1]

        chain = propose_chain(k, row_after, self.sampling, self.generator)
        self.drafted = torch.cat(chain.tokens).tolist()  # the host writes their text
        with retokenizing(self.clock):
            candidates = self.bridge.target_ids(self.drafted)[:k]
        return Draft.chain(self._tensor(candidates), None, forwards=chain.forwards)

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        emitted = verdict.emitted_ids if verdict.emitted_ids is not None else self.verdict_ids(draft, verdict)
        with retokenizing(self.clock):
            text = self.bridge.target_decode(emitted[:-1])
            # The drafted tokens whose text the target accepted whole, in order.
            whole_tokens, used = 0, 0
            for n in range(1, len(self.drafted) + 1):
                written = self.bridge.draft_decode(self.drafted[:n])
                if not text.startswith(written):
                    break
                whole_tokens, used = n, len(written)
            rest = self.bridge.draft_encode(text[used:]) if used < len(text) else []
            after = self.bridge.pieces(emitted[-1])
        if not self.drafted:
            self.pending = self.pending + self.bridge.pieces(emitted[-1])  # nothing drafted, nothing accepted
            return
        # The cache holds what was pending and every drafted token but the last (which it never read).
        read = len(self.pending) + len(self.drafted) - 1
        kept = min(whole_tokens, len(self.drafted) - 1)
        self.model.keep(range(len(self.pending) + kept), read)
        self.pending = self.drafted[kept:whole_tokens] + rest + after

    @staticmethod
    def verdict_ids(draft: Draft, verdict: Verdict) -> list[int]:
        return torch.cat([draft.on_path(verdict.path), verdict.next_token]).tolist()
