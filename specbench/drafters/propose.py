"""How a drafter that reads its own drafts proposes, whatever reads them: a chain one token at a time,
a tree one level at a time. A small draft model (model.py, trees.py) and an EAGLE head (eagle.py)
differ only in what gives the next rows; these functions draw from the rows, stop where unsure, and
keep the q each token was drawn from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from specbench.decoding.sampling import Sampling, argmax, confident, sample, warp
from specbench.decoding.tree import tree_inputs


class Chain(NamedTuple):
    """What propose_chain drew: the tokens [n] (ids of the rows' vocabulary), their q rows [n, V] (None
    under greedy), the forwards that gave rows, and whether it stopped before K (``p_min``)."""

    tokens: list[torch.Tensor]
    q: torch.Tensor | None
    forwards: int
    stopped: bool


def propose_chain(
    k: int,
    row_after: Callable[[torch.Tensor | None], torch.Tensor],
    sampling: Sampling,
    generator: torch.Generator,
    p_min: float | None = None,
    draw: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Chain:
    """Up to ``k`` tokens, one a forward: ``row_after(token)`` reads the token drawn last (None before
        the first) and returns the logits row [V] the next is drawn from, its argmax under greedy, under
        sampling a sample of its warped row q, verified against q (``draw(logits, q)`` may say otherwise:
    the audit's deliberately broken drafters draw from one row and report another). With ``p_min`` the chain stops before
        the first token whose row it is not confident of (sampling.confident); the forward that found that
        row counts."""
    drafted, q_rows, forwards = [], [], 0
    for _ in range(k):
        logits = row_after(drafted[-1] if drafted else None)
        forwards += 1
        q = None if sampling.greedy else warp(logits, sampling)
        if p_min is not None and not confident(logits.float().softmax(-1) if q is None else q, p_min):
            return Chain(drafted, torch.stack(q_rows) if q_rows else None, forwards, True)
        if q is None:
            drafted.append(argmax(logits))
        else:
            token, q = draw(logits, q) if draw is not None else (sample(q, generator), q)
            drafted.append(token)
            q_rows.append(q)
    return Chain(drafted, torch.stack(q_rows) if q_rows else None, forwards, False)


def tree_parents(shape: Sequence[int]) -> list[int]:
    """Parents of a full tree in level order: ``shape[d]`` children for every node at depth d
    (the root, the last accepted token, is -1). ``(1,) * K`` is a chain of K."""
    parents, level = [], [-1]
    for branching in shape:
        start = len(parents)
        parents += [parent for parent in level for _ in range(branching)]
        level = list(range(start, len(parents)))
    return parents


def tree_level(
    rows: torch.Tensor, branching: int, sampling: Sampling, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``branching`` children for each row of logits [n, V], each row's together (as tree_parents
    numbers them): its top-b ids under greedy, b independent draws from its warped row under
    sampling. Returns the ids [n * b] and the q row each was drawn from (None under greedy)."""
    if sampling.greedy:
        return rows.topk(branching, dim=-1).indices.flatten(), None
    q = warp(rows, sampling)
    drawn = sample(q.unsqueeze(1).expand(-1, branching, -1), generator).flatten()  # b races per row: no host read
    return drawn, q.repeat_interleave(branching, dim=0)


def propose_tree(
    shape: Sequence[int],
    base: int,
    state,
    logits_of: Callable[..., torch.Tensor],
    read: Callable[..., torch.Tensor],
    sampling: Sampling,
    generator: torch.Generator,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """A tree of ``shape`` drawn level by level (tree_level): ``state`` is what the root's rows come
    from (logits [1, V], or a head's output with its scores, as ``logits_of`` reads it), and ``read(level, state,
    branching, positions, mask)`` reads a level's tokens with the tree mask after ``base`` cached
    positions, so that a node sees only its ancestors, and returns their state. The leaves are never
    read. ``ids`` maps the rows' vocabulary to token ids (an EAGLE head's draft vocabulary). Returns
    the tokens in level order, their parents, and the q rows (None under greedy)."""
    parents = tree_parents(shape)
    positions, mask = tree_inputs(parents, base, logits_of(state).device)
    tokens, q_rows, start = [], [], 0
    for depth, branching in enumerate(shape):
        level, q = tree_level(logits_of(state), branching, sampling, generator)
        if q is not None:
            q_rows.append(q)
        if ids is not None:
            level = ids[level]
        tokens.append(level)
        end = start + len(level)
        if depth + 1 < len(shape):
            state = read(level, state, branching, positions[start:end], mask[start:end, : base + end])
        start = end
    return torch.cat(tokens), parents, torch.cat(q_rows) if q_rows else None
