"""Compile every kernel variant and autotune config ahead of time, for GPUs this machine may not have, and
read their machine code.

Usage: ``python -m vitattn.kernels._build.aot --arch 80 90 [--head-dim 128] [--dtype bf16] [--jobs 2]
[--quick] [--ragged [ARCH ...]] [--all-configs] [--variants PATTERN ...] [--report PATH] [--expect-triton 3.6.0]``;
``python -m vitattn.kernels._build.aot --markdown REPORT`` prints a report's sm_90 table (docs/kernels.md).

A *variant* is normalizer (softmax, entmax15, entmax_alpha) x bias kind (none, gaussian, additive, bool) x pass (fwd,
bwd_dkdv, bwd_dq); each is compiled with every entry of its arch's autotune list
(``configs.AUTOTUNE_BY_ARCH``), at the largest head dim that entry serves (its worst case for registers
and shared memory), via ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``, no GPU
needed, with whole tiles (``EVEN_M = EVEN_N = EVEN_D``: N = 4096, D = 64) and, with ``--ragged``, also
with every bound mask on (ViT lengths such as 197, head dims such as 80). For each build it reads the cubin: registers and local memory
(``cuobjdump -res-usage``), the shared memory (``metadata.shared``), and from the SASS (``nvdisasm``)
the spill traffic (``LDL`` / ``STL`` bytes) and, per inner key loop, the instructions of one iteration
per score element: ``MUFU.EX2``, integer-to-float conversions (``I2F``), asynchronous tile loads
(``LDGSTS`` / TMA), tensor-core instructions (see :mod:`vitattn.kernels._build.sass` for the method).
The backward's two row kernels (the row term, the Gaussian row terms) are compiled too (two extra lines
per arch, not counted as variants).

``--report PATH`` writes the table as JSON (one row per build, see :func:`report_row`) and checks the
goals of :func:`goal_failures` on the pickable sm_90 builds (no spills; in the Gaussian loops at most
2 ``MUFU.EX2`` and no conversion per score; asynchronous loads in the entmax-1.5 loops). The command
exits non-zero if a build fails, exceeds the card's dynamic shared memory per block (sm_80: 163 KiB,
sm_90: 227 KiB), has no tensor-core instruction, or (with ``--report``) misses a goal. The first line names the triton it imported
(``triton 3.6.0 (/path)``; with ``--expect-triton`` another version exits 2), the last is ``compiled N
kernel variants for sm_80, sm_90``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import configs

NORMALIZERS = ("softmax", "entmax15", "entmax_alpha")
BIAS_KINDS = ("none", "gaussian", "additive", "bool")
PASSES = ("fwd", "bwd_dkdv", "bwd_dq")
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
GOAL_ARCH = 90  # the goals hold for every build the autotuner can pick there
MAX_EX2_PER_SCORE = 2.0  # the Gaussian loops: the bias' exp and softmax's own
SOURCES = ("_common.py", "_tiles.py", "softmax.py", "entmax15.py", "entmax_alpha.py", "backward.py", "configs.py")
ROW_PASSES = ("delta", "rows")  # the backward's row kernels: no tiles, no loop, no tensor cores

_FP32_POINTERS = {"STAT", "DELTA", "ROWS", "OG", "DEN", "ALPHA", "DADD", "DDEN", "DALPHA", "ENT", "DENT", "WIN"}
_INT_POINTERS = {"KEEP": "u8", "LIVE": "u8", "LIST": "i32", "CNT": "i32", "WLIST": "i32", "WCNT": "i32"}
_UNIT_STRIDES = {"s_qd", "s_kd", "s_vd"}  # contiguous head dim, as the JIT specializes them
_ALIGNED_INTS = {"head_d", "head_dv", "s_qb", "s_qh", "s_qm", "s_kb", "s_kh", "s_kn", "s_vb", "s_vh", "s_vn"}


@dataclass(frozen=True)
class Build:
    arch: int
    normalizer: str
    bias: str
    pass_: str
    config: configs.TileConfig
    head_dim: int
    dtype: str
    even: bool = True  # whole tiles (EVEN_M, EVEN_N, EVEN_D), else every bound mask on
    pickable: bool = True  # the config is in the arch's autotune list at this head dim
    window: bool = False  # a neighbourhood window (its tile lists and in-tile mask), no dilation

    @property
    def variant(self) -> str:
        return f"{self.normalizer}/{self.bias}/{self.pass_}"

    @property
    def kernel(self) -> str:
        if self.pass_ == "fwd":
            return f"fwd_{self.normalizer}"
        return self.pass_

    @property
    def dots(self) -> list[int]:
        """Per inner loop (in program order): the ``BLOCK_M x BLOCK_N x D`` dots of one tile."""
        if self.pass_ == "fwd":
            return [2] if self.normalizer == "softmax" else [1, 1, 3]  # entmax: max, search, output (+OG)
        return {"bwd_dkdv": [4], "bwd_dq": [3]}.get(self.pass_, [1])


@dataclass
class Result:
    build: Build
    ok: bool = False
    error: str = ""
    shared: int = 0
    registers: int = -1
    local_bytes: int = -1  # the per-thread stack frame plus other local memory
    spill_bytes: int = -1
    tensor_core: str = ""
    loops: list[dict[str, Any]] = field(default_factory=list)
    other_loops: int = 0
    notes: list[str] = field(default_factory=list)


def _flags(build: Build) -> dict[str, object]:
    """The constexpr switches of a variant (``tl.dot`` on bf16/fp16 operands; fp32: the TF32 dots)."""
    flags: dict[str, object] = dict(
        GAUSS=build.bias == "gaussian", HAS_ADD=build.bias == "additive", HAS_KEEP=build.bias == "bool",
        F32_DOT=2 if build.dtype == "fp32" else 0,  # fp32: TF32 dots, the only float32 path "auto" takes
        BLOCK_M=build.config.block_m, BLOCK_N=build.config.block_n,
        BLOCK_D=build.head_dim, BLOCK_DV=build.head_dim,
        WINDOW=build.window, DILATED=build.window,  # --window: every build with a (dilated) window
    )
    if build.pass_ == "delta":
        return {"BLOCK_M": configs.DELTA_ROWS, "BLOCK_DV": build.head_dim}
    if build.pass_ == "rows":
        return {"BLOCK_M": configs.ROW_TERMS_ROWS}
    flags.update(EVEN_M=build.even, EVEN_N=build.even, EVEN_D=build.even)
    if build.pass_ != "fwd":
        flags["ENTMAX"] = {"softmax": 0, "entmax15": 1, "entmax_alpha": 2}[build.normalizer]
    if build.normalizer == "entmax15":  # block sparsity: the live-tile lists (what runs for entmax-1.5)
        flags["SPARSE"] = True
        if build.pass_ == "fwd":
            flags["GRAIN"] = configs.LIVE_GRAIN
    elif build.pass_ in ("bwd_dkdv", "bwd_dq"):
        flags["SPARSE"] = build.window  # a window's lists
    if build.pass_ == "fwd" and build.normalizer != "softmax":
        flags["STORE_OG"] = True  # training: the heavier form
    if build.pass_ == "bwd_dq":
        flags["ADD_GRAD"] = 2 if build.bias == "additive" else 0  # full-tile atomics: the heavier form
        flags["GAUSS_GRAD"] = build.bias == "gaussian"
        flags["ENT_GRAD"] = build.normalizer == "entmax_alpha"  # the alphas' gradient: the heavier form
        flags["DADD_BCAST_M"] = flags["DADD_BCAST_N"] = False
    return flags


def _source(fn, dtype: str, constexprs: dict[str, object]):
    import triton

    signature: dict[str, str] = {}
    attrs = {}
    for i, p in enumerate(fn.params):
        name = p.name
        if p.is_constexpr or name in _UNIT_STRIDES:
            signature[name] = "constexpr"
            if name in _UNIT_STRIDES:
                constexprs[name] = 1
            continue
        if name.isupper():
            kind = _INT_POINTERS.get(name) or ("fp32" if name in _FP32_POINTERS else dtype)
            signature[name] = f"*{kind}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "clamp", "d_r", "d_c"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in _ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [k for k, v in signature.items() if v == "constexpr" and k not in constexprs]
    if missing:
        raise ValueError(f"no value for constexpr {missing} of {fn.__name__}")
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def compile_one(build: Build) -> Result:
    """Compile one build and read its machine code (runs in a worker process)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ..ops import kernels
    from . import sass

    res = Result(build)
    try:
        fn = kernels()[{"delta": "bwd_delta", "rows": "bwd_rows"}.get(build.pass_, build.kernel)]
        src = _source(fn, build.dtype, _flags(build))
        compiled = triton.compile(
            src, target=GPUTarget("cuda", build.arch, 32),
            options={"num_warps": build.config.num_warps, "num_stages": build.config.num_stages},
        )
        cubin = compiled.asm["cubin"]
        res.shared = int(compiled.metadata.shared)
        usage = sass.resource_usage(cubin)
        res.registers = usage.get("REG", -1)
        res.local_bytes = usage.get("STACK", 0) + usage.get("LOCAL", 0)  # spilled registers live on the stack
        text = sass.disassemble(cubin)
        instrs, _ = sass.parse(text)
        whole = sass.classify(instrs)
        res.spill_bytes = whole.get("stl_bytes", 0) + whole.get("ldl_bytes", 0)
        n_mma, n_wgmma = whole.get("hmma", 0), whole.get("hgmma", 0)
        res.tensor_core = ", ".join(
            s for s in (f"HGMMA x{n_wgmma}" if n_wgmma else "", f"HMMA x{n_mma}" if n_mma else "") if s
        ) or "none"
        if build.pass_ not in ROW_PASSES:
            cfg = build.config
            reports, others = sass.loop_reports(
                text, cfg.block_m, cfg.block_n, cfg.num_warps, build.head_dim, build.dots
            )
            res.loops = [r.to_dict() for r in reports]
            res.other_loops = len(others)
        res.ok = True
        limit = SMEM_LIMIT.get(build.arch)
        if limit is not None and res.shared > limit:
            res.ok = False
            res.notes.append(f"shared memory {res.shared} B > {limit} B")
        if build.pass_ not in ROW_PASSES and res.tensor_core == "none":
            res.ok = False
            res.notes.append("no tensor-core instruction in the SASS")
        if build.pass_ not in ROW_PASSES and len(res.loops) != len(build.dots):
            res.notes.append(f"{len(res.loops)} inner loops with tensor-core instructions, {len(build.dots)} "
                             "expected")
    except Exception as exc:  # report every failure, keep going
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return res


