"""Where a decode's time goes: its wall time split into phases (prefill, draft, verify, other).

A clock is lapped at every boundary between a model forward and the rest of the loop. On CPU a
lap reads the host clock: CPU ops finish before they return, so that is exact. On CUDA a lap
records an event on the stream and the events are read once, when the decode ends, so timing
adds no host synchronisation to the loop it measures.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class Phases:
    """Seconds per phase of one decode. ``verify`` is every target forward after the prefill
    (for the baseline, its one-token steps); ``draft`` every draft forward after the draft's prefill;
    ``inner`` the level beneath the draft model in a cascade (its prompt lookup); ``other`` the
    rest: sampling, accept/reject, cache bookkeeping, Python."""

    prefill: float = 0.0
    draft: float = 0.0
    inner: float = 0.0
    verify: float = 0.0
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.prefill + self.draft + self.inner + self.verify + self.other


class PhaseClock:
    """Laps of one decode at a time: ``start``, then ``lap(phase)`` whenever a phase ends, then ``stop``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.events = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def _now(self):
        if self.events:
            # On the model's device's stream: the current device's (cuda:0 by default) would time
            # another GPU's queue when the run's is cuda:N.
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        if self.device.type == "mps":
            synchronize(self.device)  # the only way to know a phase has ended there
        return time.perf_counter()

    def start(self) -> None:
        self.marks = [("", self._now())]

    def lap(self, phase: str) -> None:
        """The time since the previous lap belongs to ``phase``."""
        self.marks.append((phase, self._now()))

    def stop(self) -> Phases:
        """End the decode (the time since the last lap is ``other``) and sum the laps per phase."""
        self.lap("other")
        if self.events:
            torch.cuda.synchronize(self.device)
            seconds = [a.elapsed_time(b) / 1000 for (_, a), (_, b) in zip(self.marks, self.marks[1:], strict=False)]
        else:
            seconds = [b - a for (_, a), (_, b) in zip(self.marks, self.marks[1:], strict=False)]
        phases = Phases()
        for (phase, _), s in zip(self.marks[1:], seconds, strict=True):
            setattr(phases, phase, getattr(phases, phase) + s)
        return phases


class ForwardLaps:
    """Laps ``clock`` around one model's forwards: the time before a forward is ``other``, the
    forward itself ``prefill`` when it is the first since ``restart``, else ``phase``. It counts
    the forwards too; without a clock it only counts."""

    def __init__(self, clock: PhaseClock | None, phase: str):
        self.clock, self.phase, self.count = clock, phase, 0

    def restart(self) -> None:
        self.count = 0

    def before(self) -> None:
        if self.clock is not None:
            self.clock.lap("other")

    def after(self) -> None:
        if self.clock is not None:
            self.clock.lap(self.phase if self.count else "prefill")
        self.count += 1


class TimedLM:
    """A CausalLM whose forwards are laps of ``clock`` (see ForwardLaps); a reset starts a new prefill."""

    def __init__(self, lm, clock: PhaseClock, phase: str):
        self.lm, self.laps = lm, ForwardLaps(clock, phase)
        self.device = lm.device

    def reset(self) -> None:
        self.lm.reset()
        self.laps.restart()

    def prefill(self, prompt_ids) -> None:
        self.laps.restart()
        self.laps.before()
        self.lm.prefill(prompt_ids)
        self.laps.after()

    def __getattr__(self, name: str):  # the wrapped model's other attributes (a view's budget, ...)
        return getattr(self.lm, name)

    def forward(self, token_ids, last=1, positions=None, mask=None):
        self.laps.before()
        logits = self.lm.forward(token_ids, last, positions, mask)
        self.laps.after()
        return logits

    def keep(self, path: Sequence[int], new: int) -> None:
        self.lm.keep(path, new)

    @property
    def length(self) -> int:
        return self.lm.length


class TimedDrafter:
    """A drafter whose proposals are laps of ``clock`` in ``phase`` (a cascade's bottom level); its
    other methods and attributes are the wrapped drafter's."""

    def __init__(self, drafter, clock: PhaseClock, phase: str):
        self.drafter, self.clock, self.phase = drafter, clock, phase

    def propose(self, k: int):
        self.clock.lap("other")
        draft = self.drafter.propose(k)
        self.clock.lap(self.phase)
        return draft

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)
