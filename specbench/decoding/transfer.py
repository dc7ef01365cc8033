"""Host data onto the device inside a decode, without making the host wait."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host``, a CPU tensor, on ``device``. On CUDA a copy from pageable memory first waits for all
    the work queued before it (a host sync in every round that built its drafts or positions on the
    host: make gpu-check counted one a round for prompt lookup on an H200); a copy from pinned
    memory is queued behind that work and the host goes on to queue the forward that reads it. The
    pinned buffer comes from torch's caching host allocator, which keeps it until the copy is done."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def ids_to_device(ids: list[int], device: torch.device) -> torch.Tensor:
    """Token ids (or positions) from the host as a long tensor on ``device`` (to_device)."""
    return to_device(torch.tensor(ids, dtype=torch.long), device)
