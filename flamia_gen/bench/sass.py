"""SASS of a bundle kernel, on the build machine: the cubin inside an exported `.so`, its resource usage and its
tile loops (instructions, spills, ex2 per loop), so a template change can be checked for spills before any GPU time.
A loop that holds both copies of a tile (interior and masked, one issued per iteration) is also split into its two
paths: a tile's instructions are a path's, not the loop's.

    python -m flamia_gen.bench.sass .dev/bundle-exp/kernels/attn_fwd_..._xwgskip.so [--dump out.sass]
    python -m flamia_gen.bench.sass A.so B.so          # the same table for two builds, side by side
    python -m flamia_gen.bench.sass A.so B.so --ops 20 # and the 20 commonest opcodes of each one's largest tile loop

Needs `nvdisasm` and `cuobjdump` (CUDA 12.8+ for sm_90a): on PATH, in $FLAMIA_GEN_CUDA_BIN, or from the pip wheels
`nvidia-cuda-nvdisasm` and `nvidia-cuda-cuobjdump` (their `nvidia/cu13/bin`). The DSL's `export_to_c` object keeps
the cubin as a plain embedded ELF (not a fatbin section cuobjdump would find), so it is cut out by its ELF headers.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

EM_CUDA = 190
SHT_NOBITS = 8


def extract_cubins(blob: bytes) -> list[bytes]:
    """Every 64-bit little-endian ELF image with e_machine EM_CUDA embedded in `blob` (past offset 0), each cut at the
    end of its last section, section header table or program header table."""
    out, i = [], 1
    while True:
        i = blob.find(b"\x7fELF", i)
        if i < 0:
            return out
        if len(blob) >= i + 64 and blob[i + 4] == 2 and blob[i + 5] == 1 and \
                struct.unpack_from("<H", blob, i + 18)[0] == EM_CUDA:
            e_phoff, e_shoff = struct.unpack_from("<QQ", blob, i + 32)
            e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", blob, i + 54)
            end = max(e_shoff + e_shentsize * e_shnum, e_phoff + e_phentsize * e_phnum)
            for k in range(e_shnum):
                sh = i + e_shoff + k * e_shentsize
                if sh + 40 > len(blob):
                    raise ValueError(f"embedded cubin at byte {i}: section header {k} past the end of the file")
                sh_type = struct.unpack_from("<I", blob, sh + 4)[0]
                off, size = struct.unpack_from("<QQ", blob, sh + 24)
                if sh_type != SHT_NOBITS:
                    end = max(end, off + size)
            if i + end > len(blob):
                raise ValueError(f"embedded cubin at byte {i}: {end} bytes, past the end of the file")
            out.append(blob[i:i + end])
            i += end
        else:
            i += 4


_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/")  # addresses past 0xffff have five or more digits
_LABEL = re.compile(r"^\.(L_x_\d+):")
_BACK = re.compile(r"BRA[^`]*`\(\.(L_x_\d+)\)")


def tile_loops(sass: str, mma: str = "GMMA") -> list[dict]:
    """The loops of an `nvdisasm -c` listing that hold `mma` instructions (a back edge: BRA to an earlier label),
    innermost first in program order: instructions, wgmma count, spill stores/loads, MUFU.EX2, barriers."""
    lines = sass.splitlines()
    labels = {}
    for n, ln in enumerate(lines):
        m = _LABEL.match(ln.strip())
        if m:
            labels[m.group(1)] = n
    loops = []
    for n, ln in enumerate(lines):
        m = _BACK.search(ln)
        if not m or m.group(1) not in labels or labels[m.group(1)] >= n:
            continue
        region = lines[labels[m.group(1)]:n + 1]
        body = [x for x in region if _INSTR.search(x)]
        g = sum(mma in x for x in body)
        if g:
            loops.append(dict(label=m.group(1), start=labels[m.group(1)], end=n, instructions=len(body), wgmma=g,
                              stl=sum("STL" in x for x in body), ldl=sum("LDL" in x for x in body),
                              ex2=sum("MUFU.EX2" in x for x in body), bar=sum(" BAR." in x for x in body),
                              waited=waited_wgmma(body, mma), ops=opcode_counts(body),
                              paths=loop_paths(region, mma)))
    # innermost: a loop that contains no other listed loop
    inner = [lp for lp in loops if not any(o is not lp and lp["start"] <= o["start"] and o["end"] <= lp["end"]
                                           for o in loops)]
    return sorted(inner, key=lambda lp: lp["start"])


_UNCOND_BRA = re.compile(r"\*/\s+BRA `\(\.(L_x_\d+)\)")


def loop_paths(region: list[str], mma: str = "GMMA") -> list[dict] | None:
    """The two ways through a loop body that holds two copies of a tile (the template's `one_tile` called for interior
    and for masked tiles): head, then either copy 1 and an unconditional BRA over copy 2 to the tail, or a branch from
    the head to copy 2, which falls through to the tail. One iteration issues one path, so a tile's instructions are
    a path's, not the loop's (the loop holds both copies). → [path 1, path 2] (instructions, wgmma, STL, LDL, FMUL,
    and the opcode counts), or None for a loop without that shape."""
    idx, lab = [], {}
    for ln in region:
        m = _LABEL.match(ln.strip())
        if m:
            lab[m.group(1)] = len(idx)  # the instruction index the label stands before
        elif _INSTR.search(ln):
            idx.append(ln)
    for b, ln in enumerate(idx):
        m = _UNCOND_BRA.search(ln)
        if not m or lab.get(m.group(1), -1) <= b:
            continue
        tail, c2 = lab[m.group(1)], b + 1
        # copy 2 starts at a label right after the BRA; the head is what precedes the branch that jumps there
        names = [k for k, v in lab.items() if v == c2]
        heads = [i for i, x in enumerate(idx[:b]) if any(f"`(.{k})" in x for k in names)]
        if not heads:
            return None
        h = heads[0]
        p1 = idx[:b + 1] + idx[tail:]
        p2 = idx[:h + 1] + idx[c2:]
        return [dict(instructions=len(p), wgmma=sum(mma in x for x in p), stl=sum("STL" in x for x in p),
                     ldl=sum("LDL" in x for x in p), fmul=sum(" FMUL " in x for x in p), ops=opcode_counts(p))
                for p in (p1, p2)]
    return None


_OPCODE = re.compile(r"\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def opcode_counts(body: list[str]) -> dict[str, int]:
    """Instructions per opcode (its first dot-separated part: FMUL, LDS, QGMMA, …; a guard predicate is skipped)."""
    return dict(Counter(m.group(1) for m in map(_OPCODE.search, body) if m))


def waited_wgmma(body: list[str], mma: str = "GMMA") -> int:
    """How many `mma` instructions of `body` are waited for (WARPGROUP.DEPBAR) before the next one issues. A kernel
    waits once per product or group of products (Sᵀ and dPᵀ: one wait for 8 k-steps); when ptxas serialises the
    wgmmas (C7512: registers an in-flight wgmma owns are touched, or the consumers ran out of them) every one is
    waited for, a silent 2× on the tensor cores that only the SASS shows (`serialised`)."""
    waited, pending = 0, False
    for x in body:
        if mma in x:
            pending = True
        elif "WARPGROUP.DEPBAR" in x and pending:
            waited, pending = waited + 1, False
    return waited


def serialised(loop: dict) -> bool:
    """A tile loop whose wgmmas are (mostly) waited for one by one: ptxas serialised them."""
    return loop["wgmma"] >= 4 and 2 * loop["waited"] > loop["wgmma"]


def missing_tools() -> str | None:
    """Why the SASS cannot be read on this host (no nvdisasm or cuobjdump), or None when it can."""
    try:
        _tool("nvdisasm"), _tool("cuobjdump")
    except SystemExit as e:
        return str(e)
    return None


def _tool(name: str) -> str:
    for d in (os.environ.get("FLAMIA_GEN_CUDA_BIN"),):
        if d and (Path(d) / name).exists():
            return str(Path(d) / name)
    found = shutil.which(name)
    if found:
        return found
    try:  # the pip wheels nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump
        import nvidia  # noqa: F401

        for base in nvidia.__path__:
            for p in Path(base).glob(f"cu*/bin/{name}"):
                return str(p)
    except ImportError:
        pass
    raise SystemExit(f"{name} not found: put it on PATH, set FLAMIA_GEN_CUDA_BIN, or pip install nvidia-cuda-{name}")


def is_cubin(blob: bytes) -> bool:
    """`blob` is itself a CUDA ELF (a `.cubin`, e.g. one a peer's DSL build kept with `CUTE_DSL_KEEP=cubin`)."""
    return len(blob) >= 64 and blob[:4] == b"\x7fELF" and struct.unpack_from("<H", blob, 18)[0] == EM_CUDA


def _listings(so: str) -> tuple[str, str]:
    """(cuobjdump -res-usage, nvdisasm -c) of the (single) cubin in `so` (a bundle `.so`, the build's `.o`, or a
    `.cubin`)."""
    blob = Path(so).read_bytes()
    cubins = [blob] if is_cubin(blob) else extract_cubins(blob)
    if not cubins:
        raise SystemExit(f"{so}: no embedded sm_XX cubin found")
    with tempfile.TemporaryDirectory() as td:
        cub = Path(td) / "k.cubin"
        cub.write_bytes(cubins[0])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cub)], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(cub)], capture_output=True, text=True).stdout
    return res, sass


