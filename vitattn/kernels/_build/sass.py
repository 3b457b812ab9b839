"""The machine code of a compiled kernel: its SASS (``nvdisasm``, shipped in the triton wheel), the inner
loops, and what one loop iteration executes per score element.

Finding the loops. ``nvdisasm`` prints one instruction per line with its byte address and names every
branch target with a label (``.L_x_12:``). A branch to a label before the branch's own address is a
*back-edge* (a branch to itself is the padding after the kernel's last ``EXIT``); the instructions from the target to the back-edge are a loop (ptxas lays a loop out as one
contiguous range, the pipelined steady state of a Triton ``for`` included; its prologue and epilogue are
outside the range). A loop that contains no other loop is *innermost*. The kernels' key (or query) loops
are the innermost loops with a tensor-core instruction (``HMMA`` on sm_80, ``HGMMA`` on sm_90); the
Newton ``while`` of entmax-1.5 contains one of them, so it is not innermost, and loops without a
tensor-core instruction (none in these kernels today) are listed apart.

Counting per score element. Each thread executes the loop body once per iteration, and one iteration
handles one ``BLOCK_M x BLOCK_N`` tile of scores, ``BLOCK_M * BLOCK_N / (32 * num_warps)`` elements per
thread. A count per score element is the count in the loop body divided by that. The multiply-adds of
the loop's tensor-core instructions (``HMMA.16816``: 16·8·16 per warp; ``HGMMA.64xNx16``: 64·N·16 per
warpgroup) check the "one tile per iteration" premise: they must equal the dots the source does per
tile (``dots x BLOCK_M x BLOCK_N x D``); the ratio is reported as ``tiles_per_iteration`` and divides the
counts, so an unrolled loop would still be counted per score.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_\w+):")
_TARGET = re.compile(r"`\((\.L_\w+)\)")
_HMMA = re.compile(r"^HMMA\.(16)(8)(16|8|4)\b")
_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\b")
_WIDTH = re.compile(r"\.(8|16|32|64|128|U8|S8|U16|S16)\b")


@dataclass(frozen=True)
class Instr:
    """One SASS instruction: byte address, guard predicate (``@P0``, ``@!P1`` or ``""``), opcode with its
    modifiers (``MUFU.EX2``), operands."""

    addr: int
    pred: str
    opcode: str
    operands: str

    @property
    def base(self) -> str:
        """The opcode without modifiers (``MUFU``)."""
        return self.opcode.split(".")[0]


def tool(name: str) -> str:
    """Path of a CUDA tool shipped in the triton wheel (``nvdisasm``, ``cuobjdump``, ``ptxas``)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name} is not in the triton wheel ({path})")
    return str(path)


