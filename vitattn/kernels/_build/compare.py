"""vitattn's kernels against a flash-attention kernel, in machine code: the Triton fused-attention tutorial's
kernels compiled with the same Triton for the same card, their inner loops counted the way the static
report counts vitattn's (:mod:`vitattn.kernels._build.sass`), and the ratios the issue asks for.

The tutorial's source is read at run time from ``../shared/reference/flash_tutorial/tutorial_attn.py``
relative to the repository root (``$VITATTN_FLASH_TUTORIAL`` overrides the path); it is not part of
vitattn. Where it is absent the flash rows are skipped with the reason, and only vitattn's own ratios
(Gaussian against plain, at the same tile) are computed.

Conventions: every tile is ``block_m`` queries x ``block_n`` keys, as in vitattn's config lists (for
dK/dV ``block_m`` is the query tile streamed and ``block_n`` the key block kept; the tutorial's
``BLOCK_M1`` / ``BLOCK_N1``); the tutorial's backward is one kernel with the dK/dV loop first and the dQ
loop second. Counts are per score element of the kernels' inner key (or query) loops, at head dim 64,
bfloat16, a 64 x 64 patch grid (N = 4096) for the Gaussian bias, sm_90.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEAD_DIM = 64
N_CTX = 4096
FLASH_ENV = "VITATTN_FLASH_TUTORIAL"
# The tutorial's own forward autotune space (06-fused-attention.py): BLOCK_M in {64, 128}, BLOCK_N in
# {32, 64, 128} (at most the head dim), 2-4 stages, 4 or 8 warps, of which on sm_90 the 8-warp configs
# with BLOCK_M * BLOCK_N < 128 * 128 are pruned; its backward runs one fixed config.
FLASH_FWD_SPACE = [
    (bm, bn, w, s)
    for bm, bn, s, w in itertools.product((64, 128), (32, 64, 128), (2, 3, 4), (4, 8))
    if bn <= HEAD_DIM and not (w == 8 and bm * bn < 128 * 128)
]
FLASH_BWD_OWN = (32, 128, 128, 32, 4, 5)  # BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages

PASSES = ("fwd", "bwd_dkdv", "bwd_dq")
# (name, limit): the goals on the ratios below.
RATIO_GOALS = {
    "gaussian_vs_plain_fwd": 1.15,
    "gaussian_vs_plain_bwd": 1.3,
    "plain_vs_flash_fwd": 1.05,
    "plain_vs_flash_bwd": 1.1,
    "gaussian_best_vs_flash_best_fwd": 1.3,
    "gaussian_best_vs_flash_best_bwd": 1.5,
    "entmax_vs_flash_fwd_bwd": 2.0,
}
# The entmax-1.5 forward runs its search pass (loop 1) once per pass: the comparison counts this many, the
# bound tests/test_kernels_entmax_search.py asserts on Gaussian-random rows at N = 4096 (3-4 there).
ENTMAX_SEARCH_PASSES = 4


def flash_path() -> Path:
    """Where the tutorial's kernels are read from (``$VITATTN_FLASH_TUTORIAL`` or the shared reference)."""
    env = os.environ.get(FLASH_ENV)
    if env:
        return Path(env)
    return (
        Path(__file__).resolve().parents[3].parent
        / "shared"
        / "reference"
        / "flash_tutorial"
        / "tutorial_attn.py"
    )


def load_flash() -> tuple[Any, str]:
    """``(module, "")`` of the tutorial's kernels, or ``(None, reason)``."""
    path = flash_path()
    if not path.is_file():
        return None, f"the flash tutorial's source is absent ({path})"
    spec = importlib.util.spec_from_file_location("flash_tutorial_attn", path)
    if spec is None or spec.loader is None:
        return None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a tutorial this Triton cannot define
        return None, f"importing {path} failed: {type(exc).__name__}: {exc}"
    return module, ""


