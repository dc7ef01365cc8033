"""Where a decode's time goes: its wall time split into phases (prefill, draft, verify, other);
and the most memory it held (PeakMemory).

A clock is lapped at every boundary between a model forward and the rest of the loop. On CPU a
lap reads the host clock: CPU ops finish before they return, so that is exact. On CUDA a lap
records an event on the stream and the events are read once, when the decode ends, so timing
adds no host synchronisation to the loop it measures.
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
    ``inner`` the level beneath the draft model in a cascade (its prompt lookup); ``retokenize`` the
    conversions between a draft's vocabulary and the target's (drafters/vocab.py); ``other`` the
    rest: sampling, accept/reject, cache bookkeeping, Python."""

    prefill: float = 0.0
    draft: float = 0.0
    inner: float = 0.0
    retokenize: float = 0.0
    verify: float = 0.0
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.prefill + self.draft + self.inner + self.retokenize + self.verify + self.other


class PhaseClock:
    """Laps of one decode at a time: ``start``, then ``lap(phase)`` whenever a phase ends, then ``stop``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.events = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.verified: list[int] = []  # the marks that ended a target forward (TimedLM "verify"'s)
        # Seconds from the start to the end of each target forward (the prefill's first), after stop.
        self.forward_ends: list[float] = []

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
        self.marks, self.verified = [("", self._now())], []

    def lap(self, phase: str) -> None:
        """The time since the previous lap belongs to ``phase``."""
        self.marks.append((phase, self._now()))

    def stop(self, past_stop: int = 0) -> Phases:
        """End the decode (the time since the last lap is ``other``) and sum the laps per phase.

        ``past_stop``: the decode's last forwards ran after it had ended (decode.autoregressive_decode
        learns of a stop token late): the decode ends where the first of them began, so that neither
        they nor what followed them is counted (each forward is two laps: the ``other`` before it, and
        its own; the ``other`` before the first of them holds the choice of the last kept token)."""
        if past_stop:
            del self.marks[len(self.marks) - 2 * past_stop + 1 :]
        else:
            self.lap("other")
        if self.events:
            torch.cuda.synchronize(self.device)
            seconds = [a.elapsed_time(b) / 1000 for (_, a), (_, b) in zip(self.marks, self.marks[1:], strict=False)]
        else:
            seconds = [b - a for (_, a), (_, b) in zip(self.marks, self.marks[1:], strict=False)]
        phases = Phases()
        for (phase, _), s in zip(self.marks[1:], seconds, strict=True):
            setattr(phases, phase, getattr(phases, phase) + s)
        since = [0.0, *itertools.accumulate(seconds)]
        self.forward_ends = [since[i] for i in self.verified if i < len(self.marks)]
        return phases


CLEAR_REFS, STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")
# What PeakMemory.source names, as meta.json says it.
MEMORY_SOURCES = {
    "cuda": "torch.cuda.max_memory_allocated on the device, reset before each decode",
    "vmhwm": "the process's peak resident set (Linux VmHWM), reset before each decode",
    "ru_maxrss": "the process's peak resident set since it started (getrusage: never reset, so it only grows)",
}


class PeakMemory:
    """The most memory held on ``device`` from ``reset`` to ``peak``, in bytes.

    CUDA: what torch's caching allocator handed out (weights, caches, activations), without its free
    reserve or the CUDA context; both calls read the allocator's counters on the host, with no
    synchronisation. CPU: the whole process's peak resident set, weights included (Linux's VmHWM,
    which writing 5 to /proc/self/clear_refs sets back to the current resident set); where that file
    cannot be written, getrusage's peak since the process started, which never goes down. ``source``
    says which (MEMORY_SOURCES); None on other devices (mps), whose peak is None.
    """

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            # The allocator's counters exist once CUDA is initialised: before, in a process that has
            # not touched the GPU yet, reset_peak_memory_stats fails ("Invalid device argument", seen
            # on an H200 in make gpu-check).
            torch.cuda.init()
            self.source = "cuda"
        elif device.type == "cpu":
            self.source = "vmhwm" if _clear_peak_rss() and _vm_hwm() is not None else "ru_maxrss"
        else:
            self.source = None

    def reset(self) -> None:
        if self.source == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.source == "vmhwm":
            _clear_peak_rss()

    def peak(self) -> int | None:
        if self.source == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.source == "vmhwm":
            return _vm_hwm()
        if self.source == "ru_maxrss":
            import resource  # Unix only: imported where it is used

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux
        return None


def _clear_peak_rss() -> bool:
    """Set the process's peak resident set back to its current one (Linux 4.0+); whether it could."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _vm_hwm() -> int | None:
    """The process's peak resident set in bytes, from /proc/self/status; None where there is none."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


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
            if self.phase == "verify":  # the target's (its prefill too): when a step's tokens exist
                self.clock.verified.append(len(self.clock.marks) - 1)
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

    def draft_chain(self, *args):
        """The wrapped model's chain drafted in one go (models/static.StaticLM.draft_chain): its forwards
        lapped as one."""
        self.laps.before()
        drafted = self.lm.draft_chain(*args)
        self.laps.after()
        return drafted

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
