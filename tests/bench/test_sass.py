"""flamia_gen.bench.sass on synthetic inputs: the embedded-cubin cut and the tile-loop summary (no CUDA tools needed)."""

from __future__ import annotations

import struct

import pytest

from flamia_gen.bench.sass import extract_cubins, is_cubin, tile_loops


def _elf(machine: int, sections: list[tuple[int, int, int]], payload: int = 96) -> bytes:
    """A 64-bit LE ELF: header, `payload` bytes, then section headers (type, offset, size)."""
    shoff = 64 + payload
    hdr = bytearray(64)
    hdr[0:4] = b"\x7fELF"
    hdr[4], hdr[5], hdr[6] = 2, 1, 1
    struct.pack_into("<HH", hdr, 16, 2, machine)
    struct.pack_into("<QQ", hdr, 32, 0, shoff)  # no program headers
    struct.pack_into("<HHHH", hdr, 54, 56, 0, 64, len(sections))
    body = bytes(range(payload))
    shdrs = b""
    for typ, off, size in sections:
        sh = bytearray(64)
        struct.pack_into("<I", sh, 4, typ)
        struct.pack_into("<QQ", sh, 24, off, size)
        shdrs += bytes(sh)
    return bytes(hdr) + body + shdrs


def test_extract_cubins_cuts_each_embedded_cuda_elf():
    cubin = _elf(190, [(1, 64, 96), (8, 0, 10 ** 6)])  # a NOBITS section never extends the image
    host = _elf(62, [(1, 64, 32)])  # an x86-64 ELF in the blob: not a cubin
    blob = b"\x7fELF" + b"\0" * 60 + b"junk" + cubin + b"tail" + host + cubin[:64] + b"\0" * 8
    with pytest.raises(ValueError, match="past the end"):
        extract_cubins(blob)  # a truncated second cubin is an error, never a silent partial image
    blob = b"\x7fELF" + b"\0" * 60 + b"junk" + cubin + b"tail" + host + cubin
    got = extract_cubins(blob)
    assert got == [cubin, cubin]
    assert extract_cubins(b"no elf here") == []


def test_a_plain_cubin_is_told_from_a_host_object():
    assert is_cubin(_elf(190, [(1, 64, 96)]))
    assert not is_cubin(_elf(62, [(1, 64, 32)]))  # an x86-64 .so / .o: its cubins are embedded, cut them out
    assert not is_cubin(b"\x7fELF")


def test_tile_loops_counts_innermost_loops_with_wgmma():
    sass = "\n".join([
        "        /*0000*/ MOV R1, c[0x0][0x28] ;",
        ".L_x_1:",
        "        /*0010*/ HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;",
        "        /*0020*/ STL [R1+0x4], R0 ;",
        ".L_x_2:",
        "        /*0030*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24 ;",
        "        /*0040*/ MUFU.EX2 R3, R3 ;",
        "        /*0050*/ LDL.LU R0, [R1+0x4] ;",
        "        /*0060*/ BAR.SYNC.DEFER_BLOCKING R5, 0x100 ;",
        "        /*0070*/ @P0 BRA `(.L_x_2) ;",
        "        /*0080*/ @P1 BRA `(.L_x_1) ;",
        ".L_x_3:",
        "        /*0090*/ FADD R2, R2, R3 ;",
        "        /*00a0*/ @P2 BRA `(.L_x_3) ;",
        "        /*00b0*/ EXIT ;",
    ])
    loops = tile_loops(sass)
    assert len(loops) == 1  # L_x_1 holds L_x_2; L_x_3 has no wgmma
    lp = loops[0]
    assert (lp["label"], lp["instructions"], lp["wgmma"], lp["stl"], lp["ldl"], lp["ex2"], lp["bar"]) == \
        ("L_x_2", 5, 1, 0, 1, 1, 1)


def test_tile_loops_past_64_kib_of_code():
    """nvdisasm prints addresses past 0xffff with five digits: those instructions count too (the FP8 backward's
    tile loop lies there; before the fix every large kernel read "4096 instructions" and lost its main loop)."""
    body = [f"        /*{0xfff0 + 16 * k:04x}*/ FMUL R{k}, R{k}, R{k} ;" for k in range(3)]
    sass = "\n".join([".L_x_9:"] + body + [
        "        /*10020*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24 ;",
        "        /*10030*/ @P0 BRA `(.L_x_9) ;",
    ])
    loops = tile_loops(sass)
    assert len(loops) == 1 and loops[0]["instructions"] == 5 and loops[0]["wgmma"] == 1


