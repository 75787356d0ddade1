"""run_bench end to end on the CPU with stand-in implementations."""

import json

import pytest
import torch

from flamia_gen.bench.flops import workload_flops
from flamia_gen.bench.report import read_json
from flamia_gen.bench.runner import NoCudaError, run_bench
from flamia_gen.bench.workloads import get_workload


def _wls():
    return [get_workload("eq2x32", heads=2, head_dim=16),
            get_workload("skew32+2x8", heads=2, head_dim=16)]


def test_run_bench_cpu_rows_statuses_speedups_and_files(tmp_path, fakes):
    impls = [fakes[n]() for n in ("cpu_exact", "cpu_slow", "flamia_cpu", "cpu_skips",
                                  "cpu_raises", "cpu_missing", "cpu_eqonly")]
    res = run_bench(_wls(), impls, mode="train", out_dir=tmp_path, repeats=3, warmup=0,
                    accuracy=True, accuracy_workload="eq2x32", device="cpu", quiet=True,
                    n_rotations=2)
    rows = {(r.impl, r.workload): r for r in res.rows}
    assert len(res.rows) == 7 * 2
    exact = rows[("cpu_exact", "eq2x32")]
    assert exact.status == "ok" and exact.timer == "cpu-perf-counter" and exact.repeats == 3
    assert exact.flops == workload_flops(_wls()[0], "train")
    assert exact.tflops == pytest.approx(exact.flops / (exact.median_ms * 1e-3) / 1e12)
    assert exact.p20_ms <= exact.median_ms <= exact.p80_ms
    assert "only 3 repeats" in exact.note
    slow = rows[("cpu_slow", "eq2x32")]
    assert slow.median_ms > 3.5  # its 4 ms sleep is inside the timed call
    assert slow.host_ms > 3.5 and exact.host_ms is not None  # (on the CPU the host time is the call's wall time)
    # cpu_exact and cpu_eqonly compute the same thing: either can be the fastest peer
    best_ms = min(rows[(n, "eq2x32")].median_ms for n in ("cpu_exact", "cpu_eqonly"))
    assert max(rows[(n, "eq2x32")].speedup for n in ("cpu_exact", "cpu_eqonly")) == pytest.approx(1.0)
    assert exact.speedup == pytest.approx(best_ms / exact.median_ms)
    assert slow.speedup == pytest.approx(best_ms / slow.median_ms) and slow.speedup < 1
    ours = rows[("flamia_cpu", "eq2x32")]
    assert ours.is_peer is False and ours.speedup is not None
    assert rows[("cpu_skips", "eq2x32")].status == "skipped"
    assert "no engine" in rows[("cpu_skips", "eq2x32")].note
    err = rows[("cpu_raises", "eq2x32")]
    assert err.status == "error" and err.note == "RuntimeError: kernel exploded"
    assert rows[("cpu_missing", "skew32+2x8")].status == "not installed"
    assert rows[("cpu_eqonly", "skew32+2x8")].status == "skipped"
    assert rows[("cpu_eqonly", "eq2x32")].status == "ok"
    # accuracy columns filled on the accuracy workload's rows only
    assert exact.o_cos > 0.999 and exact.dq_cos > 0.999
    assert rows[("cpu_exact", "skew32+2x8")].o_cos is None
    assert {a.impl for a in res.accuracy} == {a.name for a in impls}
    # files
    assert res.json_path.name == "bench_train.json"
    doc = read_json(res.json_path)
    assert len(doc["rows"]) == 14 and doc["metadata"]["mode"] == "train"
    assert doc["metadata"]["workloads"][1]["num_docs"] == 3
    assert "3.5x" in doc["metadata"]["flop_convention"]
    assert len(doc["accuracy"]) == 7
    text = res.table_path.read_text()
    assert "cpu_exact" in text and "kernel exploded" in text
    try:
        import matplotlib  # noqa: F401
        assert res.chart_path is not None and res.chart_path.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert res.chart_path is None


def test_fwd_mode_runs_without_autograd(fakes):
    calls = []

    class Probe(fakes["cpu_exact"]):
        name = "probe"

        def build(self, workload):
            def f(q, k, v):
                calls.append(torch.is_grad_enabled())
                return q
            return f

    res = run_bench([_wls()[0]], [Probe()], mode="fwd", repeats=3, warmup=1, accuracy=False,
                    device="cpu", quiet=True, n_rotations=2)
    assert res.rows[0].status == "ok"
    assert calls == [False] * (4 + 20)  # warm-up, timed calls, the host-issue calls
    assert res.rows[0].flops == workload_flops(_wls()[0], "fwd")


def test_suspect_rates_are_flagged_and_not_a_baseline(fakes):
    impls = [fakes["cpu_exact"](), fakes["cpu_slow"]()]
    res = run_bench([_wls()[0]], impls, repeats=3, warmup=0, accuracy=False, device="cpu",
                    quiet=True, ceilings={"bf16": 1e-12}, n_rotations=1)
    assert all(r.suspect and r.note.startswith("suspect") for r in res.rows)
    assert all(r.speedup is None for r in res.rows)


