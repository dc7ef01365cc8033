"""The phase clock: laps sum per phase, the first forward after reset is the prefill, and on CUDA
the events are read once per decode (no host synchronisation inside the loop)."""

import time

import pytest
import torch

from specbench.decoding.timing import PhaseClock, TimedLM
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
    # The laps cover the decode from start to stop, nothing twice: they sum to the span of the marks,
    # which lies inside the wall time (a tolerance on wall - total flaked on a loaded CI host).
    assert phases.total == pytest.approx(clock.marks[-1][1] - clock.marks[0][1], rel=1e-9)
    assert phases.total <= wall
    lm.reset()  # a new sequence starts with a prefill again
    clock.start()
    lm.forward(torch.tensor([1]))
    assert clock.stop().verify == 0


class FakeEvent:
    """Stands in for torch.cuda.Event: records the host time, answers elapsed_time in ms."""

    def __init__(self, enable_timing):
        assert enable_timing

    def record(self, stream=None):
        self.at, self.stream = time.perf_counter(), stream

    def elapsed_time(self, later):
        return (later.at - self.at) * 1000


def test_on_cuda_laps_are_events_read_once_at_the_end(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
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


def test_on_a_second_gpu_the_events_are_on_its_stream_and_its_synchronisation(monkeypatch):
    """--device cuda:1: work queues on cuda:1's stream, so the laps must be recorded there, and the
    end must wait for cuda:1; the current device (cuda:0 unless set) would time an idle queue."""
    syncs, events = [], []

    class Recorded(FakeEvent):
        def record(self, stream=None):
            super().record(stream)
            events.append(self)

    monkeypatch.setattr(torch.cuda, "Event", Recorded)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    second = torch.device("cuda", 1)
    clock = PhaseClock(second)
    clock.start()
    clock.lap("verify")
    clock.stop()
    assert [event.stream for event in events] == [("stream of", second)] * 3
    assert syncs == [second]


@pytest.mark.gpu
def test_on_the_last_gpu_the_laps_time_its_work():
    """Only a GPU shows that events time the device's own queue: the last one (cuda:N, N > 0 where
    there are several) while the current device stays cuda:0. A forward-sized chain of matmuls
    lapped as verify holds most of the wall time, measured by the host around a synchronisation."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    x = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize(device)
    clock = PhaseClock(device)
    start = time.perf_counter()
    clock.start()
    for _ in range(50):
        x = torch.tanh(x @ x)
    clock.lap("verify")
    phases = clock.stop()
    wall = time.perf_counter() - start
    assert 0.5 * wall < phases.verify <= wall * 1.05