def _loop(groups: list[int], wait_each: bool) -> str:
    """A tile loop of wgmma groups (k-steps each), waited once per group or after every wgmma (ptxas C7512)."""
    lines, a = [".L_x_5:"], 0
    for g in groups:
        for _ in range(g):
            lines.append(f"        /*{a:04x}*/ QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24 ;")
            a += 16
            if wait_each:
                lines.append(f"        /*{a:04x}*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;")
                a += 16
        if not wait_each:
            lines.append(f"        /*{a:04x}*/ WARPGROUP.DEPBAR.LE gsb0, 0x1 ;")
            a += 16
        lines.append(f"        /*{a:04x}*/ FMUL R2, R2, R3 ;")
        a += 16
    lines.append(f"        /*{a:04x}*/ @P0 BRA `(.L_x_5) ;")
    return "\n".join(lines)


def test_serialised_wgmma_is_told_from_grouped_waits():
    """One wait per product group (8 k-steps of Sᵀ and dPᵀ, 4 of dV and dK, 8 of dQ) is the normal shape; a wait after
    every wgmma is ptxas serialising them (fp8_pv's tile with dK after dQ: 52 of 52 waited)."""
    from flamia_gen.bench.sass import serialised

    ok, bad = tile_loops(_loop([8, 4, 8], False))[0], tile_loops(_loop([8, 4, 8], True))[0]
    assert (ok["wgmma"], ok["waited"], serialised(ok)) == (20, 3, False)
    assert (bad["wgmma"], bad["waited"], serialised(bad)) == (20, 20, True)
    # a wait with no wgmma issued since the last one counts once
    two = tile_loops(_loop([2], False).replace("FMUL R2, R2, R3", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))[0]
    assert two["waited"] == 1 and not serialised(two)


def test_opcode_counts_and_the_side_by_side_table():
    from flamia_gen.bench.sass import ops_table

    lp = tile_loops(_loop([2, 1], False))[0]
    assert lp["ops"] == {"QGMMA": 3, "WARPGROUP": 2, "FMUL": 2, "BRA": 1}  # the guard predicate @P0 is skipped
    t = ops_table([lp["ops"], {"FMUL": 5, "LDS": 1}], 3).splitlines()
    assert t[0].split() == ["opcode", "#1", "#2"]
    assert [r.split() for r in t[1:]] == [["FMUL", "2", "5"], ["QGMMA", "3", "0"], ["WARPGROUP", "2", "0"]]


def test_a_loop_with_two_tile_copies_splits_into_its_two_paths():
    """The template's tile loop holds one_tile twice (interior, masked); an iteration issues one copy: head, then
    copy 1 and a BRA over copy 2 to the tail, or a branch from the head to copy 2. A tile's instructions are a path's
    (the fortieth session read the loop's 1103 as two tiles of 552; the interior path is 415)."""
    a = iter(range(0, 1 << 16, 16))

    def ins(txt):
        return f"        /*{next(a):04x}*/ {txt} ;"
    sass = "\n".join(
        [".L_x_7:", ins("ISETP.GT.AND P2, PT, R6, R17, PT"), ins("@P2 BRA `(.L_x_8)"),  # head: 2
         ins("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ"), ins("FMUL R1, R1, R2"), ins("FMUL R1, R1, R2"),
         ins("LDL R9, [R1+0x4]"), ins("BRA `(.L_x_9)"),  # copy 1: 5
         ".L_x_8:", ins("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ"), ins("ISETP.GE.AND P3, PT, R4, R5, PT"),
         ins("FSEL R3, R3, RZ, !P3"), ins("FMUL R1, R1, R2"), ins("STL [R1+0x4], R0"),
         ins("FSEL R4, R4, RZ, !P3"),  # copy 2: 6
         ".L_x_9:", ins("IADD3 R0, R0, 1, RZ"), ins("@P0 BRA `(.L_x_7)")])  # tail: 2
    lp = tile_loops(sass)[0]
    assert lp["instructions"] == 15
    p1, p2 = lp["paths"]
    assert (p1["instructions"], p1["wgmma"], p1["fmul"], p1["stl"], p1["ldl"]) == (2 + 5 + 2, 1, 2, 0, 1)
    assert (p2["instructions"], p2["wgmma"], p2["fmul"], p2["stl"], p2["ldl"]) == (2 + 6 + 2, 1, 1, 1, 0)
    assert p2["ops"]["FSEL"] == 2 and "FSEL" not in p1["ops"]
    # a loop without the shape has no paths
    assert tile_loops(_loop([8, 4], False))[0]["paths"] is None
