"""The backward's ablations (docs/kernels/attn_bwd.md "Ablations: what the dQ reduce-adds and dK's scale chain cost";
templates/sm90/attn_bwd.py.j2): timing probes, never product kernels.

`bwd_ablate_dq_reduce`: the dQ writer warps keep their barriers with the consumers but issue no bulk reduce-adds, so
dQ stays zero. CPU: off in every default render; on, the writer's loop keeps its DQ_FULL wait, its bulk-group commit
and wait and its DQ_EMPTY arrive, and loses every reduce-add and nothing else; refused without a writer warp
(deterministic and tensor-scaled tiles).

`bwd_ablate_dk_quant`: dK's E4M3 codes are cut from dS' as it is (no y, no row amax, no running exponent, no rescale):
dK is wrong. CPU: off by default; on, that block is the only change; refused where the tile's dK has another scale
(32×32 blocks, tensor scales, BF16 or E5M2 dS).
"""

from __future__ import annotations

import difflib

import jinja2
import pytest
from kernel_source import method_source

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
WRITER = [v for v in BWD if v.route in ("fp8_token", "bf16") and v.param("head_dim") == 128
          and not dict(v.params).get("deterministic")]


def test_off_by_default():
    for v in BWD:
        src = render_variant(v)
        for flag in ("bwd_ablate_dq_reduce", "bwd_ablate_dk_quant"):
            assert flag not in src, (v.name, flag)


@pytest.mark.parametrize("v", WRITER, ids=lambda v: v.name)
def test_writer_loses_only_the_reduce_adds(v):
    base, abl = render_variant(v), render_with_flags(v, bwd_ablate_dq_reduce=True)
    assert rendered_params(abl)["bwd_ablate_dq_reduce"] is True
    wb, wa = method_source(base, "dq_writer"), method_source(abl, "dq_writer")
    assert wb.count("bulk_reduce_add_f32(") >= 1 and wa.count("bulk_reduce_add_f32(") == 0
    for keep in ("barrier(barrier_id=DQ_FULL_BAR", "cp_async_bulk_commit_group()", "cp_async_bulk_wait_group(0, read=True)",
                 "barrier_arrive(barrier_id=DQ_EMPTY_BAR"):
        assert wa.count(keep) == wb.count(keep) >= 1, keep
    # outside the writer: only the PARAMS line
    rest = [ln for ln in difflib.unified_diff(base.replace(wb, "").splitlines(), abl.replace(wa, "").splitlines(),
                                              lineterm="", n=0) if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert rest == ['+    "bwd_ablate_dq_reduce": True,']


def test_refused_without_a_writer_warp():
    det = next(v for v in BWD if v.route == "fp8_token" and dict(v.params).get("deterministic"))
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_ablate_dq_reduce_needs_the_dq_writer_warp"):
        render_with_flags(det, bwd_ablate_dq_reduce=True)


FP8_TOKEN = [v for v in WRITER if v.route == "fp8_token"]


@pytest.mark.parametrize("v", FP8_TOKEN, ids=lambda v: v.name)
def test_dk_ablation_loses_only_the_dk_scale_chain(v):
    base, abl = render_variant(v), render_with_flags(v, bwd_ablate_dk_quant=True)
    assert rendered_params(abl)["bwd_ablate_dk_quant"] is True
    gone = [ln[1:] for ln in difflib.unified_diff(base.splitlines(), abl.splitlines(), lineterm="", n=0)
            if ln[:1] == "-" and ln[:3] != "---"]
    came = [ln[1:].strip() for ln in difflib.unified_diff(base.splitlines(), abl.splitlines(), lineterm="", n=0)
            if ln[:1] == "+" and ln[:3] != "+++"]
    assert came == ['"bwd_ablate_dk_quant": True,', "# bwd_ablate_dk_quant: dK's codes straight from dS' (a timing probe; dK wrong)",
                    "acc_S[i] = acc_dP[i]"]
    text = "\n".join(gone)
    for step in ("quad_max_nan(mx[rh])", "acc_dK[i] = acc_dK[i] * f", "y = acc_dP[i] * qf[cp]",
                 "acc_S[i] = acc_S[i] * inv[(i // 2) % 2]"):
        assert step in text, step
    # dK's wgmma and its conversion stay
    assert abl.count("self.convert_p(acc_S, tdKrdS)") == base.count("self.convert_p(acc_S, tdKrdS)") >= 1


def test_dk_ablation_refused_elsewhere():
    for route in ("bf16", "mxfp8", "fp8_tensor", "fp8_pv"):
        v = next(x for x in BWD if x.route == route)
        with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_ablate_dk_quant_is_built_for"):
            render_with_flags(v, bwd_ablate_dk_quant=True)
