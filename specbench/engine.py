"""Decode loops over token ids: plain autoregressive (the baseline) and speculative.

The loops see a small model protocol, never a tokenizer or transformers itself, so tests can
drive them with a toy model whose distributions are known exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .sampling import SamplingConfig, next_token, sample, verify_greedy, verify_sampled, warp


class CausalLM(Protocol):
    """A causal LM holding its own KV cache for one sequence (batch size 1)."""

    device: torch.device

    def reset(self) -> None:
        """Empty the cache before a new sequence."""

    def forward(self, token_ids: torch.Tensor, last: int = 1) -> torch.Tensor:
        """Append 1-D ``token_ids`` to the cache; return logits [last, V] for the final positions."""

    def crop(self, n_drop: int) -> None:
        """Drop the newest ``n_drop`` positions from the cache."""


@dataclass
class DecodeResult:
    tokens: list[int]  # generated ids, prompt excluded
    target_forwards: int = 0  # calls of the target (prefill included)
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    beta_sum: float = 0.0
    tested: int = 0
    accept_counts: list[int] = field(default_factory=list)  # accepted drafts per verify step


def _end(tokens: list[int], new_from: int, max_new_tokens: int, stop_ids: frozenset[int]) -> int | None:
    """The length to cut ``tokens`` to if decoding is over (first stop token kept), else None."""
    for i in range(new_from, len(tokens)):
        if tokens[i] in stop_ids:
            return min(i + 1, max_new_tokens)
    return max_new_tokens if len(tokens) >= max_new_tokens else None


@torch.inference_mode()
def autoregressive_decode(
    model: CausalLM,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    cfg: SamplingConfig,
    generator: torch.Generator,
    stop_ids: frozenset[int] = frozenset(),
) -> DecodeResult:
    """The baseline: the target alone, one token per forward with a KV cache."""
    model.reset()
    logits = model.forward(prompt_ids, last=1)[-1]
    result = DecodeResult(tokens=[], target_forwards=1)
    while True:
        token = next_token(logits, cfg, generator)
        result.tokens.append(int(token))
        if _end(result.tokens, len(result.tokens) - 1, max_new_tokens, stop_ids) is not None:
            return result
        logits = model.forward(token, last=1)[-1]
        result.target_forwards += 1


class ModelDrafter:
    """Drafts by sampling a small model autoregressively (it keeps its own KV cache)."""

    def __init__(self, model: CausalLM, cfg: SamplingConfig, generator: torch.Generator):
        self.model, self.cfg, self.generator = model, cfg, generator

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.model.reset()
        self.model.forward(prompt_ids, last=1)
        self.pending = first  # tokens the draft has not read yet

    def propose(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        drafted, q_rows = [], []
        for _ in range(k):
            logits = self.model.forward(self.pending, last=1)[-1]
            if self.cfg.greedy:
                self.pending = logits.argmax(-1, keepdim=True)
            else:
                q_rows.append(warp(logits, self.cfg))
                self.pending = sample(q_rows[-1], self.generator)
            drafted.append(self.pending)
        return torch.cat(drafted), (torch.stack(q_rows) if q_rows else None)

    def accepted(self, drafts: torch.Tensor, n: int, next_token: torch.Tensor) -> None:
        if n == len(drafts):
            # It never read its own last draft: it reads it now, with the target's bonus token.
            self.pending = torch.cat([drafts[-1:], next_token])
        else:
            self.model.crop(len(drafts) - 1 - n)
            self.pending = next_token


class PromptLookupDrafter:
    """Drafts by n-gram lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from ``max_ngram`` down to 1). Its q is one-hot on what it
    proposes, so verification stays exact under sampling."""

    def __init__(self, vocab: int, max_ngram: int = 3):
        self.vocab, self.max_ngram = vocab, max_ngram

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        self.device = prompt_ids.device
        self.seen = prompt_ids.tolist() + first.tolist()

    def propose(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        seen = self.seen
        for n in range(min(self.max_ngram, len(seen) - 1), 0, -1):
            tail = seen[-n:]
            for start in range(len(seen) - n - 1, -1, -1):
                if seen[start : start + n] == tail:
                    drafts = torch.tensor(seen[start + n : start + n + k], device=self.device)
                    return drafts, torch.nn.functional.one_hot(drafts, self.vocab).float()
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        return empty, torch.zeros(0, self.vocab, device=self.device)

    def accepted(self, drafts: torch.Tensor, n: int, next_token: torch.Tensor) -> None:
        self.seen += drafts[:n].tolist() + next_token.tolist()


@torch.inference_mode()
def speculative_decode(
    target: CausalLM,
    draft: CausalLM | ModelDrafter | PromptLookupDrafter,
    prompt_ids: torch.Tensor,
    k: int,
    max_new_tokens: int,
    cfg: SamplingConfig,
    generator: torch.Generator,
    stop_ids: frozenset[int] = frozenset(),
) -> DecodeResult:
    """Speculative decoding with lookahead ``k``; output law equals the target's (exactly).

    ``draft`` is a model (drafting by sampling it) or a drafter. Between rounds the target's
    cache holds every token but the newest one (``last``), which it reads first in the next
    verification forward together with up to ``k`` drafted tokens.
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    drafter = draft if hasattr(draft, "propose") else ModelDrafter(draft, cfg, generator)
    target.reset()
    last = next_token(target.forward(prompt_ids, last=1)[-1], cfg, generator)
    drafter.start(prompt_ids, last)
    result = DecodeResult(tokens=[int(last)], target_forwards=1)
    if _end(result.tokens, 0, max_new_tokens, stop_ids) is not None:
        return result
    beta_sum = 0.0  # becomes a device tensor under sampling: summed there, read once at the end
    while True:
        drafts, q = drafter.propose(k)
        n_drafts = len(drafts)
        target_logits = target.forward(torch.cat([last, drafts]), last=n_drafts + 1)
        if cfg.greedy:
            verdict = verify_greedy(drafts, target_logits)
        else:
            verdict = verify_sampled(drafts, q, warp(target_logits, cfg), generator)
        n = verdict.accepted
        target.crop(n_drafts - n)
        drafter.accepted(drafts, n, verdict.next_token)
        last = verdict.next_token

        result.target_forwards += 1
        result.draft_forwards += n_drafts if isinstance(drafter, ModelDrafter) else 0
        result.drafted += n_drafts
        result.accepted += n
        result.tested += verdict.tested
        result.accept_counts.append(n)
        beta_sum = beta_sum + verdict.beta_sum
        new_from = len(result.tokens)
        result.tokens += torch.cat([drafts[:n], last]).tolist()
        end = _end(result.tokens, new_from, max_new_tokens, stop_ids)
        if end is not None:
            del result.tokens[end:]
            result.beta_sum = float(beta_sum)
            return result