def plan(
    archs: Iterable[int], head_dim: int, dtype: str, quick: bool = False, ragged: Iterable[int] = (),
    all_configs: bool = False, variants: Iterable[str] = (), window: bool = False,
) -> list[Build]:
    """Every (arch, variant, config) at ``min(head_dim, config's limit)``: the arch's own autotune list
    (``pickable``), and with ``all_configs`` the other archs' entries too (not pickable there); ``quick``
    keeps the first config of each kernel only; ``ragged`` (archs) adds each build with every bound mask
    on (``EVEN_M = EVEN_N = EVEN_D = False``, at the head dims the configs serve then);
    ``variants`` (``fnmatch`` patterns of ``normalizer/bias/pass``) keeps the matching variants only."""
    import fnmatch

    patterns = list(variants)
    ragged = set(ragged)
    builds = []
    fp32 = dtype == "fp32"
    for arch in archs:
        own = configs.AUTOTUNE_BY_ARCH[configs.arch_of(arch)]
        for normalizer in NORMALIZERS:
            for bias in BIAS_KINDS:
                masked = bias in ("additive", "bool")
                for pass_ in PASSES:
                    name = f"{normalizer}/{bias}/{pass_}"
                    if patterns and not any(fnmatch.fnmatch(name, p) for p in patterns):
                        continue
                    kernel = f"fwd_{normalizer}" if pass_ == "fwd" else pass_
                    tiles = [(cfg, True) for cfg in own[kernel]]
                    if all_configs:
                        for other in configs.AUTOTUNE_BY_ARCH.values():
                            tiles += [(cfg, False) for cfg in other[kernel] if cfg not in own[kernel]]
                    for even in (True, False) if arch in ragged else (True,):
                        # a config never used for this variant (a head-dim limit under 16) is not built
                        alpha = configs.heavy_alpha(normalizer, bias, window)
                        limit = [(c, p, c.head_dim_limit(masked, fp32, not even, alpha)) for c, p in tiles]
                        usable = [(c, p, lim) for c, p, lim in limit if lim >= 16]
                        for cfg, pickable, lim in usable[:1] if quick else usable:
                            dim = min(head_dim, lim)
                            builds.append(
                                Build(arch, normalizer, bias, pass_, cfg, dim, dtype, even, pickable, window)
                            )
        delta_cfg = configs.TileConfig(configs.DELTA_ROWS, 16, 4, 1)
        builds.append(Build(arch, "-", "-", "delta", delta_cfg, head_dim, dtype))
        rows_cfg = configs.TileConfig(configs.ROW_TERMS_ROWS, 16, 4, 1)
        builds.append(Build(arch, "-", "-", "rows", rows_cfg, head_dim, dtype))
    return builds


