"""Inputs for verifying a tree of draft tokens in one forward pass."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specbench.decoding.transfer import to_device


def tree_inputs(parents: Sequence[int], cache_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and attention mask for appending a tree of ``len(parents)`` tokens to a cache.

    ``parents[i]`` is the index (among these tokens) of node i's parent, or -1 when node i is a
    child of the newest cached token; parents come before their children. Node i sits at position
    ``cache_len + depth(i)`` (depth 0 for parent -1), as it would in a linear decode of its own
    branch, and may attend to the whole cache, its ancestors and itself.

    Returns (positions [n] long, mask [n, cache_len + n] bool), mask[i, j] True when node i may
    attend to position j of the cache-plus-new-tokens axis. A chain (parents [-1, 0, 1, ...])
    gives consecutive positions and the causal mask.
    """
    n = len(parents)
    # Built as Python lists and made a tensor once: 3 tensor operations a node made it a third of a
    # tree decode's operations on the test toy, each a dispatch that costs more than the work on the host.
    ancestry = [[j == i for j in range(n)] for i in range(n)]
    depth = [0] * n
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: a parent must be -1 or an earlier node")
        if p >= 0:
            ancestry[i][:i] = ancestry[p][:i]  # the parent and its ancestors
            depth[i] = depth[p] + 1
    positions = torch.tensor([cache_len + d for d in depth], dtype=torch.long)
    mask = torch.cat(
        [torch.ones(n, cache_len, dtype=torch.bool), torch.tensor(ancestry, dtype=torch.bool).view(n, n)], dim=1
    )
    return to_device(positions, device), to_device(mask, device)
