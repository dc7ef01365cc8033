"""Sampling and speculative verification as pure tensor functions (no models, no I/O).

Every random draw takes an explicit ``torch.Generator`` so a run is reproducible and the
baseline and the speculative decoder never share a stream of random numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specbench.decoding.transfer import ids_to_device


@dataclass(frozen=True)
class Sampling:
    """How to sample, one type from the command line to the sampler: the warp and the logits'
    adjustments that specbench's loop applies, the penalties that only vLLM and servers apply, and what
    a request to an engine also says (tokens to generate, seed, stop ids and strings, log-probabilities)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eta: float = 0.0  # eta sampling's epsilon (0 = off): specbench's loop and transformers only
    min_p: float = 0.0  # drop tokens below min_p times the likeliest one's probability (0 = off)
    # Context-dependent adjustments of the logits, before the warp and before greedy's argmax (adjust):
    repetition_penalty: float = 1.0  # a token already in the context: logit / penalty (x penalty below 0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence_penalty: float = 0.0  # vLLM and servers only
    frequency_penalty: float = 0.0  # vLLM and servers only
    # What a request to an engine says besides (the decode loops take their length and stop ids as arguments):
    max_new_tokens: int = 0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    logprobs: int = 0  # how many of the likeliest tokens' log-probabilities to return per position
    stop: tuple[str, ...] = ()  # stop strings: vLLM and servers only (specbench's loop stops on ids)
    # Benchmarking only, not exact: drafts accepted at a given rate (below 1) or mean tokens per round
    # (1 and above) instead of verified (synthetic_rate). None: verified.
    synthetic_acceptance: float | None = None

    @property
    def greedy(self) -> bool:
        # Temperature 0 is argmax decoding, never approximated by a tiny temperature.
        return self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """Whether rows need adjust(): a repetition penalty or a logit bias."""
        return self.repetition_penalty != 1.0 or bool(self.logit_bias)


