"""flamia_gen.bench.stall_regions on a small hand-made source-page CSV (the ncu column names, three stretches)."""

from __future__ import annotations

import pytest

from flamia_gen.bench import stall_regions as sr

HDR = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"', '"Warp Stall Sampling (Not-issued Samples)"',
       '"Instructions Executed"', '"stall_barrier"', '"stall_short_sb"', '"stall_barrier (Not Issued)"']


def _csv(rows) -> str:
    out = ['"Kernel Name","x"', ",".join(HDR)]
    for addr, src, samples, ex, bar, sb in rows:
        out.append(f'"{addr:#x}","{src}","{samples}","0","{ex}","{bar}","{sb}","0"')
    return "\n".join(out) + "\n"


ROWS = [(0x100, "LDS.128 R8, [R1]", 5, 100, 0, 5),
        (0x110, "FMUL R2, R2, R8", 15, 100, 0, 15),
        (0x120, "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR16], RZ", 1, 100, 0, 0),
        (0x130, "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24", 1, 100, 0, 0),
        (0x140, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 30, 100, 30, 0),
        (0x150, "BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", 2, 100, 2, 0),
        (0x160, "FADD R3, R3, R4", 46, 100, 40, 0)]


def test_regions_group_stretches_between_anchors():
    rows = sr.read_source_csv(_csv(ROWS))
    got = [(g.start - 0x100, g.n, g.samples) for g in sr.regions(rows)]
    # plain run, the two QGMMAs as one GEMM, the wgmma wait, the barrier, the code after it
    assert got == [(0x0, 2, 20), (0x20, 2, 2), (0x40, 1, 30), (0x50, 1, 2), (0x60, 1, 46)]
    rep = sr.report(rows, min_share=10.0)
    lines = rep.splitlines()
    assert lines[0] == "total samples 100"
    assert len(lines) == 4  # 20 %, 30 %, 46 %; the GEMM (2 %) and the barrier (2 %) left out
    assert "short_sb=20.0" in lines[1] and "barrier=30.0" in lines[2] and "barrier=40.0" in lines[3]
    assert " 46.0%" in lines[3]


def test_not_a_source_page_is_a_clear_error():
    with pytest.raises(ValueError, match="not an ncu source-page CSV"):
        sr.read_source_csv("a,b\n1,2\n")
    with pytest.raises(ValueError, match="lacks the column 'Instructions Executed'"):
        sr.read_source_csv('"Address","Source","Warp Stall Sampling (All Samples)"\n"0x1","NOP","1"\n')
