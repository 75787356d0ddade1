"""fp32 reference (O and dQ over packed documents) and the cosine metric."""

import math

import pytest
import torch

from flamia_gen.bench.accuracy import cosine, reference_o_dq, rel_error, run_accuracy
from flamia_gen.bench.workloads import get_workload


def _autograd_reference(q, k, v, d_out, doc_lens, causal):
    """Naive fp64 attention per document, dQ by autograd."""
    q = q.double().requires_grad_(True)
    outs, s = [], 0
    for n in doc_lens:
        qd, kd, vd = (t[s:s + n].transpose(0, 1) for t in (q, k.double(), v.double()))
        sc = qd @ kd.transpose(1, 2) / math.sqrt(q.shape[-1])
        if causal:
            sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((sc.softmax(-1) @ vd).transpose(0, 1))
        s += n
    o = torch.cat(outs, 0)
    (dq,) = torch.autograd.grad(o, q, d_out.double())
    return o.detach(), dq


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_autograd_with_chunking(causal):
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9, 3]
    q, k, v, do = (torch.randn(sum(lens), 2, 8, generator=g) for _ in range(4))
    # chunk_bytes small enough that a 9-token document is split into row chunks
    o, dq = reference_o_dq(q, k, v, do, lens, causal=causal, chunk_bytes=16 * 2 * 9 * 2)
    o_ref, dq_ref = _autograd_reference(q, k, v, do, lens, causal)
    assert o.dtype == torch.float32 and o.shape == q.shape
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq.double(), dq_ref, atol=1e-5, rtol=1e-5)


def test_reference_is_document_local():
    g = torch.Generator().manual_seed(1)
    lens = [4, 4]
    q, k, v, do = (torch.randn(8, 1, 4, generator=g) for _ in range(4))
    o1, dq1 = reference_o_dq(q, k, v, do, lens)
    k2, v2 = k.clone(), v.clone()
    k2[4:] *= 100  # change only the second document
    v2[4:] *= 100
    o2, dq2 = reference_o_dq(q, k2, v2, do, lens)
    assert torch.equal(o1[:4], o2[:4]) and torch.equal(dq1[:4], dq2[:4])
    assert not torch.allclose(o1[4:], o2[4:])


def test_cosine_and_rel_error():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert cosine(a, a) == pytest.approx(1.0)
    assert cosine(a, -a) == pytest.approx(-1.0)
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 5.0])) == pytest.approx(0.0)
    assert cosine(torch.tensor([3.0, 4.0]), torch.tensor([4.0, 3.0])) == pytest.approx(24 / 25)
    assert cosine(torch.zeros(3), torch.zeros(3)) == 1.0
    assert cosine(torch.zeros(3), a) == 0.0
    assert rel_error(a * 1.1, a) == pytest.approx(0.1)
    assert rel_error(torch.zeros(2), torch.zeros(2)) == 0.0
    with pytest.raises(ValueError):
        cosine(torch.ones(2), torch.ones(3))


def test_run_accuracy_on_cpu(fakes):
    wl = get_workload("skew40+3x8", heads=2, head_dim=16)
    adapters = [fakes[n]() for n in ("cpu_exact", "cpu_wrong", "cpu_nobwd", "cpu_missing",
                                     "cpu_eqonly")]
    res = {r.impl: r for r in run_accuracy(adapters, wl, device="cpu", seed=0)}
    exact = res["cpu_exact"]
    assert exact.status == "ok"
    assert exact.o_cos > 0.9999 and exact.dq_cos > 0.999  # bf16 output rounding only
    assert exact.o_rel < 1e-2
    wrong = res["cpu_wrong"]
    assert wrong.status == "ok" and wrong.o_cos < 0.9
    nobwd = res["cpu_nobwd"]
    assert nobwd.o_cos > 0.9999 and nobwd.dq_cos is None and nobwd.note.startswith("no dQ")
    assert res["cpu_missing"].status == "not installed"
    assert res["cpu_eqonly"].status == "skipped"
    assert exact.reference in ("flamia_gen.numerics.reference.attention",
                               "flamia_gen.bench.accuracy.reference_o_dq (fp32)")


def test_reference_agrees_with_numerics_package_when_present():
    from flamia_gen.bench.accuracy import reference

    wl = get_workload("skew9+2x4", heads=2, head_dim=8)
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(wl.total_tokens, 2, 8, generator=g).to(torch.bfloat16)
                   for _ in range(4))
    o, dq, which = reference(q, k, v, do, wl)
    o_own, dq_own = reference_o_dq(q, k, v, do, wl.doc_lens)
    assert which  # names the reference that ran
    torch.testing.assert_close(o.float(), o_own, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq.float(), dq_own, atol=1e-5, rtol=1e-5)