def test_bad_arguments(fakes):
    with pytest.raises(ValueError, match="mode"):
        run_bench("eq2x32", [fakes["cpu_exact"]()], mode="inference", device="cpu", quiet=True)
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        run_bench("nope", [fakes["cpu_exact"]()], device="cpu", quiet=True)
    with pytest.raises(ValueError, match="unknown implementation"):
        run_bench("eq2x32", "fa9", device="cpu", quiet=True)


def test_cuda_requested_without_cuda(monkeypatch, fakes):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoCudaError, match="no CUDA device: flamia-gen bench needs a GPU"):
        run_bench("eq2x32", [fakes["cpu_exact"]()], device="cuda", quiet=True)


def test_builtin_peers_become_rows_not_crashes(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = run_bench([_wls()[1]], "peers", repeats=2, warmup=0, accuracy=False, device="cpu",
                    quiet=True, out_dir=tmp_path)
    assert len(res.rows) == 8
    assert all(r.status in ("not installed", "unavailable") for r in res.rows)
    doc = json.loads(res.json_path.read_text())
    assert set(doc["metadata"]["impls"]) == {r.impl for r in res.rows}


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the bwd mode must time it, and only it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        import time

        time.sleep(0.05)
        return g


def test_bwd_mode_times_the_backward_alone(fakes, tmp_path):
    exact = fakes["cpu_exact"]

    class BwdSlow(exact):
        name = "cpu_bwd_slow"

        def build(self, workload):
            f = super().build(workload)
            return lambda q, k, v: _SlowBackward.apply(f(q, k, v))

    forwards = []

    class Counting(exact):
        name = "cpu_counting"

        def build(self, workload):
            f = super().build(workload)

            def g(q, k, v):
                forwards.append(1)
                return f(q, k, v)
            return g

    class FwdSlow(exact):  # sleeps 50 ms in its forward: far above what a loaded CI machine adds to a tiny backward
        name = "cpu_slow"
        delay_s = 0.05

    impls = [FwdSlow(), BwdSlow(), Counting()]
    res = run_bench([_wls()[0]], impls, mode="bwd", out_dir=tmp_path, repeats=3, warmup=1,
                    accuracy=False, device="cpu", quiet=True, n_rotations=2)
    rows = {r.impl: r for r in res.rows}
    assert all(r.status == "ok" for r in res.rows), [r.note for r in res.rows]
    # cpu_slow sleeps 50 ms in its forward: outside the timed backward calls; cpu_bwd_slow's backward sleeps 50 ms
    assert rows["cpu_slow"].median_ms < 25
    assert rows["cpu_bwd_slow"].median_ms > 45
    # one forward per input set (2 rotations), none inside the 1 + 3 timed calls
    assert len(forwards) == 2
    assert rows["cpu_slow"].flops == workload_flops(_wls()[0], "bwd")
    assert res.json_path.name == "bench_bwd.json"
    assert read_json(res.json_path)["metadata"]["mode"] == "bwd"


def test_bwd_call_gives_the_train_calls_gradients(fakes):
    wl = _wls()[0]
    from flamia_gen.bench.workloads import make_inputs

    inputs = make_inputs(wl, torch.bfloat16, "cpu", 0, 2)
    ad = fakes["cpu_exact"]()
    bwd, train = ad.prepare(wl, inputs, "bwd"), ad.prepare(wl, inputs, "train")
    for _ in range(3):  # rotation: set 0, set 1, set 0 again (the retained graph)
        gb, gt = bwd(), train()
        assert len(gb) == 3
        for a, b in zip(gb, gt):
            assert a.abs().sum() > 0 and torch.equal(a, b)
    with pytest.raises(ValueError, match="mode must be one of"):
        ad.prepare(wl, inputs, "inference")


def test_our_rows_name_the_untuned_kernels_they_ran(fakes):
    """A bundle without the dispatch table's choice runs another kernel of the group (the runtime warns once per
    process); the bench re-chooses per row and writes the substitution into the row's note, so a report cannot pass an
    untuned kernel off as the table's. Peers are not ours: their rows get no such note."""
    import warnings

    import flamia_gen.runtime.attention as A

    def substituting(base):
        class Sub(base):
            def build(self, workload):
                f = super().build(workload)

                def g(q, k, v):
                    for rec in A._RECORDERS:  # what runtime.attention._pick records when it falls back
                        rec.append(("attn_fwd_tuned", "attn_fwd_other"))
                    return f(q, k, v)
                return g
        return Sub

    ours, peer = substituting(fakes["flamia_cpu"])(), substituting(fakes["cpu_exact"])()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_bench(_wls()[:1], [ours, peer, fakes["flamia_cpu"]()], mode="fwd", repeats=3, warmup=0,
                        accuracy=False, device="cpu", quiet=True)
    notes = [r.note for r in res.rows]
    assert "untuned (not in the bundle): ran attn_fwd_other for attn_fwd_tuned" in notes[0]
    assert notes[0].count("attn_fwd_other") == 1  # once however many calls ran it
    assert "untuned" not in notes[1] and "untuned" not in notes[2]
    assert A._RECORDERS == []
    from flamia_gen.bench.report import build_table

    _, lines = build_table(res.rows)
    assert any("untuned (not in the bundle): ran attn_fwd_other for attn_fwd_tuned" in ln for ln in lines)
    from flamia_gen.bench.report import _Footnotes

    assert "untuned" in _Footnotes().cell("ok", notes[0]) and "untuned" not in _Footnotes().cell("ok", "only 3 repeats")
