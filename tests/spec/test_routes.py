from pathlib import Path

import pytest
import yaml

from flamia_gen.spec import Granularity, SpecError, get_route, load_route, load_specs
from flamia_gen.spec.loader import load_family

REPO = Path(__file__).resolve().parents[2]
SHIPPED = {"bf16", "fp8_tensor", "fp8_token", "mxfp8", "mxfp8_exact", "nvfp4_mixed"}


def test_shipped_routes_load():
    s = load_specs(REPO / "specs")
    assert SHIPPED <= set(s.routes)
    assert s.routes["mxfp8"].operands.v.granularity is Granularity.token_block
    assert s.routes["fp8_token"].exact and not s.routes["fp8_tensor"].exact
    assert s.routes["nvfp4_mixed"].operands.q.format.value == "e2m1"
    assert {f.arch.value for f in s.families.values()} == {"sm90", "sm100"}


def test_spec_hash_ignores_comments_and_order(tmp_path):
    src = (REPO / "specs/routes/mxfp8.yaml").read_text()
    data = yaml.safe_load(src)
    p = tmp_path / "mxfp8.yaml"
    p.write_text("# a comment\n" + yaml.safe_dump(dict(reversed(list(data.items())))))
    assert load_route(p).spec_hash() == get_route("mxfp8").spec_hash()
    data["operands"]["q"]["exponent_rule"] = "floor"
    p.write_text(yaml.safe_dump(data))
    assert load_route(p).spec_hash() != get_route("mxfp8").spec_hash()


def _write(tmp_path, name, data):
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _mxfp8():
    return yaml.safe_load((REPO / "specs/routes/mxfp8.yaml").read_text())


def test_misspelled_field_names_file_field_and_allowed(tmp_path):
    d = _mxfp8()
    d["operands"]["q"]["granularty"] = d["operands"]["q"].pop("granularity")
    with pytest.raises(SpecError) as e:
        load_route(_write(tmp_path, "mxfp8", d))
    msg = str(e.value)
    assert "mxfp8.yaml" in msg and "operands.q.granularty" in msg and "not a known field" in msg
    assert "granularity" in msg  # the allowed fields are listed


def test_bad_enum_value_lists_allowed_values(tmp_path):
    d = _mxfp8()
    d["operands"]["k"]["format"] = "e4m4"
    with pytest.raises(SpecError) as e:
        load_route(_write(tmp_path, "mxfp8", d))
    msg = str(e.value)
    assert "operands.k.format" in msg and "'e4m4'" in msg and "e4m3" in msg and "e5m2" in msg


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["operands"]["v"].update(format="e2m1", granularity="nvfp4"), "not allowed for operand 'v'"),
    (lambda d: d["operands"]["q"].update(block=16), "needs block=32"),
    (lambda d: d["operands"]["q"].update(granularity="nvfp4"), "go together"),
    (lambda d: d["operands"]["p"].update(granularity="token"), "not allowed for operand 'p'"),
    (lambda d: d.update(exact=True), "needs k_fold"),
    (lambda d: d["operands"]["q"].update(hadamard=True), "must be equal"),
    (lambda d: d["operands"]["v"].update(hadamard=True), "only defined for q and k"),
    (lambda d: d["operands"]["v"].update(granularity="token"), "diagonal='per_key_v' only applies"),
])
def test_illegal_combinations_are_refused(tmp_path, mutate, needle):
    d = _mxfp8()
    mutate(d)
    with pytest.raises(SpecError) as e:
        load_route(_write(tmp_path, "mxfp8", d))
    assert needle in str(e.value)
    assert "mxfp8.yaml" in str(e.value)


def test_exact_refuses_tensor_scales(tmp_path):
    d = yaml.safe_load((REPO / "specs/routes/fp8_tensor.yaml").read_text())
    d["exact"] = True
    with pytest.raises(SpecError, match="exact=true is impossible"):
        load_route(_write(tmp_path, "fp8_tensor", d))


def test_name_must_match_file(tmp_path):
    with pytest.raises(SpecError, match="must equal the file name"):
        load_route(_write(tmp_path, "other", _mxfp8()))


def test_not_yaml_and_not_mapping(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("a: [1, 2\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_route(p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="mapping"):
        load_route(p)


def test_yaml_is_loaded_safely(tmp_path):
    p = tmp_path / "mxfp8.yaml"
    p.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_route(p)


def test_family_rules(tmp_path):
    routes = load_specs(REPO / "specs").routes
    base = yaml.safe_load((REPO / "specs/kernels/quant_sm90.yaml").read_text())
    bad = dict(base, operand_layouts={"v": "mn_major"})
    with pytest.raises(SpecError, match="impossible on sm90"):
        load_family(_write(tmp_path, "quant_sm90", bad), routes)
    bad = dict(base, routes=["mxfp9"])
    with pytest.raises(SpecError, match="unknown route"):
        load_family(_write(tmp_path, "quant_sm90", bad), routes)
    bad = dict(base, tunables={"tokens_per_cta": [32], "tile_m": [64]})
    with pytest.raises(SpecError, match="tunables.tile_m"):
        load_family(_write(tmp_path, "quant_sm90", bad), routes)
    bad = dict(base, tunables={"tokens_per_cta": [48]})
    with pytest.raises(SpecError, match="tokens_per_cta"):
        load_family(_write(tmp_path, "quant_sm90", bad), routes)
    bad = dict(base, operands=["q", "p"])
    with pytest.raises(SpecError, match="inputs only"):
        load_family(_write(tmp_path, "quant_sm90", bad), routes)
    bad = dict(base, template="sm100/quant.py.j2")
    with pytest.raises(SpecError, match="not under sm90"):
        load_family(_write(tmp_path, "quant_sm90", bad), routes)
