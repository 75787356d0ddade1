"""`fwd_experiments.compare_to_base`: an experiment copy against its base variant (bitwise, or by cosine and LSE
difference for copies that change numerics on purpose, such as fwd_fused_exp), with the kernels replaced by CPU
stand-ins; and the table's "vs default" column."""

from __future__ import annotations

import math

import pytest
import torch

import flamia_gen.bench.fwd_experiments as fx
import flamia_gen.verify.attn_gpu as attn_gpu

BASE = {"name": "base", "uses": ["bf16"], "params": {"head_dim": 64}}
COPY = {"name": "copy", "uses": ["bf16"], "params": {"head_dim": 64}}


class _Bundle:
    def get(self, name):
        return name


def _patch(monkeypatch, change):
    """run_kernel stand-in: the base returns fixed O / LSE per input; the copy returns change(o, lse)."""
    def make_qkv(docs, hq, hkv, d, kind, gen, device):
        t = sum(docs)
        q = torch.randn(t, hq, d, generator=gen)
        return q, q[:, :hkv], q[:, :hkv], torch.tensor([0] + list(torch.tensor(docs).cumsum(0)), dtype=torch.int32)

    def run_kernel(kernel, entry, route, q, k, v, cu):
        o = q.to(torch.bfloat16)
        lse = q[:, :, 0].t().contiguous().float()
        lse[0, -1] = -math.inf  # an empty row: -inf in both
        return (o, lse) if kernel == "base" else change(o.clone(), lse.clone())

    monkeypatch.setattr(attn_gpu, "make_qkv", make_qkv)
    monkeypatch.setattr(attn_gpu, "run_kernel", run_kernel)


def test_bitwise_copy(monkeypatch):
    _patch(monkeypatch, lambda o, lse: (o, lse))
    r = fx.compare_to_base(_Bundle(), BASE, COPY)
    assert r == {"bitwise": True, "cos_base": pytest.approx(1.0), "lse_max_abs": 0.0}


def test_last_bit_change_is_measured(monkeypatch):
    def change(o, lse):
        o.view(torch.int16)[::7] += 1  # one BF16 ulp on every seventh token
        lse[:, ::5] += 1e-6
        return o, lse

    _patch(monkeypatch, change)
    r = fx.compare_to_base(_Bundle(), BASE, COPY)
    assert r["bitwise"] is False
    assert 0.9999 < r["cos_base"] < 1.0
    assert 5e-7 < r["lse_max_abs"] < 1e-5


def test_nan_or_lost_row_fails_loudly(monkeypatch):
    def nan(o, lse):
        o[3, 0, 0] = float("nan")
        return o, lse

    _patch(monkeypatch, nan)
    r = fx.compare_to_base(_Bundle(), BASE, COPY)
    assert r["bitwise"] is False and math.isnan(r["cos_base"])

    def lost(o, lse):
        lse[0, -1] = 0.0  # an empty row that became finite
        return o, lse

    _patch(monkeypatch, lost)
    r = fx.compare_to_base(_Bundle(), BASE, COPY)
    assert r["bitwise"] is False and r["lse_max_abs"] == math.inf


def test_table_column():
    rows = [dict(variant="v", tag="default", ok=True, cos_emu=0.99999, **{"1x16384": 100.0}),
            dict(variant="v", tag="a", ok=True, cos_emu=0.99999, bitwise=True, **{"1x16384": 110.0}),
            dict(variant="v", tag="b", ok=True, cos_emu=0.99999, bitwise=False, cos_base=0.99999987,
                 lse_max_abs=2e-6, **{"1x16384": 120.0})]
    text = fx.table(rows, ((16384,),))
    assert "vs default" in text.splitlines()[0]
    assert "| bitwise |" in text and "| cos 0.9999999 |" in text and "1.20×" in text
