"""The op's path to a `bwd_dk_bf16` backward (CPU only, stand-in kernels): dK takes Q̂, which the call builds from the
Q codes and the scale codes, so the op's Q launch skips its Qᵀ codes (`skip_transposed`) and the kernel gets no
`q_t` but a `q_hat` workspace of T_PAD rows. The template side: tests/kernels/test_attn_bwd_dk_bf16.py."""

from __future__ import annotations

from pathlib import Path

import torch

from flamia_gen.render.render import render_with_flags, rendered_literals
from flamia_gen.runtime.quant import TRANSPOSED_STUB

try:  # `python -m pytest` from the repository root: tests/ is a namespace package
    from tests.runtime import bwd_standins as bs
except ImportError:  # plain `pytest` (rootdir not on sys.path): load the sibling module by path
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_flamia_bwd_standins", Path(__file__).with_name("bwd_standins.py"))
    bs = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(bs)


def _bundle(tmp_path, monkeypatch, flagged: bool):
    v = bs.plan_bwd("fp8_token", True)
    lit = rendered_literals(render_with_flags(v, bwd_dk_bf16=flagged), ("PARAMS", "ARGS"))
    variants = [bs.quant_entry(bs.TOK, ["fp8_token.k", "fp8_token.q", "fp8_token.v"]),
                bs.quant_entry(bs.TOK_DELTA, ["fp8_token.do"]),
                bs.manifest_entry(v.name, "attn_bwd", ["fp8_token"], lit["PARAMS"], lit["ARGS"])]
    b, launches = bs.standin_bundle(tmp_path, monkeypatch, "bundle_qhat", variants, bs.fill_by_launch)
    return b, launches, v.name


def test_q_launch_skips_q_t_for_a_q_hat_variant(tmp_path, monkeypatch):
    b, launches, name = _bundle(tmp_path, monkeypatch, True)
    inputs, _ = bs.run_backward(b, name)
    kern = launches[-1][1]
    assert "q_t" not in kern and kern["q_hat"].dtype == torch.bfloat16
    T = inputs["q"].shape[0]
    assert kern["q_hat"].shape == inputs["q"].shape
    assert kern["q_hat"].untyped_storage().nbytes() == (-(-T // 16) * 16) * bs.HQ * bs.D * 2
    src = bs.arg_sources(launches, inputs)
    assert src["q"] == (bs.TOK, "q", "codes") and src["q_scale"] is not None
    q_launch = next(by for n, by in launches[:-1] if by["x"] is inputs["q"])
    assert q_launch["codes_t"].shape[2] == TRANSPOSED_STUB  # no Qᵀ codes written
    k_launch = next(by for n, by in launches[:-1] if by["x"] is inputs["k"])
    assert k_launch["codes_t"].shape[2] != TRANSPOSED_STUB and src["k_t"] == (bs.TOK, "k", "codes_t")


def test_the_default_variant_still_takes_q_t(tmp_path, monkeypatch):
    b, launches, name = _bundle(tmp_path, monkeypatch, False)
    inputs, _ = bs.run_backward(b, name)
    kern = launches[-1][1]
    assert "q_hat" not in kern and bs.arg_sources(launches, inputs)["q_t"] == (bs.TOK, "q", "codes_t")