# ---- the report ------------------------------------------------------------------------------------------


def _max_over(loops: list[dict[str, Any]], key: str) -> float | None:
    values = [loop["per_score"].get(key, 0.0) for loop in loops]
    return max(values) if values else None


def report_row(r: Result) -> dict[str, Any]:
    """One build of the static report: its identity, resources, and its inner loops' machine code (the
    per-score counts are the largest over the build's inner loops; ``loops`` lists each)."""
    b, cfg = r.build, r.build.config
    loops = r.loops
    return {
        "kernel": b.kernel, "normalizer": b.normalizer, "bias": b.bias, "pass": b.pass_, "arch": b.arch,
        "dtype": b.dtype, "head_dim": b.head_dim, "even": b.even, "window": b.window,
        "block_m": cfg.block_m, "block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
        "pickable": b.pickable, "ok": r.ok, "error": r.error or None, "notes": r.notes,
        "registers": r.registers, "spill_bytes": r.spill_bytes, "local_bytes": r.local_bytes,
        "shared_bytes": r.shared,
        "ex2_per_score": _max_over(loops, "ex2"), "cvt_per_score": _max_over(loops, "i2f"),
        "instructions_per_score": _max_over(loops, "instructions"),
        "async_loads": all(loop["counts"].get("async_loads", 0) > 0 for loop in loops) if loops else None,
        "hmma": sum(loop["counts"].get("hmma", 0) for loop in loops),
        "hgmma": sum(loop["counts"].get("hgmma", 0) for loop in loops),
        "loop_ldl": sum(loop["counts"].get("ldl", 0) for loop in loops),
        "loop_stl": sum(loop["counts"].get("stl", 0) for loop in loops),
        "inner_loops": len(loops), "expected_inner_loops": len(b.dots), "other_loops": r.other_loops,
        "tiles_per_iteration": [loop["tiles_per_iteration"] for loop in loops],
        "loops": loops,
    }