def disassemble(cubin: bytes) -> str:
    """``nvdisasm`` of a cubin (every function, code only)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True, check=True)
    return res.stdout


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage`` of a cubin: ``REG`` (registers per thread), ``STACK`` (the per-thread stack
    frame, where ptxas puts spilled registers), ``SHARED`` (static shared bytes), ``LOCAL`` (other local
    memory), ``CONSTANT[0]`` ... as integers."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run(
            [tool("cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True, check=True
        )
    out: dict[str, int] = {}
    for key, value in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", res.stdout):
        out.setdefault(key, int(value))
    return out


def parse(text: str) -> tuple[list[Instr], dict[str, int]]:
    """The instructions of ``nvdisasm -c`` output (in address order) and the address of every label."""
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        body = m.group(2).strip().lstrip("{").strip()
        pred = ""
        if body.startswith("@"):
            pred, _, body = body.partition(" ")
            body = body.strip()
        opcode, _, operands = body.partition(" ")
        for name in pending:
            labels[name] = addr
        pending = []
        instrs.append(Instr(addr, pred, opcode, operands.strip()))
    return instrs, labels


def back_edges(instrs: list[Instr], labels: dict[str, int]) -> list[tuple[int, int]]:
    """``(target, branch)`` addresses of every branch to a label before itself."""
    edges = []
    for ins in instrs:
        if ins.base not in ("BRA", "JMP", "BRX"):
            continue
        target = _TARGET.search(ins.operands)
        # a branch to itself is the padding loop after the final EXIT, not a loop of the kernel
        if target and target.group(1) in labels and labels[target.group(1)] < ins.addr:
            edges.append((labels[target.group(1)], ins.addr))
    return edges


def innermost_loops(instrs: list[Instr], labels: dict[str, int]) -> list[tuple[int, int]]:
    """Address ranges ``[start, end]`` of the loops containing no other loop (back-edges to one header
    make one loop), in address order."""
    by_head: dict[int, int] = {}
    for start, end in back_edges(instrs, labels):
        by_head[start] = max(end, by_head.get(start, end))
    loops = sorted(by_head.items())
    return [
        (s, e) for s, e in loops if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)
    ]


def mma_macs(ins: Instr) -> tuple[int, int]:
    """``(macs, threads)``: the multiply-adds of one tensor-core instruction and the threads that issue
    it together (a warp for ``HMMA``, a warpgroup for ``HGMMA``); ``(0, 0)`` for anything else."""
    m = _HMMA.match(ins.opcode)
    if m:
        return int(m.group(1)) * int(m.group(2)) * int(m.group(3)), 32
    m = _HGMMA.match(ins.opcode)
    if m:
        return int(m.group(1)) * int(m.group(2)) * int(m.group(3)), 128
    return 0, 0


def access_bytes(ins: Instr) -> int:
    """Bytes per thread of a memory instruction from its width modifier (32-bit without one)."""
    widths = [w for w in _WIDTH.findall(ins.opcode)]
    if not widths:
        return 4
    w = widths[-1]
    return {"U8": 1, "S8": 1, "U16": 2, "S16": 2}.get(w, int(w) // 8 if w.isdigit() and int(w) >= 8 else 4)


def classify(instrs: list[Instr]) -> dict[str, int]:
    """Counts of the instruction families the report cares about."""
    c: Counter[str] = Counter()
    for ins in instrs:
        op, base = ins.opcode, ins.base
        c["instructions"] += 1
        if op.startswith("MUFU.EX2"):
            c["ex2"] += 1
        elif base == "MUFU":
            c["mufu_other"] += 1
        if base in ("I2F", "I2FP"):
            c["i2f"] += 1
        elif base in ("F2I", "F2IP"):
            c["f2i"] += 1
        elif base in ("F2F", "F2FP"):
            c["f2f"] += 1
        if base == "HMMA":
            c["hmma"] += 1
        elif base == "HGMMA":
            c["hgmma"] += 1
        if base in ("LDGSTS", "UTMALDG", "UBLKCP"):
            c["async_loads"] += 1
        elif base == "LDG":
            c["global_loads"] += 1
        if base == "LDL":
            c["ldl"] += 1
            c["ldl_bytes"] += access_bytes(ins)
        elif base == "STL":
            c["stl"] += 1
            c["stl_bytes"] += access_bytes(ins)
        if base in ("BAR", "BSYNC", "WARPSYNC"):
            c["barriers"] += 1
        if base == "BRA" and ins.pred:
            c["cond_branches"] += 1
    return dict(c)


@dataclass
class LoopReport:
    """What one iteration of an innermost loop executes (counts per thread) and per score element."""

    start: int
    end: int
    counts: dict[str, int]
    macs: int  # multiply-adds of the CTA per iteration
    tiles_per_iteration: float
    per_score: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": f"0x{self.start:04x}",
            "end": f"0x{self.end:04x}",
            "counts": self.counts,
            "macs": self.macs,
            "tiles_per_iteration": self.tiles_per_iteration,
            "per_score": self.per_score,
        }


def loop_reports(
    text: str, block_m: int, block_n: int, num_warps: int, head_dim: int, dots: list[int]
) -> tuple[list[LoopReport], list[tuple[int, int]]]:
    """Reports of the innermost loops with tensor-core instructions, and the ranges of the other
    innermost loops. ``dots[i]``: the ``BLOCK_M x BLOCK_N x head_dim`` dots the source does per tile in
    the i-th such loop (address order; the last entry repeats if there are more loops)."""
    instrs, labels = parse(text)
    reports: list[LoopReport] = []
    others: list[tuple[int, int]] = []
    elements = block_m * block_n / (32 * num_warps)  # score elements per thread per tile
    for start, end in innermost_loops(instrs, labels):
        body = [i for i in instrs if start <= i.addr <= end]
        macs = 0
        for ins in body:
            per, threads = mma_macs(ins)
            macs += per * (num_warps * 32 // threads) if per else 0
        if not macs:
            others.append((start, end))
            continue
        want = dots[min(len(reports), len(dots) - 1)] * block_m * block_n * head_dim
        tiles = macs / want
        counts = classify(body)
        per_score = {
            key: round(counts.get(key, 0) / (tiles * elements), 4)
            for key in ("ex2", "i2f", "f2i", "mufu_other", "instructions")
        }
        reports.append(LoopReport(start, end, counts, macs, round(tiles, 4), per_score))
    return reports, others