@dataclass(frozen=True)
class FlashBuild:
    """One compile of the tutorial: its forward at ``(block_m, block_n)``, or its backward with the dK/dV
    tile ``(block_m, block_n)`` and the dQ tile ``(block_m2, block_n2)`` (queries x keys each)."""

    arch: int
    pass_: str  # "fwd" | "bwd"
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_m2: int = 0
    block_n2: int = 0

    @property
    def name(self) -> str:
        tile = f"{self.block_m}x{self.block_n}"
        if self.pass_ == "bwd":
            tile += f" + {self.block_m2}x{self.block_n2}"
        return f"flash/{self.pass_} {tile} w{self.num_warps} s{self.num_stages}"


def flash_skip(fb: FlashBuild) -> str:
    """Why the tutorial cannot compile this tile ("" where it can): its static asserts."""
    if fb.pass_ == "fwd" and fb.block_n > HEAD_DIM:
        return "the tutorial's forward asserts BLOCK_N <= HEAD_DIM"
    if fb.pass_ == "bwd" and (fb.block_n % fb.block_m or fb.block_m2 % fb.block_n2):
        return "the tutorial's backward asserts BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0"
    return ""


def _flash_source(module: Any, fb: FlashBuild) -> Any:
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .jit import jit_source

    z, h, n, d = 2, 4, N_CTX, HEAD_DIM

    def meta(*shape: int, dt: Any = torch.bfloat16) -> torch.Tensor:
        return torch.empty(*shape, device="meta", dtype=dt)

    if fb.pass_ == "fwd":
        flat = meta(z * h * n, d)
        desc_q = TensorDescriptor(flat, [z * h * n, d], [d, 1], [fb.block_m, d])
        desc_k = TensorDescriptor(flat, [z * h * n, d], [d, 1], [fb.block_n, d])
        args = [d**-0.5, meta(z * h * n, dt=torch.float32), z, h, desc_q, desc_k, desc_k, desc_q, n]
        kwargs = dict(HEAD_DIM=d, BLOCK_M=fb.block_m, BLOCK_N=fb.block_n, FP8_OUTPUT=False, STAGE=1,
                      warp_specialize=False, IS_HOPPER=fb.arch >= 90)  # fmt: skip
        return jit_source(module._attn_fwd, args, kwargs, fb.arch)
    t = meta(z, h, n, d)
    stats = meta(z * h * n, dt=torch.float32)
    args = [t, t, t, d**-0.5, t, t, t, t, stats, stats, h * n * d, n * d, d, 1, h, n]
    kwargs = dict(BLOCK_M1=fb.block_m, BLOCK_N1=fb.block_n, BLOCK_M2=fb.block_m2, BLOCK_N2=fb.block_n2,
                  BLK_SLICE_FACTOR=2, HEAD_DIM=d, CAUSAL=False)  # fmt: skip
    return jit_source(module._attn_bwd, args, kwargs, fb.arch)


def _loop_row(loop: Any, **ids: Any) -> dict[str, Any]:
    return {
        **ids,
        "instructions_per_score": loop.per_score["instructions"],
        "ex2_per_score": loop.per_score["ex2"],
        "hgmma": loop.counts.get("hgmma", 0),
        "hmma": loop.counts.get("hmma", 0),
        "tiles_per_iteration": loop.tiles_per_iteration,
        "loop": loop.to_dict(),
    }


