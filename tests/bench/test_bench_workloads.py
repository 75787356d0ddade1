"""Workload generation: names, lengths, cu_seqlens, lognormal mixes, inputs."""

import pytest
import torch

from flamia_gen.bench.workloads import (DEFAULT_WORKLOADS, PAPER_WORKLOADS, default_rotations,
                                        get_workload, lognormal_lengths, make_inputs,
                                        parse_workloads)


@pytest.mark.parametrize("name,num_docs,length,total", [
    ("eq4x4096", 4, 4096, 16384),
    ("eq8x8192", 8, 8192, 65536),
    ("eq1x16384", 1, 16384, 16384),
    ("eq1x65536", 1, 65536, 65536),
    ("tiny131072x1", 131072, 1, 131072),
    ("long131072", 1, 131072, 131072),
])
def test_equal_workloads(name, num_docs, length, total):
    w = get_workload(name)
    assert w.doc_lens == [length] * num_docs
    assert w.total_tokens == total
    assert w.max_seqlen == length
    assert w.num_docs == num_docs
    assert w.equal_docs
    assert (w.heads, w.head_dim, w.causal) == (16, 128, True)


def test_skew_workload():
    w = get_workload("skew8192+224x256")
    assert w.doc_lens[0] == 8192
    assert w.doc_lens[1:] == [256] * 224
    assert w.total_tokens == 8192 + 224 * 256 == 65536
    assert w.max_seqlen == 8192
    assert not w.equal_docs


def test_all_paper_workloads_resolve():
    assert len(PAPER_WORKLOADS) == 7
    names = [w.name for w in parse_workloads("paper")]
    assert names == list(PAPER_WORKLOADS)
    assert [w.name for w in parse_workloads("default")] == list(DEFAULT_WORKLOADS)


def test_cu_seqlens_dtype_and_values():
    w = get_workload("skew8192+224x256")
    cu = w.cu_seqlens()
    assert cu.dtype == torch.int32
    assert cu.shape == (w.num_docs + 1,)
    assert cu[0].item() == 0
    assert cu[1].item() == 8192
    assert cu[2].item() == 8192 + 256
    assert cu[-1].item() == w.total_tokens
    assert torch.all(cu[1:] - cu[:-1] == torch.tensor(w.doc_lens, dtype=torch.int32))


def test_doc_ids():
    w = get_workload("skew3+2x2")
    assert w.doc_ids().tolist() == [0, 0, 0, 1, 1, 2, 2]


def test_lognormal_is_deterministic_and_fills_exactly():
    a = get_workload("lognormal:65536:7")
    b = get_workload("lognormal:65536:7")
    c = get_workload("lognormal:65536:8")
    assert a.doc_lens == b.doc_lens
    assert a.doc_lens != c.doc_lens
    assert sum(a.doc_lens) == 65536 and sum(c.doc_lens) == 65536
    assert all(n >= 1 for n in a.doc_lens)
    assert a.num_docs > 10  # median 1024: a mix, not one document
    # Same draw as the generator function, and a different total is a different fill.
    assert lognormal_lengths(65536, 7) == a.doc_lens
    assert sum(lognormal_lengths(1000, 7)) == 1000
    assert lognormal_lengths(1, 3) == [1]


def test_parse_workloads_list_and_spaces():
    ws = parse_workloads(" eq4x4096 , long131072 ")
    assert [w.name for w in ws] == ["eq4x4096", "long131072"]


@pytest.mark.parametrize("bad", ["eq4x", "foo", "eq0x10", "lognormal:100", "skew1+0x5"])
def test_unknown_workload_error_names_it_and_lists_known(bad):
    with pytest.raises(ValueError) as ei:
        parse_workloads(f"eq4x4096,{bad}")
    msg = str(ei.value)
    assert repr(bad) in msg
    assert "eq8x8192" in msg and "lognormal:<T>:<seed>" in msg


def test_empty_and_huge_workloads_rejected():
    with pytest.raises(ValueError, match="no workload"):
        parse_workloads(" , ")
    with pytest.raises(ValueError, match="tokens"):
        get_workload("eq4096x65536")


def test_make_inputs_shapes_rotations_and_outliers():
    w = get_workload("eq2x16", heads=2, head_dim=8)
    sets = make_inputs(w, torch.bfloat16, "cpu", seed=3, n_rotations=3)
    assert len(sets) == 3
    q, k, v = sets[0]
    assert q.shape == k.shape == v.shape == (32, 2, 8)
    assert q.dtype == torch.bfloat16
    assert not torch.equal(sets[0].q, sets[1].q)  # distinct sets, so L2 cannot hold them
    again = make_inputs(w, torch.bfloat16, "cpu", seed=3, n_rotations=3)
    assert torch.equal(again[2].v, sets[2].v)  # seeded

    out = make_inputs(w, torch.float32, "cpu", seed=3, n_rotations=1, outliers=True, n_outliers=2)
    rows = out[0].outlier_tokens
    assert len(rows) == 2
    plain = make_inputs(w, torch.float32, "cpu", seed=3, n_rotations=1)[0]
    # Outlier rows are the plain rows x100 in q, k and v; every other row is untouched.
    mask = torch.zeros(32, dtype=torch.bool)
    mask[rows] = True
    for t_out, t_plain in zip(out[0], plain):
        assert torch.equal(t_out[mask], t_plain[mask] * 100)
        assert torch.equal(t_out[~mask], t_plain[~mask])


def test_default_rotations_exceed_l2():
    small = get_workload("eq4x4096")  # 16384 tokens: 201 MB of bf16 q,k,v per set
    assert default_rotations(small) == 2
    tiny = get_workload("eq1x1024")  # 12.6 MB per set: needs more sets
    # 3 x 60 MiB / 12.6 MB per set -> 15 sets, capped at 8
    assert default_rotations(tiny) == 8
    mid = get_workload("eq1x8192")  # 100.7 MB per set: 2 sets cover 3 x 60 MiB
    assert default_rotations(mid) == 2
