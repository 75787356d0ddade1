"""The tuner's timer is the bench timer (CUDA events faked here) and its statistics."""

import pytest
import torch

from flamia_gen.tune import gpu
from flamia_gen.tune.runner import summarize


class _FakeEvent:
    clock = 0.0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        _FakeEvent.clock += 1.0
        self.t = _FakeEvent.clock

    def elapsed_time(self, end):
        return end.t - self.t


def test_time_cuda_rotates_calls_and_returns_one_sample_per_repeat(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    seen = []
    calls = [lambda i=i: seen.append(i) for i in range(3)]
    samples = gpu.time_cuda(calls, warmup=2, repeats=4)
    assert samples == [1.0] * 4  # start and end event of each call, in order
    assert seen == [0, 1, 2, 0, 1, 2]  # warm-up then timed calls, rotating over the inputs
    with pytest.raises(ValueError):
        gpu.time_cuda(calls, repeats=0)


def test_summarize_samples():
    m = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert m.ok and (m.median_ms, m.min_ms, m.repeats) == (3.0, 1.0, 5)
    assert m.p20_ms == pytest.approx(1.8) and m.p80_ms == pytest.approx(4.2)
    assert not summarize([]).ok and summarize([]).reason == "no timing samples"