def compile_flash(fb: FlashBuild) -> list[dict[str, Any]]:
    """The report rows of one tutorial compile (one per loop: ``fwd``, or ``bwd_dkdv`` and ``bwd_dq``);
    a failed or skipped compile gives rows with ``ok`` false and the reason. Runs in a worker process."""
    import triton
    from triton.backends.compiler import GPUTarget

    from . import sass

    passes = ["fwd"] if fb.pass_ == "fwd" else ["bwd_dkdv", "bwd_dq"]
    tiles = [(fb.block_m, fb.block_n), (fb.block_m2, fb.block_n2)]
    base = {"kernel": "flash_tutorial", "arch": fb.arch, "head_dim": HEAD_DIM, "num_warps": fb.num_warps,
            "num_stages": fb.num_stages, "build": fb.name}  # fmt: skip
    ids = [
        dict(base, **{"pass": p, "block_m": m, "block_n": n})
        for p, (m, n) in zip(passes, tiles, strict=False)
    ]
    reason = flash_skip(fb)
    module, why = load_flash() if not reason else (None, reason)
    if module is None:
        return [dict(i, ok=False, error=why) for i in ids]
    try:
        compiled = triton.compile(
            _flash_source(module, fb),
            target=GPUTarget("cuda", fb.arch, 32),
            options={"num_warps": fb.num_warps, "num_stages": fb.num_stages},
        )
        cubin = compiled.asm["cubin"]
        usage = sass.resource_usage(cubin)
        text = sass.disassemble(cubin)
        whole = sass.classify(sass.parse(text)[0])
        extra = {"ok": True, "error": None, "registers": usage.get("REG", -1),
                 "spill_bytes": whole.get("stl_bytes", 0) + whole.get("ldl_bytes", 0),
                 "shared_bytes": int(compiled.metadata.shared)}  # fmt: skip
        rows = []
        for i, (p, (m, n)) in enumerate(zip(passes, tiles, strict=False)):
            dots = [2] if p == "fwd" else [4, 3]
            loops, _ = sass.loop_reports(text, m, n, fb.num_warps, HEAD_DIM, dots)
            if len(loops) != len(passes):
                return [
                    dict(j, ok=False, error=f"{len(loops)} inner loops found, {len(passes)} expected")
                    for j in ids
                ]
            rows.append(_loop_row(loops[i], **ids[i], **extra))
        return rows
    except Exception as exc:
        return [dict(i, ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                for i in ids]  # fmt: skip


def flash_plan(arch: int, ours: dict[str, list[tuple[int, int, int, int]]]) -> list[FlashBuild]:
    """The tutorial's compiles for ``arch``: its forward at each of vitattn's forward tiles and over its own
    autotune space; its backward at vitattn's dK/dV and dQ tiles taken pairwise (index by index, the
    shorter list repeating its last) and at its own config. ``ours``: kernel name -> ``(m, n, warps,
    stages)`` tiles."""
    builds = [FlashBuild(arch, "fwd", m, n, w, s) for m, n, w, s in ours["fwd_softmax"]]
    builds += [FlashBuild(arch, "fwd", m, n, w, s) for m, n, w, s in FLASH_FWD_SPACE]
    kv, q = ours["bwd_dkdv"], ours["bwd_dq"]
    for i in range(max(len(kv), len(q))):
        m1, n1, w1, s1 = kv[min(i, len(kv) - 1)]
        m2, n2, w2, _ = q[min(i, len(q) - 1)]
        if w1 == w2:
            builds.append(FlashBuild(arch, "bwd", m1, n1, w1, s1, m2, n2))
    m1, n1, m2, n2, w, s = FLASH_BWD_OWN
    builds.append(FlashBuild(arch, "bwd", m1, n1, w, s, m2, n2))
    seen: set[FlashBuild] = set()
    return [b for b in builds if not (b in seen or seen.add(b))]  # type: ignore[func-returns-value]


# ---- the ratios ----------------------------------------------------------------------------------------


def _tile(row: dict[str, Any]) -> tuple[int, int, int, int]:
    return row["block_m"], row["block_n"], row["num_warps"], row["num_stages"]


def _ips(row: dict[str, Any]) -> float:
    return float(row["instructions_per_score"])


def comparison(
    rows: list[dict[str, Any]], flash_rows: list[dict[str, Any]], arch: int = 90
) -> dict[str, Any]:
    """The comparisons of the report at head dim 64 on ``arch`` (whole tiles, bf16): per pass and tile
    the instructions per score of vitattn's plain (no bias) and Gaussian softmax kernels and of the
    tutorial's, their ratios at the same tile, the backward as dK/dV + dQ over every pair of pickable
    tiles, each side at its best pickable tile, and the goals (``RATIO_GOALS``) with their values."""
    ours: dict[tuple[str, str], dict[tuple[int, int, int, int], float]] = {}
    for r in rows:
        if (r["arch"] == arch and r["pickable"] and r["even"] and r["ok"] and not r.get("window")
                and r["normalizer"] == "softmax"
                and r["head_dim"] == HEAD_DIM and r["bias"] in ("none", "gaussian") and r["pass"] in PASSES
                and r["dtype"] == "bf16"):  # fmt: skip
            ours.setdefault((r["pass"], r["bias"]), {})[_tile(r)] = _ips(r)
    flash: dict[str, dict[tuple[int, int, int], float]] = {}  # (m, n, warps): the stages may differ
    for r in flash_rows:
        if r["arch"] == arch and r.get("ok"):
            table = flash.setdefault(r["pass"], {})
            table[_tile(r)[:3]] = min(table.get(_tile(r)[:3], float("inf")), _ips(r))
    same: list[dict[str, Any]] = []
    for pass_ in PASSES:
        plain, gauss = ours.get((pass_, "none"), {}), ours.get((pass_, "gaussian"), {})
        for tile in sorted(set(plain) | set(gauss)):
            entry: dict[str, Any] = {"pass": pass_, "tile": list(tile), "plain": plain.get(tile),
                                     "gaussian": gauss.get(tile), "flash": flash.get(pass_, {}).get(tile[:3])}  # fmt: skip
            if entry["plain"] and entry["gaussian"]:
                entry["gaussian_vs_plain"] = round(entry["gaussian"] / entry["plain"], 4)
            if entry["plain"] and entry["flash"]:
                entry["plain_vs_flash"] = round(entry["plain"] / entry["flash"], 4)
            same.append(entry)
    pairs = []
    kv_p, kv_g = ours.get(("bwd_dkdv", "none"), {}), ours.get(("bwd_dkdv", "gaussian"), {})
    q_p, q_g = ours.get(("bwd_dq", "none"), {}), ours.get(("bwd_dq", "gaussian"), {})
    for a, b in itertools.product(sorted(set(kv_p) & set(kv_g)), sorted(set(q_p) & set(q_g))):
        pair: dict[str, Any] = {
            "dkdv": list(a),
            "dq": list(b),
            "plain": kv_p[a] + q_p[b],
            "gaussian": kv_g[a] + q_g[b],
        }
        pair["gaussian_vs_plain"] = round(pair["gaussian"] / pair["plain"], 4)
        fa, fb = flash.get("bwd_dkdv", {}).get(a[:3]), flash.get("bwd_dq", {}).get(b[:3])
        if fa and fb:
            pair["flash"] = fa + fb
            pair["plain_vs_flash"] = round(pair["plain"] / pair["flash"], 4)
        pairs.append(pair)

    def best(table: dict[Any, float]) -> list[Any] | None:
        return [list(min(table, key=table.__getitem__)), min(table.values())] if table else None

    bests: dict[str, Any] = {
        "fwd": {
            "plain": best(ours.get(("fwd", "none"), {})),
            "gaussian": best(ours.get(("fwd", "gaussian"), {})),
            "flash": best(flash.get("fwd", {})),
        },  # fmt: skip
        "bwd_dkdv": {"plain": best(kv_p), "gaussian": best(kv_g), "flash": best(flash.get("bwd_dkdv", {}))},
        "bwd_dq": {"plain": best(q_p), "gaussian": best(q_g), "flash": best(flash.get("bwd_dq", {}))},
    }
    entmax = entmax_comparison(rows, flash, arch)
    values = _goal_values(same, pairs, bests, entmax)
    goals = [
        {
            "goal": name,
            "limit": limit,
            "value": values[name],
            "met": None if (value := values[name]) is None else value <= limit,
        }  # fmt: skip
        for name, limit in RATIO_GOALS.items()
    ]
    return {"head_dim": HEAD_DIM, "arch": arch, "same_tile": same, "backward_pairs": pairs, "best": bests,
            "entmax": entmax, "goals": goals}  # fmt: skip


def _goal_values(
    same: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    bests: dict[str, Any],
    entmax: list[dict[str, Any]],
) -> dict[str, float | None]:
    """The value of each goal of ``RATIO_GOALS`` from :func:`comparison`'s tables (None: not computable)."""
    values: dict[str, float | None] = {
        "gaussian_vs_plain_fwd": max(
            (e["gaussian_vs_plain"] for e in same if e["pass"] == "fwd" and "gaussian_vs_plain" in e),
            default=None,
        ),  # fmt: skip
        "gaussian_vs_plain_bwd": max((p["gaussian_vs_plain"] for p in pairs), default=None),
        "plain_vs_flash_fwd": max(
            (e["plain_vs_flash"] for e in same if e["pass"] == "fwd" and "plain_vs_flash" in e), default=None
        ),  # fmt: skip
        "plain_vs_flash_bwd": max(
            (p["plain_vs_flash"] for p in pairs if "plain_vs_flash" in p), default=None
        ),
    }
    values["entmax_vs_flash_fwd_bwd"] = max((e["entmax_vs_flash"] for e in entmax), default=None)
    g, f = bests["fwd"]["gaussian"], bests["fwd"]["flash"]
    values["gaussian_best_vs_flash_best_fwd"] = round(g[1] / f[1], 4) if g and f else None
    parts = [bests[p][k] for p in ("bwd_dkdv", "bwd_dq") for k in ("gaussian", "flash")]
    values["gaussian_best_vs_flash_best_bwd"] = (
        round((parts[0][1] + parts[2][1]) / (parts[1][1] + parts[3][1]), 4) if all(parts) else None
    )
    return values


def entmax_comparison(
    rows: list[dict[str, Any]], flash: dict[str, dict[tuple[int, int, int], float]], arch: int = 90
) -> list[dict[str, Any]]:
    """entmax-1.5 (no bias, bf16, whole tiles, head dim 64) forward + backward against the tutorial's at the
    same tiles: per forward tile and pair of backward tiles where the tutorial has all three, the
    instructions per score of the forward (first pass + :data:`ENTMAX_SEARCH_PASSES` search passes + the
    output pass with ``OG``), dK/dV and dQ, and the ratio of the sums. ``flash``: pass -> ``(m, n, warps)``
    -> instructions per score."""
    mine: dict[str, dict[tuple[int, int, int, int], float]] = {}
    for r in rows:
        if (r["arch"] == arch and r["pickable"] and r["even"] and r["ok"] and not r.get("window")
                and r["normalizer"] == "entmax15"
                and r["head_dim"] == HEAD_DIM and r["bias"] == "none" and r["pass"] in PASSES
                and r["dtype"] == "bf16"):  # fmt: skip
            loops = [loop["per_score"]["instructions"] for loop in r["loops"]]
            if r["pass"] == "fwd":
                if len(loops) != 3:
                    continue
                value = loops[0] + ENTMAX_SEARCH_PASSES * loops[1] + loops[2]
            else:
                value = _ips(r)
            mine.setdefault(r["pass"], {})[_tile(r)] = value
    out = []
    fwd, kv, dq = (mine.get(p, {}) for p in PASSES)
    f_fwd, f_kv, f_dq = (flash.get(p, {}) for p in PASSES)
    for t, a, b in itertools.product(sorted(fwd), sorted(kv), sorted(dq)):
        theirs = [f_fwd.get(t[:3]), f_kv.get(a[:3]), f_dq.get(b[:3])]
        if not all(theirs):
            continue
        ours = fwd[t] + kv[a] + dq[b]
        total = sum(x for x in theirs if x)
        out.append({"fwd": list(t), "dkdv": list(a), "dq": list(b), "passes": ENTMAX_SEARCH_PASSES,
                    "entmax": [round(fwd[t], 4), kv[a], dq[b]], "flash": theirs,
                    "entmax_vs_flash": round(ours / total, 4)})  # fmt: skip
    return out
