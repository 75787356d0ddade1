"""Timing statistics (CPU fallback) and the TFLOP/s ceiling guard."""

import time

import pytest

from flamia_gen.bench.timing import (DEFAULT_CEILINGS, check_ceiling, host_issue_ms, issue_times, percentile, summarize,
                                     time_cpu, time_fn)


def test_percentile_matches_linear_interpolation():
    vals = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(vals, 50) == 3.0
    assert percentile(vals, 20) == pytest.approx(1.8)
    assert percentile(vals, 80) == pytest.approx(4.2)
    assert percentile(vals, 0) == 1.0 and percentile(vals, 100) == 5.0
    assert percentile([7.0], 37) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0], warmup=2, timer="t")
    assert (s.median_ms, s.min_ms) == (3.0, 1.0)
    assert s.p20_ms == pytest.approx(1.8) and s.p80_ms == pytest.approx(4.2)
    assert s.repeats == 5 and s.warmup == 2
    assert "samples_ms" not in s.to_dict()


def test_cpu_timer_counts_calls_and_measures_sleep():
    calls = []

    def f():
        calls.append(1)
        time.sleep(0.002)

    s = time_cpu(f, warmup=3, repeats=20)
    assert len(calls) == 23
    assert s.repeats == 20 and s.timer == "cpu-perf-counter"
    assert 1.9 <= s.min_ms <= s.p20_ms <= s.median_ms <= s.p80_ms
    assert s.median_ms < 50
    assert s.peak_mem_bytes is None


def test_cpu_timer_rotates_a_list_of_callables():
    seen = []
    fns = [lambda i=i: seen.append(i) for i in range(3)]
    time_fn(fns, device="cpu", warmup=1, repeats=5, memory_baseline_bytes=0)
    assert seen == [0, 1, 2, 0, 1, 2]


def test_host_issue_time_counts_the_calls_it_issues():
    seen = []

    def slow(i):
        seen.append(i)
        time.sleep(0.002)

    fns = [lambda i=i: slow(i) for i in range(2)]
    ms = host_issue_ms(fns, device="cpu", calls=5)
    assert seen == [0, 1, 0, 1, 0] and 1.9 <= ms < 50
    host, wall = issue_times(fns, device="cpu", calls=2, warmup=1)  # one untimed call first, then two timed
    assert seen[5:] == [0, 1, 0] and 1.9 <= host <= wall < 50
    assert host_issue_ms(lambda: None, device="cpu", calls=3) < 1.0
    with pytest.raises(ValueError, match="calls"):
        host_issue_ms(lambda: None, device="cpu", calls=0)
    with pytest.raises(ValueError, match="no callable"):
        host_issue_ms([], device="cpu")


def test_bad_counts():
    with pytest.raises(ValueError):
        time_cpu(lambda: None, repeats=0)
    with pytest.raises(ValueError):
        time_cpu(lambda: None, warmup=-1)


def test_ceiling_guard():
    assert DEFAULT_CEILINGS == {"bf16": 1000.0, "fp8": 2000.0}
    assert check_ceiling(990.0, "bf16") == (False, "")
    suspect, note = check_ceiling(1200.0, "bf16")
    assert suspect and "1200" in note and "1000" in note
    assert check_ceiling(1200.0, "fp8") == (False, "")
    assert check_ceiling(2100.0, "fp8")[0]
    assert check_ceiling(500.0, "bf16", {"bf16": 400.0})[0]
    assert check_ceiling(None, "bf16") == (False, "")
