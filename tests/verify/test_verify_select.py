"""`flamia-gen verify --device cuda --kind/--variant`: which bundle kernels a GPU run verifies."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from flamia_gen.cli import main
from flamia_gen.verify.gpu import KINDS, select_names


def _bundle(*names):
    kind = lambda n: "quant" if n.startswith("quant") else n[:8]  # noqa: E731
    return SimpleNamespace(root="/b", manifest={"variants": [{"name": n, "kind": kind(n)} for n in names]})


B = _bundle("quant_sm90_e4m3_tok_ceil_d128_t32_h1", "attn_fwd_sm90_fp8_token_x", "attn_bwd_sm90_fp8_token_y",
            "attn_bwd_sm90_fp8_token_y_det", "attn_bwd_sm90_bf16_z_det_noncausal")


def test_defaults_run_everything():
    assert select_names(B) == (set(KINDS), None)


def test_kinds_and_globs_narrow_the_run():
    run, names = select_names(B, ["attn_bwd"], ["attn_bwd_*_det*"])
    assert run == {"attn_bwd"}
    assert names == {"attn_bwd_sm90_fp8_token_y_det", "attn_bwd_sm90_bf16_z_det_noncausal"}
    assert select_names(B, None, ["quant_*", "*fwd*"])[1] == {"quant_sm90_e4m3_tok_ceil_d128_t32_h1",
                                                              "attn_fwd_sm90_fp8_token_x"}


def test_a_pattern_matching_nothing_is_an_error_not_an_empty_pass():
    with pytest.raises(ValueError, match=re.escape("'attn_bwd_*_nomask' matches no variant")):
        select_names(B, None, ["attn_bwd_*_det*", "attn_bwd_*_nomask"])
    with pytest.raises(ValueError, match="kind 'attn'"):
        select_names(B, ["attn"])


def test_cli_refuses_kind_and_variant_on_cpu():
    r = CliRunner().invoke(main, ["verify", "--device", "cpu", "--kind", "attn_bwd"])
    assert r.exit_code != 0 and "need --device cuda" in r.output
    r = CliRunner().invoke(main, ["verify", "--variant", "attn_*"])
    assert r.exit_code != 0 and "need --device cuda" in r.output
