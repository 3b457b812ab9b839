"""Compile every kernel variant and autotune config ahead of time, for GPUs this machine may not have.

Usage: ``python -m vitattn.kernels._build.aot --arch 80 90 [--head-dim 128] [--dtype bf16] [--jobs 2]
[--quick] [--expect-triton 3.6.0]``

A *variant* is normalizer (softmax, entmax15) x bias kind (none, gaussian, additive, bool) x pass (fwd,
bwd_dkdv, bwd_dq); each is compiled with every entry of its autotune list (``configs.AUTOTUNE``), at
the largest head dim that entry serves (its worst case for registers and shared memory), via
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``, no GPU needed. For each build it
reports the shared memory (``metadata.shared``), the registers and spill bytes (``ptxas -v`` of the
PTX, with the ptxas bundled in the triton wheel) and the tensor-core instructions of the PTX
(``mma.sync`` on sm_80, ``wgmma`` on sm_90). The backward's row-term kernel is compiled too (one
extra line per arch, not counted as a variant). It exits non-zero if a build fails, exceeds the
card's dynamic shared memory per block (sm_80: 163 KiB, sm_90: 227 KiB) or has no tensor-core
instruction. The first line names the triton it imported (``triton 3.6.0 (/path)``; with
``--expect-triton`` another version exits 2), the last is ``compiled N kernel variants for sm_80, sm_90``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .. import configs

NORMALIZERS = ("softmax", "entmax15")
BIAS_KINDS = ("none", "gaussian", "additive", "bool")
PASSES = ("fwd", "bwd_dkdv", "bwd_dq")
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_FP32_POINTERS = {"STAT", "DELTA", "OG", "DEN", "ALPHA", "DADD", "DDEN", "DALPHA"}
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

    @property
    def variant(self) -> str:
        return f"{self.normalizer}/{self.bias}/{self.pass_}"

    @property
    def kernel(self) -> str:
        if self.pass_ == "fwd":
            return f"fwd_{self.normalizer}"
        return self.pass_


@dataclass
class Result:
    build: Build
    ok: bool = False
    error: str = ""
    shared: int = 0
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    tensor_core: str = ""
    notes: list[str] = field(default_factory=list)


def _flags(build: Build) -> dict[str, object]:
    """The constexpr switches of a variant (``tl.dot`` on bf16/fp16 operands; fp32: the TF32 dots)."""
    flags: dict[str, object] = dict(
        GAUSS=build.bias == "gaussian", HAS_ADD=build.bias == "additive", HAS_KEEP=build.bias == "bool",
        F32_DOT=2 if build.dtype == "fp32" else 0,  # fp32: TF32 dots, the only float32 path "auto" takes
        BLOCK_M=build.config.block_m, BLOCK_N=build.config.block_n,
        BLOCK_D=build.head_dim, BLOCK_DV=build.head_dim,
    )
    if build.pass_ != "fwd":
        flags["ENTMAX"] = build.normalizer == "entmax15"
    if build.pass_ == "fwd" and build.normalizer == "entmax15":
        flags["STORE_OG"] = True  # training: the heavier form
    if build.pass_ == "bwd_dq":
        flags["ADD_GRAD"] = 2 if build.bias == "additive" else 0  # atomics: the heavier form
        flags["GAUSS_GRAD"] = build.bias == "gaussian"
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
            signature[name] = "*u8" if name == "KEEP" else "*fp32" if name in _FP32_POINTERS else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "clamp"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in _ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [k for k, v in signature.items() if v == "constexpr" and k not in constexprs]
    if missing:
        raise ValueError(f"no value for constexpr {missing} of {fn.__name__}")
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _ptxas(ptx: str, arch_name: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from the bundled ``ptxas -v``."""
    exe = _ptxas_path()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run(
            [exe, "-v", f"--gpu-name={arch_name}", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        )
    text = res.stderr + res.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (
        int(regs.group(1)) if regs else -1,
        int(spills.group(1)) if spills else -1,
        int(spills.group(2)) if spills else -1,
    )


def _ptxas_path() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def compile_one(build: Build) -> Result:
    """Compile one build and measure it (runs in a worker process)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ..ops import kernels

    res = Result(build)
    try:
        fn = kernels()["bwd_delta" if build.pass_ == "delta" else build.kernel]
        if build.pass_ == "delta":
            constexprs: dict[str, object] = {"BLOCK_M": configs.DELTA_ROWS, "BLOCK_DV": build.head_dim}
        else:
            constexprs = _flags(build)
        src = _source(fn, build.dtype, constexprs)
        compiled = triton.compile(
            src, target=GPUTarget("cuda", build.arch, 32),
            options={"num_warps": build.config.num_warps, "num_stages": build.config.num_stages},
        )
        ptx = compiled.asm["ptx"]
        res.shared = int(compiled.metadata.shared)
        target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
        arch_name = target.group(1).rstrip(",") if target else f"sm_{build.arch}"
        res.registers, res.spill_stores, res.spill_loads = _ptxas(ptx, arch_name)
        n_mma = len(re.findall(r"\bmma\.sync\b", ptx))
        n_wgmma = len(re.findall(r"\bwgmma\.mma_async\b", ptx))
        res.tensor_core = ", ".join(
            s for s in (f"wgmma x{n_wgmma}" if n_wgmma else "", f"mma.sync x{n_mma}" if n_mma else "") if s
        ) or "none"
        res.ok = True
        limit = SMEM_LIMIT.get(build.arch)
        if limit is not None and res.shared > limit:
            res.ok = False
            res.notes.append(f"shared memory {res.shared} B > {limit} B")
        if build.pass_ != "delta" and res.tensor_core == "none":
            res.ok = False
            res.notes.append("no tensor-core instruction in the PTX")
    except Exception as exc:  # report every failure, keep going
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return res


def plan(archs: Iterable[int], head_dim: int, dtype: str, quick: bool = False) -> list[Build]:
    """Every (arch, variant, config) at ``min(head_dim, config.max_head_dim)``; ``quick`` keeps the
    first config of each kernel only."""
    builds = []
    for arch in archs:
        for normalizer in NORMALIZERS:
            for bias in BIAS_KINDS:
                for pass_ in PASSES:
                    probe = Build(arch, normalizer, bias, pass_, configs.INTERPRET, head_dim, dtype)
                    tiles = configs.AUTOTUNE[probe.kernel]
                    for cfg in tiles[:1] if quick else tiles:
                        masked = bias in ("additive", "bool")
                        dim = min(head_dim, cfg.head_dim_limit(masked, fp32=dtype == "fp32"))
                        builds.append(Build(arch, normalizer, bias, pass_, cfg, dim, dtype))
        delta_cfg = configs.TileConfig(configs.DELTA_ROWS, 16, 4, 1)
        builds.append(Build(arch, "-", "-", "delta", delta_cfg, head_dim, dtype))
    return builds


_HEADER = ("arch", "variant (normalizer/bias/pass)", "config", "D", "smem KiB", "regs", "spill st/ld B",
           "tensor-core instr", "status")
_WIDTHS = (-6, -28, -20, 4, 8, 5, 13, -22, 0)


def _fmt(cells: Iterable[object]) -> str:
    return " ".join(f"{c!s:<{-w}}" if w < 0 else f"{c!s:>{w}}" for c, w in zip(cells, _WIDTHS, strict=True))


def _row(r: Result) -> str:
    b = r.build
    status = "ok" if r.ok else "FAIL " + "; ".join(r.notes or [r.error])
    head = (f"sm_{b.arch}", b.variant, b.config, b.head_dim)
    if r.error:
        return _fmt((*head, "", "", "", "", status))
    spills = f"{r.spill_stores}/{r.spill_loads}"
    return _fmt((*head, f"{r.shared / 1024:.1f}", r.registers, spills, r.tensor_core, status))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--head-dim", type=int, default=128, help="largest padded head dim (16..128)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                        help="q/k/v element type (fp32: the TF32 kernels)")
    parser.add_argument("--quick", action="store_true", help="only the first autotune config per kernel")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--fresh", action="store_true", help="compile into an empty triton cache")
    parser.add_argument("--expect-triton", metavar="VERSION",
                        help="exit 2 unless the imported triton is this version (CI's second Triton)")
    args = parser.parse_args(argv)

    import triton

    print(f"triton {triton.__version__} ({Path(triton.__file__).parent})", flush=True)
    if args.expect_triton and triton.__version__ != args.expect_triton:
        print(f"expected triton {args.expect_triton}, imported {triton.__version__}", file=sys.stderr)
        return 2

    from ..backend import interpret_requested

    if interpret_requested():
        print("unset TRITON_INTERPRET: the interpreter has nothing to compile", file=sys.stderr)
        return 2
    if args.fresh:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitattn-aot-")
    builds = plan(args.arch, args.head_dim, args.dtype, args.quick)
    print(_fmt(_HEADER))
    if args.jobs > 1:
        results = []
        with ProcessPoolExecutor(args.jobs) as pool:
            for r in pool.map(compile_one, builds):
                results.append(r)
                print(_row(r), flush=True)
    else:
        results = []
        for b in builds:
            results.append(compile_one(b))
            print(_row(results[-1]), flush=True)

    failed = [r for r in results if not r.ok]
    real = [r for r in results if r.build.pass_ != "delta"]
    for arch in args.arch:
        rows = [r for r in real if r.build.arch == arch and not r.error]
        if rows:
            print(
                f"sm_{arch}: max shared {max(r.shared for r in rows) / 1024:.1f} KiB "
                f"(limit {SMEM_LIMIT.get(arch, 0) / 1024:.0f} KiB), max registers "
                f"{max(r.registers for r in rows)}, builds with spills "
                f"{sum(1 for r in rows if r.spill_stores > 0 or r.spill_loads > 0)}/{len(rows)}, "
                f"with tensor-core instructions {sum(1 for r in rows if r.tensor_core != 'none')}/{len(rows)}"
            )
    if failed:
        print(f"{len(failed)} of {len(results)} builds failed", file=sys.stderr)
        return 1
    variants = {r.build.variant for r in real}
    archs = ", ".join(f"sm_{a}" for a in args.arch)
    print(f"compiled {len(variants)} kernel variants for {archs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
