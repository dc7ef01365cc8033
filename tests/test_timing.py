"""The phase clock: laps sum per phase, the first forward after reset is the prefill, and on CUDA
the events are read once per decode (no host synchronisation inside the loop)."""

import time

import torch

from specbench.timing import PhaseClock, TimedLM
from tests.toy import ToyLM


def test_a_timed_model_splits_a_decode_into_prefill_phase_and_other():
    clock = PhaseClock(torch.device("cpu"))
    lm = TimedLM(ToyLM(8, seed=0), clock, "verify")
    start = time.perf_counter()
    clock.start()
    lm.reset()
    lm.forward(torch.tensor([1, 2, 3]))
    time.sleep(0.02)  # between forwards: other
    lm.forward(torch.tensor([4]))
    lm.forward(torch.tensor([5]))
    phases = clock.stop()
    wall = time.perf_counter() - start
    assert phases.prefill > 0 and phases.verify > 0 and phases.draft == 0
    assert phases.other >= 0.02
    assert abs(phases.total - wall) < 0.01 * wall  # the laps cover the decode, nothing twice
    lm.reset()  # a new sequence starts with a prefill again
    clock.start()
    lm.forward(torch.tensor([1]))
    assert clock.stop().verify == 0


class FakeEvent:
    """Stands in for torch.cuda.Event: records the host time, answers elapsed_time in ms."""

    def __init__(self, enable_timing):
        assert enable_timing

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, later):
        return (later.at - self.at) * 1000


def test_on_cuda_laps_are_events_read_once_at_the_end(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    clock = PhaseClock(torch.device("cuda"))
    clock.start()
    for _ in range(5):
        clock.lap("other")
        time.sleep(0.002)
        clock.lap("draft")
    assert syncs == []  # nothing waits for the device while the loop runs
    phases = clock.stop()
    assert len(syncs) == 1 and 0.009 < phases.draft < 0.05
