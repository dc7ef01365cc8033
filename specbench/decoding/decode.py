"""Decode loops over token ids: plain autoregressive (the baseline) and speculative.

The loops see a small model protocol, never a tokenizer or transformers itself, so tests can
drive them with a toy model whose distributions are known exactly. One speculative round
(draft, verify, accept, update both caches) is its own function: `speculative_decode` loops
it, and a drafter that nests speculation calls it for its own level.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Protocol

import torch

from specbench.decoding.sampling import (
    Sampling,
    Verdict,
    adjust,
    children,
    context_mask,
    next_token,
    verify_chain_greedy,
    verify_chain_sampled,
    verify_chain_synthetic,
    verify_tree_greedy,
    verify_tree_sampled,
    warp,
)
from specbench.decoding.sampling import seen_rows as _seen_rows
from specbench.decoding.transfer import ids_to_device
from specbench.decoding.tree import tree_inputs


class CausalLM(Protocol):
    """A causal LM holding its own KV cache for one sequence (batch size 1)."""

    device: torch.device

    def reset(self) -> None:
        """Empty the cache before a new sequence."""

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        """Start a new sequence with the prompt (a drafting model's first forward)."""

    def forward(
        self,
        token_ids: torch.Tensor,
        last: int = 1,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append 1-D ``token_ids`` to the cache; return logits [last, V] for the final positions.

        ``positions`` (position ids) and ``mask`` ([n, cached + n] bool: which cache positions each
        new token attends to) verify a tree in one forward; None means an ordinary causal append.
        """

    def keep(self, path: Sequence[int], new: int) -> None:
        """Of the newest ``new`` cache positions keep those at offsets ``path`` (ascending), drop the rest."""

    @property
    def length(self) -> int:
        """Tokens in the cache."""


@dataclass
class Draft:
    """What a drafter proposes: a chain or a tree of candidate tokens after the last accepted one."""

    tokens: torch.Tensor  # [n] ids
    parents: list[int]  # each token's parent: an index into tokens, or -1 for the last accepted token
    q: torch.Tensor | None  # [n, V] rows the tokens were sampled from; None for deterministic candidates
    forwards: int = 0  # draft-model forwards it cost

    @classmethod
    def chain(cls, tokens: torch.Tensor, q: torch.Tensor | None, forwards: int = 0) -> Draft:
        return cls(tokens, list(range(-1, len(tokens) - 1)), q, forwards)

    @cached_property  # asked several times a round; a draft is never changed after it is made
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def on_path(self, path: list[int]) -> torch.Tensor:
        """The tokens at ``path``; a chain's accepted path is a prefix, taken as a view (no index copy). A
        tree's path is indexed from the device (ids_to_device): a Python list would be copied there
        from pageable memory, a host sync on CUDA."""
        if self.is_chain:
            return self.tokens[: len(path)]
        return self.tokens[ids_to_device(path, self.tokens.device)]


class Drafter(Protocol):
    """Proposes drafts for one sequence and learns which of its tokens the target kept.

    A drafter with a level beneath it (a cascade, or drafters tried in turn) also keeps that level's
    counts in ``beneath`` (a Beneath, new at each ``start``), which speculative_decode returns."""

    def start(self, prompt_ids: torch.Tensor, first: torch.Tensor) -> None:
        """A new sequence: the prompt and the first token the target generated."""

    def propose(self, k: int) -> Draft:
        """Candidates for the next ``k`` positions (fewer when it has nothing to offer)."""

    def accepted(self, draft: Draft, verdict: Verdict) -> None:
        """The target kept ``verdict.path`` of ``draft`` and then ``verdict.next_token``."""


class LowerDrafter(Drafter, Protocol):
    """A drafter that can sit beneath another level (a cascade): the level above checks its proposals,
    and when the target above that keeps less, it is rewound."""

    def rewind_to(self, length: int, tokens: torch.Tensor) -> None:
        """Keep the first ``length`` tokens of the sequence it has been told of, then ``tokens``."""


@dataclass
class Beneath:
    """What the level beneath a drafter did over a decode: a cascade's lower drafter, or the drafters
    tried before the last in a FirstThatDrafts (lookup-or-draft's prompt lookup)."""

    drafted: int = 0  # tokens it proposed
    accepted: int = 0  # of them, those the level above accepted (for drafters tried in turn, the target)
    forwards: int = 0  # its model forwards (none for prompt lookup)
    kept: int = 0  # accepted draft tokens that it had proposed


@dataclass
class DecodeResult:
    """A decode's output and what its rounds added up to; ``observe`` takes each round (in the spirit of
    vLLM's SpecDecodingStats.observe_draft)."""

    tokens: list[int]  # generated ids, prompt excluded
    target_forwards: int = 0  # calls of the target (prefill included)
    draft_forwards: int = 0  # calls of the draft model after its prefill
    drafted: int = 0
    accepted: int = 0
    beta_sum: float = 0.0
    tested: int = 0
    accept_counts: list[int] = field(default_factory=list)  # accepted drafts per verify step
    draft_counts: list[int] = field(default_factory=list)  # drafted tokens per verify step
    rank_counts: list[int] = field(default_factory=list)  # accepted nodes by their rank among siblings
    beneath: Beneath | None = None  # the drafter's level beneath, if it has one
    past_stop: int = 0  # forwards run after the decode had ended (the baseline's chunked reads), not counted

    @property
    def steps(self) -> list[tuple[int, int]] | None:
        """Each target forward's (drafted, accepted), in order, the prefill's (0, 0) first; None where
        the rounds were not counted one by one."""
        if self.draft_counts:
            return [(0, 0), *zip(self.draft_counts, self.accept_counts, strict=True)]
        if self.target_forwards == len(self.tokens):  # one token a forward: the baseline
            return [(0, 0)] * self.target_forwards
        return None

    def observe(self, draft: Draft, verdict: Verdict) -> None:
        """Count one round: one target forward, the draft's forwards and tokens, what was accepted, and
        the rank among its siblings of each accepted node (in a chain every node is a first child).
        ``beta_sum`` may become a device tensor under sampling: summed there, read once at the end."""
        self.target_forwards += 1
        self.draft_forwards += draft.forwards
        self.drafted += len(draft.tokens)
        self.draft_counts.append(len(draft.tokens))
        self.accepted += verdict.accepted
        self.tested += verdict.tested
        self.accept_counts.append(verdict.accepted)
        self.beta_sum = self.beta_sum + verdict.beta_sum
        siblings = {} if draft.is_chain else children(draft.parents)
        for node in verdict.path:
            rank = siblings[draft.parents[node]].index(node) if siblings else 0
            self.rank_counts += [0] * (rank + 1 - len(self.rank_counts))
            self.rank_counts[rank] += 1


def _end(tokens: list[int], new_from: int, max_new_tokens: int, stop_ids: frozenset[int]) -> int | None:
    """The length to cut ``tokens`` to if decoding is over (first stop token kept), else None."""
    for i in range(new_from, len(tokens)):
        if tokens[i] in stop_ids:
            return min(i + 1, max_new_tokens)
    return max_new_tokens if len(tokens) >= max_new_tokens else None


# Tokens the baseline decodes between two reads of its output by the host. A read waits for the
# device (on CUDA the GPU then idles while the host queues the next forward); reading every token
# was one such wait per token, which `generate` pays too but an engine need not.
STOP_CHECK = 8


@torch.inference_mode()
def autoregressive_decode(
    model: CausalLM,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    stop_ids: frozenset[int] = frozenset(),
) -> DecodeResult:
    """The baseline: the target alone, one token per forward with a KV cache.

    Its tokens stay on the device and the host reads them every STOP_CHECK tokens, in one transfer,
    so it learns of a stop token up to STOP_CHECK - 1 forwards late. Those forwards past the stop are
    counted in ``past_stop``, not in ``target_forwards``, and the phase clock ends the decode before
    them (timing.PhaseClock.stop): its time is the time to its stop token, as when reading each token."""
    model.reset()
    logits = model.forward(prompt_ids, last=1)[-1]
    seen = context_mask(prompt_ids, logits.shape[-1], sampling)  # the context, for a repetition penalty
    decoded = torch.empty(max_new_tokens, dtype=torch.long, device=logits.device)
    result, n = DecodeResult(tokens=[]), 0
    while True:
        token = next_token(adjust(logits, sampling, seen), sampling, generator)
        if seen is not None:
            seen[token] = True
        decoded[n : n + 1] = token
        n += 1
        if n == max_new_tokens or n % STOP_CHECK == 0:
            new_from = len(result.tokens)
            result.tokens += decoded[new_from:n].tolist()
            end = _end(result.tokens, new_from, max_new_tokens, stop_ids)
            if end is not None:
                del result.tokens[end:]
                # A forward for each token but the last kept one, the prefill's included.
                result.target_forwards, result.past_stop = end, n - end
                return result
        logits = model.forward(token, last=1)[-1]


@cache
def cache_keyword(model_class: type) -> str:
    """The keyword by which a transformers model of this class takes its KV cache, and the name of the
    output's field that returns it: ``cache`` where its forward declares that parameter (transformers
    5.24 on, where ``past_key_values`` still works but warns that it goes in 5.40), else
    ``past_key_values`` (5.0 to 5.23). Read once per class from the forward's signature, which
    inspect takes from under transformers' decorators. Every call of a transformers model in
    specbench passes its cache by this name."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


# Rows of one batched forward when a baseline draws many samples of one prompt (autoregressive_samples,
# and transformers' generate in engines.hf).
SAMPLE_BATCH = 256


@torch.inference_mode()
def autoregressive_samples(
    module,
    prompt_ids: torch.Tensor,
    count: int,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    stop_ids: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """``count`` independent answers of the baseline to one prompt, each cut after its first stop
    token: the baseline's draws (adjust, then next_token) made for SAMPLE_BATCH rows at once by
    ``module``, the target's transformers model, one forward per token with a cache. The prompt is
    read once and its cache repeated for every row. Untimed: for the audit's reference arms, whose
    thousands of samples one request at a time took most of its minutes."""
    answers: list[list[int]] = []
    while len(answers) < count:
        rows = min(SAMPLE_BATCH, count - len(answers))
        keyword = cache_keyword(type(module))
        out = module(input_ids=prompt_ids.view(1, -1), use_cache=True, logits_to_keep=1)
        cache = getattr(out, keyword)
        cache.batch_repeat_interleave(rows)
        logits = out.logits[:, -1].expand(rows, -1)
        seen = context_mask(prompt_ids, logits.shape[-1], sampling)
        seen = None if seen is None else seen.expand(rows, -1).clone()
        tokens = torch.empty(rows, max_new_tokens, dtype=torch.long, device=logits.device)
        for n in range(max_new_tokens):
            token = next_token(adjust(logits, sampling, seen), sampling, generator)  # [rows, 1]
            if seen is not None:
                seen.scatter_(1, token, True)
            tokens[:, n] = token[:, 0]
            if n + 1 < max_new_tokens:
                logits = module(input_ids=token, **{keyword: cache}, use_cache=True).logits[:, -1]
        for row in tokens.tolist():
            answers.append(row[: _end(row, 0, max_new_tokens, stop_ids)])
    return answers


@dataclass
class Round:
    """One speculative round: the draft, the verdict, the target's logits at every position it
    scored ([n+1, V]: the root's row, then each draft token's), and their warped rows (None under
    greedy), which a level above uses as its q."""

    draft: Draft
    verdict: Verdict
    logits: torch.Tensor
    p: torch.Tensor | None

    @property
    def emitted(self) -> torch.Tensor:
        return torch.cat([self.draft.on_path(self.verdict.path), self.verdict.next_token])

    @property
    def emitted_ids(self) -> list[int]:
        """The emitted tokens on the host: as the verification read them, else read now."""
        return self.verdict.emitted_ids if self.verdict.emitted_ids is not None else self.emitted.tolist()


def verify(
    draft: Draft,
    target_logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator,
    seen: torch.Tensor | None = None,
) -> tuple[Verdict, torch.Tensor | None]:
    """The verdict on ``draft`` from the target's logits at the root and every draft token; ``seen``
    masks the context before the root (a repetition penalty's; a chain's rows add its drafts)."""
    if sampling.adjusts:
        if not draft.is_chain:
            raise ValueError("a tree's rows take no repetition penalty or logit bias")
        target_logits = adjust(target_logits, sampling, _seen_rows(seen, draft.tokens))
    if sampling.synthetic_acceptance is not None:
        if not draft.is_chain:
            raise ValueError("synthetic acceptance keeps a chain's prefix: a tree has no one path to keep")
        return verify_chain_synthetic(draft.tokens, target_logits, sampling, generator), None
    if sampling.greedy:
        if draft.is_chain:
            return verify_chain_greedy(draft.tokens, target_logits), None
        return verify_tree_greedy(draft.tokens, draft.parents, target_logits), None
    p = warp(target_logits, sampling)
    if draft.is_chain:
        return verify_chain_sampled(draft.tokens, draft.q, p, generator), p
    return verify_tree_sampled(draft.tokens, draft.parents, draft.q, p, generator), p


def speculative_round(
    target: CausalLM,
    drafter: Drafter,
    last: torch.Tensor,
    k: int,
    sampling: Sampling,
    generator: torch.Generator,
    seen: torch.Tensor | None = None,
    rule: Callable = verify,
) -> Round:
    """Draft up to ``k`` tokens after ``last`` (the tokens the target has not read: one, or for a
    chain several), verify them in one target forward, and leave both caches holding exactly the
    accepted path. ``seen`` masks the context (a repetition penalty's); ``rule`` is the verification
    (verify; the audit's deliberately broken subjects pass their own)."""
    draft = drafter.propose(k)
    n, read = len(draft.tokens), len(last)
    ids = torch.cat([last, draft.tokens])
    if draft.is_chain:
        target_logits = target.forward(ids, last=n + 1)
    elif read == 1:  # ``last`` is the root; a draft token with parent -1 hangs from it
        positions, mask = tree_inputs([-1] + [p + 1 for p in draft.parents], target.length, ids.device)
        target_logits = target.forward(ids, last=n + 1, positions=positions, mask=mask)
    else:
        raise ValueError("a tree is verified after exactly one unread token")
    verdict, p = rule(draft, target_logits, sampling, generator, seen)
    target.keep(list(range(read)) + [read + i for i in verdict.path], read + n)
    drafter.accepted(draft, verdict)
    return Round(draft, verdict, target_logits, p)


def heuristic_k(k: int, drafted: int, accepted: int) -> int:
    """The next round's lookahead after a round at ``k`` (transformers' "heuristic" schedule): K + 2
    when the target accepted every drafted token, else K - 1, never below 1. A round that drafted
    nothing (prompt lookup without a match) says nothing of the drafter: K stays."""
    if drafted == 0:
        return k
    return k + 2 if accepted == drafted else max(1, k - 1)


@torch.inference_mode()
def speculative_decode(
    target: CausalLM,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    k: int,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    stop_ids: frozenset[int] = frozenset(),
    on_round: Callable[[Round, int], None] | None = None,
    schedule: Callable[[int, int, int], int] | None = None,
    rule: Callable = verify,
) -> DecodeResult:
    """Speculative decoding with lookahead ``k``; output law equals the target's (exactly).

    Between rounds the target's cache holds every token but the newest one (``last``), which it
    reads first in the next verification forward together with the drafted tokens. ``on_round``
    sees every round and the index in the output of the round's first emitted token.

    ``schedule`` (heuristic_k) gives the next round's lookahead from a round's (K, drafted,
    accepted); None keeps ``k``. A scheduled round drafts no more than the tokens still to generate
    (transformers caps its drafts so too), so a growing K never widens a forward beyond what the
    cache was sized for. Both read only what earlier rounds emitted, so the output law is kept.

    ``rule`` verifies each round (verify; the audit's deliberately broken subjects pass their own).
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    target.reset()
    logits = target.forward(prompt_ids, last=1)[-1]
    seen = context_mask(prompt_ids, logits.shape[-1], sampling)  # the context, for a repetition penalty
    last = next_token(adjust(logits, sampling, seen), sampling, generator)
    if seen is not None:
        seen[last] = True
    drafter.start(prompt_ids, last)
    result = DecodeResult(tokens=[int(last)], target_forwards=1, beneath=getattr(drafter, "beneath", None))
    if _end(result.tokens, 0, max_new_tokens, stop_ids) is not None:
        return result
    while True:
        ask = k if schedule is None else min(k, max_new_tokens - len(result.tokens))
        round_ = speculative_round(target, drafter, last, ask, sampling, generator, seen, rule)
        verdict, last = round_.verdict, round_.verdict.next_token
        if seen is not None:
            seen[round_.emitted] = True
        if schedule is not None:
            k = schedule(k, len(round_.draft.tokens), verdict.accepted)
        result.observe(round_.draft, verdict)
        new_from = len(result.tokens)
        if on_round is not None:
            on_round(round_, new_from)
        result.tokens += round_.emitted_ids
        end = _end(result.tokens, new_from, max_new_tokens, stop_ids)
        if end is not None:
            del result.tokens[end:]
            result.beta_sum = float(result.beta_sum)
            return result
