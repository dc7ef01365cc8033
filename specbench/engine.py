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


@torch.inference_mode()
def speculative_decode(
    target: CausalLM,
    draft: CausalLM,
    prompt_ids: torch.Tensor,
    k: int,
    max_new_tokens: int,
    cfg: SamplingConfig,
    generator: torch.Generator,
    stop_ids: frozenset[int] = frozenset(),
) -> DecodeResult:
    """Speculative decoding with lookahead ``k``; output law equals the target's (exactly).

    Cache invariant between iterations: the target has seen every token but the newest one
    (``last``); the draft has seen the same, except that after a fully accepted round it still
    lacks its own K-th token, which it reads together with ``last`` on the next round.
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    target.reset()
    draft.reset()
    first = next_token(target.forward(prompt_ids, last=1)[-1], cfg, generator)
    draft.forward(prompt_ids, last=1)
    result = DecodeResult(tokens=[int(first)], target_forwards=1, draft_forwards=1)
    if _end(result.tokens, 0, max_new_tokens, stop_ids) is not None:
        return result
    last, draft_input = first, first
    beta_sum = 0.0  # becomes a device tensor under sampling: summed there, read once at the end
    while True:
        drafted, q_rows = [], []
        for _ in range(k):
            logits = draft.forward(draft_input, last=1)[-1]
            if cfg.greedy:
                draft_input = logits.argmax(-1, keepdim=True)
            else:
                q_rows.append(warp(logits, cfg))
                draft_input = sample(q_rows[-1], generator)
            drafted.append(draft_input)
        drafts = torch.cat(drafted)
        target_logits = target.forward(torch.cat([last, drafts]), last=k + 1)
        if cfg.greedy:
            verdict = verify_greedy(drafts, target_logits)
        else:
            verdict = verify_sampled(drafts, torch.stack(q_rows), warp(target_logits, cfg), generator)
        n = verdict.accepted

        target.crop(k - n)
        if n == k:
            draft_input = torch.cat([drafts[-1:], verdict.next_token])
        else:
            draft.crop(k - 1 - n)
            draft_input = verdict.next_token
        last = verdict.next_token

        result.target_forwards += 1
        result.draft_forwards += k
        result.drafted += k
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