def goal_failures(rows: list[dict[str, Any]], arch: int = GOAL_ARCH) -> list[str]:
    """The goals of the static report, for every pickable build on ``arch``: no spills; one tile per loop
    iteration (the counting premise); in every loop of a Gaussian build at most 2 ``MUFU.EX2`` and no
    integer-to-float conversion per score; in every loop of an entmax-1.5 build asynchronous loads."""
    bad = []
    for row in rows:
        if row["arch"] != arch or not row["pickable"] or row["pass"] in ROW_PASSES:
            continue
        name = (f"sm_{row['arch']} {row['normalizer']}/{row['bias']}/{row['pass']} M{row['block_m']}xN"
                f"{row['block_n']} w{row['num_warps']} s{row['num_stages']} D{row['head_dim']}"
                f"{'' if row['even'] else ' ragged'}")
        if not row["ok"]:
            bad.append(f"{name}: build failed ({row['error'] or row['notes']})")
            continue
        if row["spill_bytes"] != 0 or row["local_bytes"] not in (0, -1):
            bad.append(f"{name}: {row['spill_bytes']} spill bytes, {row['local_bytes']} local bytes")
        if row["inner_loops"] != row["expected_inner_loops"]:
            bad.append(f"{name}: {row['inner_loops']} inner loops found")
        if any(t != 1.0 for t in row["tiles_per_iteration"]):
            bad.append(f"{name}: tiles per loop iteration {row['tiles_per_iteration']} (expected 1)")
        for i, loop in enumerate(row["loops"]):
            per = loop["per_score"]
            if row["bias"] == "gaussian" and per["ex2"] > MAX_EX2_PER_SCORE:
                bad.append(f"{name}: loop {i} has {per['ex2']} MUFU.EX2 per score (> {MAX_EX2_PER_SCORE})")
            if row["bias"] == "gaussian" and per["i2f"] > 0:
                bad.append(f"{name}: loop {i} has {per['i2f']} int-to-float conversions per score")
            if row["normalizer"] != "softmax" and loop["counts"].get("async_loads", 0) == 0:
                bad.append(f"{name}: loop {i} loads its tiles synchronously")
    return bad