def adjust(logits: torch.Tensor, sampling: Sampling, seen: torch.Tensor | None) -> torch.Tensor:
    """The logits after the logit bias and the repetition penalty (transformers' and vLLM's rule: a
    token in the context has its logit divided by the penalty, or multiplied when negative); ``seen``
    is a boolean mask of the tokens in each row's context (prompt and output so far), shaped like
    ``logits``. Both the target's rows and the draft's go through it, at the same contexts, before
    the warp or greedy's argmax: that is what keeps speculative decoding exact under them."""
    if not sampling.adjusts:
        return logits
    logits = logits.float().clone()
    if sampling.repetition_penalty != 1.0 and seen is not None:
        penalized = torch.where(logits < 0, logits * sampling.repetition_penalty, logits / sampling.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    for token, bias in sampling.logit_bias:
        if token < logits.shape[-1]:
            logits[..., token] += bias
    return logits


def context_mask(ids: torch.Tensor, width: int, sampling: Sampling) -> torch.Tensor | None:
    """The mask of the tokens in ``ids`` over a vocabulary of ``width`` (ids beyond it are left out),
    for adjust(); None when ``sampling`` has no repetition penalty (nothing reads it)."""
    if sampling.repetition_penalty == 1.0:
        return None
    # Ids beyond the vocabulary mark a spare last column, cut off: selecting them out instead
    # (ids[ids < width]) makes a tensor of a size the host must read from the device.
    mask = torch.zeros(width + 1, dtype=torch.bool, device=ids.device)
    mask[ids.clamp(max=width)] = True
    return mask[:width]


def seen_rows(seen: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor | None:
    """Context masks of the rows after each prefix of ``tokens``: row i has seen ``seen`` and tokens[:i]
    ([len(tokens) + 1, V]); None stays None. On the device: the drafted tokens are not read by the host,
    which reads once a round."""
    if seen is None:
        return None
    n = len(tokens)
    marked = torch.zeros(n + 1, seen.shape[-1], dtype=torch.bool, device=seen.device)
    marked[torch.arange(1, n + 1, device=seen.device), tokens] = True  # row i + 1 marks tokens[i]
    return seen | (marked.cumsum(0) > 0)  # and so does every row after it


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p, min-p and eta, over the last dimension (float32)."""
    if sampling.greedy:
        raise ValueError("warp() is for sampling; greedy decoding uses argmax")
    logits = as_float32(logits)
    if sampling.temperature != 1.0:  # dividing by 1 is exact: one kernel fewer a row at the default
        logits = logits / sampling.temperature
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass
        # strictly before it already reaches top_p (so the most likely token always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if sampling.eta > 0:
        # Eta sampling (Hewitt et al. 2022), as transformers' EtaLogitsWarper: drop tokens below
        # min(eta, sqrt(eta) * exp(-entropy)), never the most likely one.
        probs = logits.softmax(-1)
        entropy = -torch.special.xlogy(probs, probs).sum(-1, keepdim=True)
        cutoff = torch.clamp(math.sqrt(sampling.eta) * torch.exp(-entropy), max=sampling.eta)
        drop = (probs < cutoff) & (logits < logits.max(-1, keepdim=True).values)
        logits = logits.masked_fill(drop, float("-inf"))
    if sampling.min_p > 0:
        # As vLLM's and transformers' min-p: relative to the likeliest token after the other cuts.
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits.softmax(-1)


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32; itself when it already is. ``x.float()`` returns the same tensor then, but
    still goes through torch's dispatcher, and the sampler asks several times a round."""
    return x if x.dtype == torch.float32 else x.float()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of the largest value along the last dimension (the first on a tie), which is kept.

    ``max(...).indices`` picks the same index as ``argmax``, but on CPU torch 2.13 took 26 us for it
    over a 49k vocabulary against 72 us for ``argmax``, and greedy decoding asks once per token."""
    return logits.max(-1, keepdim=True).indices


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of ``probs`` (weights need not be normalised); shape ``probs.shape[:-1] + (1,)``.

    An exponential race: token i wins with E_i / p_i the smallest, E_i independent Exp(1) draws, and
    E_i / p_i is Exp(p_i), so i wins with probability p_i / sum(p), exactly (a zero weight never wins).
    Unlike torch.multinomial, which reads its input's sum on the host, it stays on the device: no
    synchronisation. The draws are clamped away from 0, which an Exp(1) sampler in float32 can
    return, so that no weight is ever divided by 0."""
    return race(probs, torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator))


def race(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """sample's exponential race over ``draws``, Exp(1) draws shaped as ``probs`` (float32), made
    beforehand: clamped away from 0 here, in place."""
    return (as_float32(probs) / draws.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(-1, keepdim=True)


def draw_chain(
    first: torch.Tensor,
    k: int,
    sampling: Sampling,
    draws: torch.Tensor | None,
    row_after: Callable[[torch.Tensor, int], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chain of ``k`` tokens drawn from the logits rows [V] ``first`` and then ``row_after(token, i)``
    (the row after the i-th token drawn, i from 1), as drafters/propose.propose_chain draws one without a
    stop: under greedy each row's argmax; under sampling a race (sample) of each row's warp q with
    ``draws`` [k, V], Exp(1) draws made beforehand, one row each. Returns the tokens [k] and the q rows
    [k, V] (None under greedy). Nothing in it reads the host, so one CUDA graph can hold it all
    (models/static.StaticLM.draft_chain)."""
    tokens, rows, logits = [], [], first
    for i in range(k):
        if i:
            logits = row_after(tokens[-1], i)
        if sampling.greedy:
            tokens.append(argmax(logits))
        else:
            rows.append(warp(logits, sampling))
            tokens.append(race(rows[-1], draws[i]))
    return torch.cat(tokens), torch.stack(rows) if rows else None


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The next token for a 1-D logits vector, as a 1-element tensor (no host sync)."""
    if sampling.greedy:
        return argmax(logits)
    return sample(warp(logits, sampling), generator)


def confident(probs: torch.Tensor, p_min: float) -> bool:
    """Whether a drafter proposes its next token: the draft's most likely token there has
    probability at least ``p_min`` (llama.cpp's --draft-p-min). Below it the drafter stops and does
    not draft that token.

    ``probs`` is the draft's own distribution at the position, 1-D: under sampling the warped row it
    would sample from (its q), under greedy the softmax of its logits. The rule reads nothing of the
    target's, so where a round stops depends only on what the draft has drafted: each drafted token
    is still drawn from the q it is verified against, and a position left undrafted gets the target's
    own token, so verification stays exact.
    """
    return float(probs.max()) >= p_min


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), returned unnormalised; falls back to p where p <= q everywhere.

    The fallback only triggers on rounding: a rejection has probability sum(max(0, p - q)),
    which is zero exactly when p == q, but float error can still reject with ratio 1 - eps.
    """
    diff = (p - q).clamp_min(0)
    return torch.where(diff.sum(-1, keepdim=True) > 0, diff, p)


@dataclass
class Verdict:
    """Outcome of verifying a draft: the accepted path and the token the target adds after it."""

    path: list[int]  # indices of the accepted draft tokens, root to leaf (a chain accepts a prefix)
    next_token: torch.Tensor  # 1-element tensor: the replacement, or the bonus token if the whole path passed
    beta_sum: torch.Tensor | float  # sum of beta = sum_x min(p, q) over the tested positions (on device)
    tested: int  # positions whose beta counts towards alpha: the accepted ones and the first rejected one
    # The emitted ids (the accepted drafts, then next_token) on the host, where the verification read
    # them with its verdict (one transfer a round); None where it did not.
    emitted_ids: list[int] | None = None

    @property
    def accepted(self) -> int:
        return len(self.path)


def uniforms(n: int, generator: torch.Generator, device) -> torch.Tensor:
    """``n`` independent Uniform[0, 1) draws on ``device``: one for each candidate an acceptance test may try."""
    return torch.rand(n, generator=generator, device=device)


def verify_chain_sampled(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling's accept/reject step for a chain of K drafts.

    draft_tokens: [K] ids; q: [K, V] the draft probabilities they were sampled from, or None for
    deterministic candidates (prompt lookup), which are exactly the one-hot q; p: [K+1, V] target
    probabilities (warped identically). Accept x_i with probability min(1, p_i(x_i)/q_i(x_i)), in
    order; on the first rejection sample from norm(max(0, p_i - q_i)); if all K pass, sample a bonus
    token from p_{K+1}. The result is distributed exactly as sampling from p.
    """
    k = draft_tokens.shape[0]
    if q is None:
        q = torch.nn.functional.one_hot(draft_tokens, p.shape[-1]).to(p.dtype)
    positions = torch.arange(k, device=p.device)
    p_x = p[positions, draft_tokens]
    q_x = q[positions, draft_tokens]
    # All K uniforms are drawn at once, and so is the token that would follow a rejection at every
    # position (and the bonus token after the last): draws past the first rejection go unused, which
    # leaves the used ones independent, so the law of the output is unchanged. What is known only
    # after the uniforms (where the first rejection is) is then read with the tokens in one transfer.
    r = uniforms(k, generator, p.device)
    accept = r * q_x < p_x  # r < p/q without dividing by a q_x that could underflow
    accepted = accept.cumprod(0).sum()
    drafted_rows = p[:k]
    following = sample(torch.cat([residual(drafted_rows, q), p[k:]]), generator).view(-1)  # [K + 1]
    # beta counts at the tested positions: the accepted ones and the first rejected one, if any
    # (position i is tested when i <= accepted, and i < K always holds).
    beta = torch.minimum(drafted_rows, q).sum(-1)
    beta_sum = (beta * (positions <= accepted)).sum()
    read = torch.cat([accepted.view(1), draft_tokens, following]).tolist()  # the round's one host read
    n, drafts, after = read[0], read[1 : k + 1], read[k + 1 :]
    return Verdict(list(range(n)), following[n : n + 1], beta_sum, min(n + 1, k), drafts[:n] + [after[n]])


@functools.cache  # asked every round: the bisection runs once per (value, K)
def synthetic_rate(acceptance: float, k: int) -> float:
    """The per-token acceptance rate of ``--synthetic-acceptance`` at lookahead ``k``: the value itself
    below 1; from 1 on a mean of tokens per round, E = (1 - a^(k+1)) / (1 - a), solved for a (it
    grows with a, from 1 at a = 0 to k + 1 at a = 1)."""
    if acceptance < 1:
        return acceptance
    if acceptance > k + 1:
        raise ValueError(f"a round of K = {k} yields at most {k + 1} tokens, not {acceptance:g}")
    if acceptance == k + 1:
        return 1.0  # every draft, exactly (the bisection would stop a hair below)
    low, high = 0.0, 1.0
    for _ in range(60):  # bisection to float precision
        mid = (low + high) / 2
        low, high = (mid, high) if sum(mid**i for i in range(k + 1)) < acceptance else (low, mid)
    return (low + high) / 2


def synthetic_rates(acceptance: float, k: int) -> list[float]:
    """The unconditional acceptance probability of each of ``k`` draft positions (a^1 .. a^k): what
    llama.cpp's --spec-synth-rates and vLLM's synthetic_acceptance_rates take."""
    rate = synthetic_rate(acceptance, k)
    return [rate ** (i + 1) for i in range(k)]


def verify_chain_synthetic(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
) -> Verdict:
    """Not a verification (benchmarking only): each draft token is kept with probability a
    (synthetic_rate) while all before it were, whatever the target thinks of it, and the target's own
    token follows (argmax under greedy, else sampled from its warped row). The output is not the
    target's law: rows decoded so are marked and never judged for exactness. beta is a at every
    tested position, so alpha is a. A mean of tokens per round is met at the round's own number of
    drafts; a round too short for it (the last of a decode, a short lookup) keeps all its drafts."""
    k = draft_tokens.shape[0]
    rate = synthetic_rate(min(sampling.synthetic_acceptance, k + 1), k)
    keep = torch.rand(k, generator=generator, device=target_logits.device) < rate
    accepted = keep.cumprod(0).sum()
    following = argmax(target_logits) if sampling.greedy else sample(warp(target_logits, sampling), generator)
    read = torch.cat([accepted.view(1), draft_tokens, following.view(-1)]).tolist()  # the round's one host read
    n, drafts, after = read[0], read[1 : k + 1], read[k + 1 :]
    tested = min(n + 1, k)
    return Verdict(list(range(n)), following.view(-1)[n : n + 1], rate * tested, tested, drafts[:n] + [after[n]])


def verify_chain_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification: keep draft tokens while they equal the target's argmax.

    target_logits: [K+1, V]. The replacement (or bonus) token is the target argmax at the first
    mismatch (or after the last draft token), so the output equals greedy target decoding.
    Under greedy both distributions are one-hot, so beta is 1 on a match and 0 otherwise.
    """
    k = draft_tokens.shape[0]
    choice = argmax(target_logits).squeeze(-1)
    accepted = (draft_tokens == choice[:k]).cumprod(0).sum()
    # One host read a round: the count and the target's choices, of which the accepted drafts and the
    # next token are the first accepted + 1 (an accepted draft is the target's choice there).
    read = torch.cat([accepted.view(1), choice]).tolist()
    n = read[0]
    return Verdict(list(range(n)), choice[n : n + 1], float(n), min(n + 1, k), read[1 : n + 2])


def normalised(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(-1, keepdim=True)


def children(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children in draft order; key -1 holds the root's (the last accepted token's)."""
    kids: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        kids.setdefault(parent, []).append(node)
    return kids


def verify_tree_greedy(tokens: torch.Tensor, parents: list[int], target_logits: torch.Tensor) -> Verdict:
    """Greedy verification of a tree: from the root, follow the child equal to the target's argmax.

    target_logits: [n+1, V], row 0 at the root and row i+1 at node i. The token after the last
    accepted node is the target's argmax there, so the output equals greedy target decoding.
    """
    choices = argmax(target_logits).squeeze(-1)
    # One host read: the target's choices and the tree's tokens.
    read = torch.cat([choices, tokens.to(choices.dtype)]).tolist()
    choice, ids, kids = read[: len(choices)], read[len(choices) :], children(parents)
    path, node = [], -1
    while (child := next((c for c in kids.get(node, []) if ids[c] == choice[node + 1]), None)) is not None:
        path.append(child)
        node = child
    tested = len(path) + (node in kids)  # the depths where a child was tried
    emitted = [ids[i] for i in path] + [choice[node + 1]]
    return Verdict(path, choices[node + 1 : node + 2], float(len(path)), tested, emitted)


def verify_tree_sampled(
    tokens: torch.Tensor, parents: list[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator
) -> Verdict:
    """Multi-candidate speculative sampling over a tree (SpecInfer's rule), exact for either kind of draft.

    p: [n+1, V] target probabilities, row 0 at the root and row i+1 at node i. q: [n, V], row i the
    distribution node i was drawn from (siblings share one row: they are independent draws from
    it), or None for deterministic candidates. At each node the children are tried in order:
    - drawn from q: accept x with probability min(1, p(x)/q(x)); on a rejection p becomes
      norm(max(0, p - q)) and the next child is tried against it;
    - deterministic: accept x with probability p(x); on a rejection p(x) becomes 0, p is
      renormalised, and the next child is tried.
    After an acceptance the walk continues from that child with the target's row there; when no
    child is accepted (or the node has none) the next token is sampled from what p has become.

    The host reads the device once. Everything the walk may compare is computed first, for every
    node: a uniform per child, the values of p (as it is when that child is tried) and q at its token,
    and the token that would follow if the walk ended there, drawn from what p becomes once all its
    children are rejected. The walk, on the host, then uses some of these draws; the rest go unused,
    which leaves the used ones independent, so the law of the output is unchanged."""
    n, device, kids = len(parents), p.device, children(parents)
    drawn = uniforms(n, generator, device)
    ends = p.clone()  # row v + 1: p at node v, then as it becomes after each of v's children is rejected
    tried, p_x, q_x = [], [], []  # by sibling rank j: the children tried j-th, p and q at their tokens
    for j in range(max(map(len, kids.values()), default=0)):
        at = [v for v in kids if len(kids[v]) > j]
        tried += [kids[v][j] for v in at]
        rows, child = ids_to_device([v + 1 for v in at], device), ids_to_device([kids[v][j] for v in at], device)
        x, now = tokens[child], ends[rows]
        p_x.append(now.gather(-1, x[:, None]).squeeze(-1))
        if q is None:
            q_x.append(torch.ones_like(p_x[-1]))
            now[torch.arange(len(at), device=device), x] = 0.0
            ends[rows] = normalised(now)
        else:
            q_x.append(q[child].gather(-1, x[:, None]).squeeze(-1))
            ends[rows] = normalised(residual(now, q[child]))
    firsts = ids_to_device([kids[v][0] for v in kids], device)
    first_rows = ids_to_device([v + 1 for v in kids], device)
    if q is None:  # beta at a node: sum min(p, q) over its row before any child is tried
        beta = p[first_rows, tokens[firsts]]
    else:
        beta = torch.minimum(p[first_rows], q[firsts]).sum(-1)
    following = sample(ends, generator).view(-1)  # [n + 1]: the token after the walk, wherever it ends
    parts = [drawn, *p_x, *q_x, beta, following, tokens]
    read = torch.cat([t.double() for t in parts]).tolist()  # the one host read
    u, read = read[:n], read[n:]
    at_p = dict(zip(tried, read[: len(tried)], strict=True))
    at_q = dict(zip(tried, read[len(tried) : 2 * len(tried)], strict=True))
    read = read[2 * len(tried) :]
    beta_at = dict(zip(kids, read[: len(kids)], strict=True))
    after, ids = [int(t) for t in read[len(kids) : len(kids) + n + 1]], [int(t) for t in read[len(kids) + n + 1 :]]
    path, node, beta_sum, tested = [], -1, 0.0, 0
    while node in kids:
        beta_sum += beta_at[node]
        tested += 1
        accepted = next((c for c in kids[node] if u[c] * at_q[c] < at_p[c]), None)
        if accepted is None:
            break
        path.append(accepted)
        node = accepted
    return Verdict(path, following[node + 1 : node + 2], beta_sum, tested, [ids[i] for i in path] + [after[node + 1]])
