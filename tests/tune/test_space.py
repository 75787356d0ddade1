import pytest

from flamia_gen.plan import make_plan
from flamia_gen.spec import load_specs
from flamia_gen.tune.space import (StudySpec, make_study_specs, parse_workload, parse_workloads, select_groups,
                                   study_name)


@pytest.fixture(scope="module")
def sm90():
    specs = load_specs()
    return specs, make_plan(specs, arch="sm90")


@pytest.mark.parametrize("text,lens", [("4x4096", [4096] * 4), ("8192+3x256", [8192, 256, 256, 256]),
                                       ("4096", [4096]), (" 2x1 ", [1, 1])])
def test_parse_workload(text, lens):
    w = parse_workload(text)
    assert list(w.doc_lens) == lens and w.heads == 16
    assert w.cu_seqlens()[-1] == sum(lens)


@pytest.mark.parametrize("text", ["4y4096", "0x10", "x5", "", "4x0", "9999999"])
def test_parse_workload_errors(text):
    with pytest.raises(ValueError):
        parse_workload(text)


def test_presets_and_dedup():
    ws = parse_workloads("paper,4x4096")
    assert [w.label for w in ws][:2] == ["4x4096", "8x8192"] and len(ws) == 7


def test_groups_by_route_name_or_tag(sm90):
    specs, plan = sm90
    by_name = select_groups(plan, specs, kinds=["quant"], routes=["mxfp8"])
    assert {g.route for g in by_name} == {"e4m3_tb32_ceil", "e4m3_tb32_ceil_delta"}  # + the dO launch
    by_tag = select_groups(plan, specs, kinds=["quant"], routes=["e4m3_tsr_ceil"], head_dims=[64])
    assert [g.key for g in by_tag] == ["quant/e4m3_tsr_ceil/d64"]
    assert by_tag[0].candidates == ("quant_sm90_e4m3_tsr_ceil_d64_t32_h1",)  # pruned points never offered
    with pytest.raises(ValueError, match="match no variant"):
        select_groups(plan, specs, routes=["nope"])


def test_one_study_per_group_and_bucket(sm90):
    specs, plan = sm90
    groups = select_groups(plan, specs, kinds=["quant"], routes=["e4m3_tb32_ceil"], head_dims=[128])
    studies = make_study_specs(groups, parse_workloads("paper"), gpu="NVIDIA H200", trials=2)
    # quantizer buckets by T: 16384 (4x4096 first), 65536 (8x8192 first), 131072 (1x131072 first)
    assert [(s.bucket["tokens"], s.workload.label) for s in studies] == [
        (16384, "4x4096"), (65536, "8x8192"), (131072, "1x131072")]
    assert all(s.budget == 2 for s in studies)
    s = studies[0]
    assert s.name.startswith("flamia-gen/sm90/h200/quant/e4m3_tb32_ceil/d128/tokens=16384/")
    assert s.name == study_name("sm90", "NVIDIA H200", s.group, s.bucket, s.workload)
    assert StudySpec.from_dict(s.to_dict()) == s
    big = make_study_specs(groups, parse_workloads("4x4096"), gpu="x", trials=99)
    assert big[0].budget == len(groups[0].candidates)