def source_digest() -> str:
    """Hash of the kernel sources and the config lists (a report older than them is stale)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for name in SOURCES:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:16]


def write_report(path: Path, results: list[Result], args: argparse.Namespace) -> dict[str, Any]:
    import triton

    payload = {
        "suite": "kernels_static",
        "triton": triton.__version__,
        "sources": source_digest(),
        "archs": list(args.arch),
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "method": "see vitattn/kernels/_build/sass.py and docs/kernels.md",
        "rows": [report_row(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return payload


def markdown_table(payload: dict[str, Any], arch: int = GOAL_ARCH) -> str:
    """The report's pickable builds on ``arch`` as a markdown table (docs/kernels.md): per build the
    registers, spill bytes, shared KiB, and per loop the MUFU.EX2 / I2F per score, instructions per score,
    the tensor-core instructions and whether the tile loads are asynchronous."""
    head = ("| variant | tile (M×N, warps, stages) | D | regs | spill B | smem KiB | EX2 / score | I2F / score "
            "| instr / score | HGMMA+HMMA | async |")
    lines = [head, "|" + "---|" * 11]
    for r in payload["rows"]:
        if r["arch"] != arch or not r["pickable"] or r["pass"] in ROW_PASSES or not r["even"]:
            continue
        loops = r["loops"]
        per = [loop["per_score"] for loop in loops]
        ex2 = " / ".join(f"{p['ex2']:.2f}" for p in per)
        cvt = " / ".join(f"{p['i2f']:.2f}" for p in per)
        ins = " / ".join(f"{p['instructions']:.1f}" for p in per)
        tile = f"{r['block_m']}×{r['block_n']}, {r['num_warps']}, {r['num_stages']}"
        lines.append(
            f"| {r['normalizer']}/{r['bias']}/{r['pass']} | {tile} | {r['head_dim']} | {r['registers']} | "
            f"{r['spill_bytes']} | {r['shared_bytes'] / 1024:.0f} | {ex2} | {cvt} | {ins} | {r['hgmma'] + r['hmma']} | "
            f"{'yes' if r['async_loads'] else 'NO'} |"
        )
    return "\n".join(lines)


# ---- the printed table -----------------------------------------------------------------------------------

_HEADER = ("arch", "variant (normalizer/bias/pass)", "config", "D", "smem KiB", "regs", "spill B",
           "EX2/sc", "I2F/sc", "async", "tensor-core instr", "status")
_WIDTHS = (-6, -28, -20, 4, 8, 5, 7, 6, 6, -5, -16, 0)


def _fmt(cells: Iterable[object]) -> str:
    return " ".join(f"{c!s:<{-w}}" if w < 0 else f"{c!s:>{w}}" for c, w in zip(cells, _WIDTHS, strict=True))


def _row(r: Result) -> str:
    b = r.build
    status = "ok" if r.ok else "FAIL " + "; ".join(r.notes or [r.error])  # an ok row's notes: in the JSON
    head = (f"sm_{b.arch}", b.variant + ("" if b.even else " ragged"), b.config, b.head_dim)
    if r.error:
        return _fmt((*head, "", "", "", "", "", "", "", status))
    row = report_row(r)
    ex2 = "" if row["ex2_per_score"] is None else f"{row['ex2_per_score']:.2f}"
    cvt = "" if row["cvt_per_score"] is None else f"{row['cvt_per_score']:.2f}"
    asy = "" if row["async_loads"] is None else ("yes" if row["async_loads"] else "NO")
    return _fmt((*head, f"{r.shared / 1024:.1f}", r.registers, r.spill_bytes, ex2, cvt, asy, r.tensor_core,
                 status))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--head-dim", type=int, default=128, help="largest padded head dim (16..128)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                        help="q/k/v element type (fp32: the TF32 kernels)")
    parser.add_argument("--quick", action="store_true", help="only the first autotune config per kernel")
    parser.add_argument("--ragged", type=int, nargs="*", metavar="ARCH",
                        help="also every build with its bound masks on (on these archs; all without one)")
    parser.add_argument("--all-configs", action="store_true",
                        help="also the other archs' configs on each arch (not pickable there)")
    parser.add_argument("--variants", nargs="+", default=[], metavar="PATTERN",
                        help="only these normalizer/bias/pass variants (fnmatch patterns, e.g. 'entmax15/*/fwd')")
    parser.add_argument("--window", action="store_true",
                        help="compile every build with a neighbourhood window (not in the default report)")
    parser.add_argument("--report", metavar="PATH", help="write the static machine-code report (JSON)")
    parser.add_argument("--markdown", metavar="REPORT",
                        help="print the pickable sm_90 builds of a report as a markdown table (no compile)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--fresh", action="store_true", help="compile into an empty triton cache")
    parser.add_argument("--expect-triton", metavar="VERSION",
                        help="exit 2 unless the imported triton is this version (CI's second Triton)")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0

    import triton

    print(f"triton {triton.__version__} ({Path(triton.__file__).parent})", flush=True)
    if args.expect_triton and triton.__version__ != args.expect_triton:
        print(f"expected triton {args.expect_triton}, imported {triton.__version__}", file=sys.stderr)
        return 2

    from ..env import interpret_requested

    if interpret_requested():
        print("unset TRITON_INTERPRET: the interpreter has nothing to compile", file=sys.stderr)
        return 2
    if args.fresh:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitattn-aot-")
    ragged = [] if args.ragged is None else (args.ragged or args.arch)
    builds = plan(
        args.arch, args.head_dim, args.dtype, args.quick, ragged, args.all_configs, args.variants, args.window
    )
    print(_fmt(_HEADER))
    results = []
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for r in pool.map(compile_one, builds):
                results.append(r)
                print(_row(r), flush=True)
    else:
        for b in builds:
            results.append(compile_one(b))
            print(_row(results[-1]), flush=True)

    failed = [r for r in results if not r.ok]
    real = [r for r in results if r.build.pass_ not in ROW_PASSES]
    for arch in args.arch:
        rows = [r for r in real if r.build.arch == arch and not r.error]
        if rows:
            print(
                f"sm_{arch}: max shared {max(r.shared for r in rows) / 1024:.1f} KiB "
                f"(limit {SMEM_LIMIT.get(arch, 0) / 1024:.0f} KiB), max registers "
                f"{max(r.registers for r in rows)}, builds with spills "
                f"{sum(1 for r in rows if r.spill_bytes != 0)}/{len(rows)}, "
                f"with tensor-core instructions {sum(1 for r in rows if r.tensor_core != 'none')}/{len(rows)}"
            )
    rows_json = [report_row(r) for r in results]
    if args.report:
        write_report(Path(args.report), results, args)
        print(f"wrote {args.report} ({len(rows_json)} builds)")
    status = 0
    if failed:
        print(f"{len(failed)} of {len(results)} builds failed", file=sys.stderr)
        status = 1
    goals = goal_failures(rows_json) if args.report and GOAL_ARCH in args.arch else []
    for line in goals:
        print(f"goal missed: {line}", file=sys.stderr)
    if goals:
        status = 1
    if status:
        return status
    variants = {r.build.variant for r in real}
    archs = ", ".join(f"sm_{a}" for a in args.arch)
    print(f"compiled {len(variants)} kernel variants for {archs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
