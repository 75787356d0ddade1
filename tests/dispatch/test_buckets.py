import pytest

from flamia_gen.dispatch.buckets import (LENGTHS, DocProfile, bucket_label, bucket_of, ceil_pow2, fields_of,
                                         floor_pow2, nearest_bucket, parse_bucket_label)


@pytest.mark.parametrize("x,want", [(0, 1), (1, 1), (2, 2), (3, 4), (3000, 4096), (4096, 4096), (4097, 8192),
                                    (131072, 131072), (131073, 131072), (10**7, 131072), (2.5, 4)])
def test_ceil_pow2(x, want):
    assert ceil_pow2(x) == want


@pytest.mark.parametrize("x,want", [(0, 1), (0.5, 1), (1, 1), (1.9, 1), (3, 2), (291.3, 256), (4096, 4096),
                                    (8191.9, 4096), (131072, 131072), (10**7, 131072)])
def test_floor_pow2(x, want):
    assert floor_pow2(x) == want


def test_lengths_are_the_documented_powers_of_two():
    assert LENGTHS[0] == 1 and LENGTHS[-1] == 131072 and len(LENGTHS) == 18


def test_profile_from_cu_seqlens_skips_empty_documents():
    p = DocProfile.from_cu_seqlens([0, 64, 64, 1064, 3064])  # one empty document
    assert (p.tokens, p.num_docs, p.max_len) == (3064, 3, 2000)
    assert p.mean_doc_len == pytest.approx(3064 / 3)


def test_profile_from_tensor():
    torch = pytest.importorskip("torch")
    p = DocProfile.from_cu_seqlens(torch.tensor([0, 10, 30], dtype=torch.int32))
    assert (p.tokens, p.num_docs, p.max_len) == (30, 2, 20)


def test_bad_cu_seqlens():
    with pytest.raises(ValueError, match="non-decreasing"):
        DocProfile.from_cu_seqlens([0, 10, 5])
    with pytest.raises(ValueError, match="at least 2"):
        DocProfile.from_cu_seqlens([0])


def test_each_kind_declares_its_fields():
    assert fields_of("quant") == ("tokens",)
    assert fields_of("attn_fwd") == ("max_len", "doc_len")
    with pytest.raises(ValueError, match="allowed values"):
        fields_of("nope")


def test_quant_buckets_by_total_tokens_ceil():
    p = DocProfile.from_lengths([1000, 2000])  # T = 3000
    assert bucket_of("quant", p) == {"tokens": 4096}


def test_attention_max_len_ceil_doc_len_floor():
    # skewed row of the paper: 8192 + 224 × 256 → mean 291 tokens per document
    p = DocProfile.from_lengths([8192] + [256] * 224)
    assert bucket_of("attn_fwd", p) == {"max_len": 8192, "doc_len": 256}
    assert bucket_of("attn_fwd", DocProfile.from_lengths([3000])) == {"max_len": 4096, "doc_len": 2048}
    assert bucket_of("attn_bwd", DocProfile.from_lengths([1] * 131072)) == {"max_len": 1, "doc_len": 1}


def test_label_order_is_canonical_and_parses_back():
    b = {"doc_len": 256, "max_len": 8192}
    assert bucket_label(b) == "max_len=8192,doc_len=256"
    assert parse_bucket_label(bucket_label(b)) == {"max_len": 8192, "doc_len": 256}
    with pytest.raises(ValueError):
        parse_bucket_label("max_len=3000")


def test_nearest_bucket_log2_distance_ties_to_larger():
    have = [{"tokens": 4096}, {"tokens": 16384}]
    assert nearest_bucket({"tokens": 8192}, have) == {"tokens": 16384}  # tie → larger
    assert nearest_bucket({"tokens": 2048}, have) == {"tokens": 4096}
    assert nearest_bucket({"tokens": 131072}, have) == {"tokens": 16384}
    assert nearest_bucket({"tokens": 1}, []) is None
