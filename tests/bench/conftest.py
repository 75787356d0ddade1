"""CPU stand-ins for attention implementations, so the harness runs without a GPU."""

import time

import pytest
import torch
import torch.nn.functional as F

from flamia_gen.bench.adapter import Adapter, PeerSkip


def packed_sdpa(q, k, v, doc_lens, causal=True):
    """Exact packed attention through torch's CPU SDPA, one document at a time."""
    outs, s = [], 0
    for n in doc_lens:
        x = [t[s:s + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*x, is_causal=causal)[0].transpose(0, 1))
        s += n
    return torch.cat(outs, 0)


class CpuExact(Adapter):
    """A correct peer: fp32 math on the bf16 inputs."""

    name = "cpu_exact"
    precision = "bf16"
    memory_note = "test"
    delay_s = 0.0

    def available(self):
        return True, ""

    def build(self, workload):
        def f(q, k, v):
            if self.delay_s:
                time.sleep(self.delay_s)
            o = packed_sdpa(q.float(), k.float(), v.float(), workload.doc_lens, workload.causal)
            return o.to(q.dtype)
        return f


class CpuSlow(CpuExact):
    name = "cpu_slow"
    delay_s = 0.004


class CpuOurs(CpuExact):
    name = "flamia_cpu"
    precision = "fp8"
    is_peer = False


class CpuWrong(CpuExact):
    """Returns V: fast and wrong (the accuracy columns must catch it)."""

    name = "cpu_wrong"

    def build(self, workload):
        return lambda q, k, v: v * 1.0


class CpuNoBackward(CpuExact):
    name = "cpu_nobwd"

    def build(self, workload):
        f = super().build(workload)
        return lambda q, k, v: f(q.detach(), k.detach(), v.detach())


class CpuSkips(CpuExact):
    name = "cpu_skips"

    def prepare(self, workload, inputs, mode):
        raise PeerSkip("graph has no engine: demo")


class CpuRaises(CpuExact):
    name = "cpu_raises"

    def prepare(self, workload, inputs, mode):
        raise RuntimeError("kernel exploded\nsecond line")


class CpuMissing(CpuExact):
    name = "cpu_missing"

    def available(self):
        return False, "not installed: cpu_missing_pkg (No module named 'cpu_missing_pkg')"


class CpuUnequalOnly(CpuExact):
    name = "cpu_eqonly"

    def supports(self, workload):
        return (True, "") if workload.equal_docs else (False, "needs equal documents (padding would waste memory)")


@pytest.fixture
def fakes():
    return {c.name: c for c in (CpuExact, CpuSlow, CpuOurs, CpuWrong, CpuNoBackward, CpuSkips,
                                CpuRaises, CpuMissing, CpuUnequalOnly)}