def describe(so: str, dump: str | None = None) -> dict:
    """{resources, loops} of the kernel cubin in `so` (a bundle `.so`, the build's `.o`, or a `.cubin`). A module
    may hold a small second kernel (a backward's `bwd_dq_convert` launch): REG and STACK are the largest
    function's (the attention kernel's), `functions` counts them."""
    res, sass = _listings(so)
    if dump:
        Path(dump).write_text(sass)
    usages = [(int(r), int(st)) for r, st in re.findall(r"REG:(\d+) STACK:(\d+)", res)]
    reg, stack = max(usages) if usages else (None, None)
    return dict(reg=reg, stack=stack, functions=len(usages),
                loops=tile_loops(sass), instructions=sum(1 for x in sass.splitlines() if _INSTR.search(x)))


def function_sass(so: str, contains: str) -> list[str]:
    """The instruction lines of the one function of `so` whose name contains `contains` (e.g. "dq_convert")."""
    _, sass = _listings(so)
    heads = [(m.start(), m.group(1)) for m in re.finditer(r"^\s*\.text\.(\S+):", sass, re.M)]
    hits = [(i, n) for i, (_, n) in enumerate(heads) if contains in n]
    if len(hits) != 1:
        raise SystemExit(f"{so}: {len(hits)} functions named like {contains!r}: {[n for _, n in heads]}")
    i = hits[0][0]
    body = sass[heads[i][0]:heads[i + 1][0] if i + 1 < len(heads) else len(sass)]
    return [x.strip() for x in body.splitlines() if _INSTR.search(x)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("so", nargs="+", help="bundle kernel .so files (or .cubin files)")
    ap.add_argument("--dump", default=None, help="write the first file's SASS here")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="also the N most frequent opcodes of each file's largest tile loop, one column per file")
    a = ap.parse_args(argv)
    largest = []
    for k, so in enumerate(a.so):
        d = describe(so, a.dump if k == 0 else None)
        print(f"{Path(so).name}: {d['instructions']} instructions, REG {d['reg']}, STACK {d['stack']} B")
        for lp in d["loops"]:
            print(f"  tile loop {lp['label']}: {lp['instructions']} instr, {lp['wgmma']} wgmma "
                  f"({lp['waited']} waited{', SERIALISED' if serialised(lp) else ''}), "
                  f"STL {lp['stl']} / LDL {lp['ldl']}, EX2 {lp['ex2']}, BAR {lp['bar']}")
            if lp.get("paths"):  # two copies of the tile: an iteration issues one of them
                print("    paths (one a tile): " + " | ".join(
                    f"{p['instructions']} instr, {p['wgmma']} wgmma, FMUL {p['fmul']}, STL {p['stl']} / LDL {p['ldl']}"
                    for p in lp["paths"]))
        largest.append(max(d["loops"], key=lambda lp: lp["instructions"])["ops"] if d["loops"] else {})
    if a.ops:
        print(ops_table(largest, a.ops))
    return 0


def ops_table(counts: list[dict[str, int]], n: int) -> str:
    """The `n` opcodes most frequent over all `counts` (one dict per build), one row each, a column per build."""
    total = sum((Counter(c) for c in counts), Counter())
    top = sorted(total, key=lambda op: (-total[op], op))[:n]
    rows = ["opcode      " + "".join(f"{'#' + str(i + 1):>8}" for i in range(len(counts)))]
    rows += [f"{op:<12}" + "".join(f"{c.get(op, 0):>8}" for c in counts) for op in top]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
