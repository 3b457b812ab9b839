"""Neighbourhood windows (``WindowMask``) in the Triton kernels: softmax, entmax-1.5 and alpha-entmax, with
and without the Gaussian bias, forward and backward, against ``backend="reference"`` in float64 in Triton's
interpreter (see ``tests/test_kernels.py`` for how the interpreter flag is set); the key tiles each loop
visits (counted in the interpreter: they are the window's tile lists); and how close those lists come to
the fewest tiles that cover the windows, at a 64 x 64 grid with a 7 x 7 window (the issue's goal: at
most 3x).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vitattn.functional import GaussianBias, WindowMask, attention, explain
from vitattn.kernels import configs, windows

triton = pytest.importorskip("triton")
from vitattn.kernels import ops  # noqa: E402  (imports triton)

interpreted = pytest.mark.triton_interpreter
TOL = {torch.float32: (1e-5, 2e-5), torch.float16: (3e-3, 4e-3)}


@dataclass
class Case:
    normalizer: str  # softmax | entmax15 | alpha (one alpha per head)
    grid: tuple[int, int] = (6, 7)
    window: int | tuple[int, int] = 3
    prefix: int = 1
    gauss: bool = False
    dilation: int = 1
    d: int = 16
    dtype: torch.dtype = torch.float32


def _leaves(case: Case):
    g = torch.Generator().manual_seed(0)
    n = case.prefix + case.grid[0] * case.grid[1]
    leaves = {name: (torch.randn(1, 2, n, case.d, generator=g, dtype=torch.float64) * 2) for name in "qkv"}
    if case.normalizer == "alpha":
        leaves["alpha"] = torch.tensor([1.3, 1.8], dtype=torch.float64)
    if case.gauss:
        n_p = case.grid[0] * case.grid[1]
        leaves["sigma"] = torch.exp(torch.randn(1, 2, n_p, 2, generator=g, dtype=torch.float64) * 0.5)
        leaves["amp"] = torch.rand(1, 2, n_p, 1, generator=g, dtype=torch.float64) * 3
    ours = {k: (t.to(case.dtype) if k in "qkv" else t.float()).requires_grad_() for k, t in leaves.items()}
    ref = {k: t.detach().double().requires_grad_() for k, t in ours.items()}
    return ours, ref


def _run(leaves, case: Case, backend: str) -> torch.Tensor:
    kw: dict = dict(mask=WindowMask(case.grid, case.window, case.prefix, dilation=case.dilation))
    kw["normalizer"] = leaves["alpha"] if case.normalizer == "alpha" else case.normalizer
    if case.gauss:
        kw["bias"] = GaussianBias(leaves["sigma"], leaves["amp"], case.grid, case.prefix)
    return attention(leaves["q"], leaves["k"], leaves["v"], backend=backend, **kw)


def check(case: Case) -> None:
    ours, ref = _leaves(case)
    out = _run(ours, case, "triton")
    expect = _run(ref, case, "reference")
    fwd_tol, grad_tol = TOL[case.dtype]
    err = ((out.double() - expect).abs().max() / expect.abs().max()).item()
    assert err <= fwd_tol, f"out: relative error {err:.2e}"
    grad = torch.randn(expect.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, list(ours.values()), grad.to(case.dtype))
    want = torch.autograd.grad(expect, list(ref.values()), grad)
    for name, a, w in zip(ours, got, want, strict=True):
        err = ((a.double() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
        tol = 4e-5 if name == "alpha" and case.dtype == torch.float32 else grad_tol
        assert err <= tol, f"d{name}: relative error {err:.2e}"


CASES = [
    Case("softmax"),
    Case("entmax15"),
    Case("alpha"),
    Case("softmax", gauss=True),
    Case("entmax15", gauss=True, prefix=0),
    Case("alpha", gauss=True, grid=(5, 8), window=(3, 5)),
    Case("softmax", grid=(9, 9), window=5, dilation=2),
    Case("entmax15", grid=(12, 12), window=4, prefix=2, d=32),  # an even window
    Case("entmax15", gauss=True, dtype=torch.float16),
]


def _id(case: Case) -> str:
    gauss = "-gauss" if case.gauss else ""
    shape = f"{case.grid}-w{case.window}-d{case.dilation}-P{case.prefix}"
    return f"{case.normalizer}{gauss}-{shape}-{str(case.dtype)[6:]}"


@interpreted
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_window_matches_reference(case):
    check(case)


@interpreted
@pytest.mark.parametrize("case", [CASES[3], CASES[4], CASES[5]], ids=_id)
def test_window_matches_reference_on_sm80(case):
    """sm_80's forwards sum each tile's rows (``configs.ROW_PARTS_BY_ARCH``) instead of partial sums."""
    with ops.assume_arch(80):
        check(case)


def _count(monkeypatch, module_name: str, name: str) -> list[int]:
    module = importlib.import_module(module_name)
    calls: list[int] = []
    inner = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@interpreted
def test_kernels_visit_the_window_tiles_only(monkeypatch):
    """The softmax forward, dK/dV and dQ each visit the tiles of the window's list, and the list is far
    from dense: 401 tokens (a 20 x 20 grid, a class token), a 3 x 3 window, 32 x 32 tiles."""
    window = WindowMask((20, 20), 3, 1)
    ops.kernels()
    fwd = _count(monkeypatch, "vitattn.kernels.softmax_lists", "listed_scores")
    bwd = _count(monkeypatch, "vitattn.kernels.backward_lists", "_score_tile")
    q, k, v = (torch.randn(1, 1, 401, 16, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, mask=window, backend="triton")
    out.sum().backward()
    tiles = windows.window_tiles(window, configs.INTERPRET.block_m, configs.INTERPRET.block_n)
    assert len(fwd) == int(tiles.sum()) and len(bwd) == 2 * int(tiles.sum())
    assert int(tiles.sum()) < 0.5 * tiles.numel()


def cover_ratio(window: WindowMask, block_m: int, block_n: int) -> tuple[float, float]:
    """``(max over query tiles, overall)`` of visited key tiles / the fewest key tiles that hold every
    kept score of the query tile (from the dense keep-mask); fails if a kept tile is not visited."""
    keep = window.dense()
    n = window.num_tokens
    tiles = windows.window_tiles(window, block_m, block_n)
    t_q, t_k = tiles.shape
    padded = torch.nn.functional.pad(keep, (0, t_k * block_n - n, 0, t_q * block_m - n))
    cover = padded.view(t_q, block_m, t_k, block_n).any(3).any(1)
    assert not (cover & ~tiles).any(), "a tile holding a kept score is skipped"
    visited, least = tiles.sum(1).double(), cover.sum(1).double()
    return (visited / least).max().item(), (visited.sum() / least.sum()).item()


@pytest.mark.parametrize("prefix", [0, 1])
def test_tiles_visited_at_a_64x64_grid_with_a_7x7_window(prefix):
    """Visited key tiles per query tile <= 3x the fewest that cover its windows, for the interpreter's tile
    and every forward / dQ tile of the sm_90 lists (dK/dV visits the transposed lists): measured <= 1.12x,
    2.0x for dQ's 16-key tile."""
    window = WindowMask((64, 64), 7, prefix)
    tiles = {(configs.INTERPRET.block_m, configs.INTERPRET.block_n)}
    for kernel in ("fwd_softmax_lists", "fwd_entmax15", "bwd_dq_lists"):  # the list kernels windows run on
        tiles |= {(c.block_m, c.block_n) for c in configs.AUTOTUNE_BY_ARCH[90][kernel]}
    for block_m, block_n in sorted(tiles):
        worst, overall = cover_ratio(window, block_m, block_n)
        if block_n < 32:  # dQ's 16-key tile (head dim 128): a key span of whole grid rows covers 4 tiles a
            # row where the window's 7 columns lie in 1 or 2 (measured 2.0 at worst, 1.08 overall)
            assert worst <= 2.0 and overall <= 1.09, (block_m, block_n, worst, overall)
        else:
            assert worst <= 1.15 and overall <= 1.06, (block_m, block_n, worst, overall)


def test_explain_on_cuda_picks_triton_for_windows():
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 3, 17, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        alpha = torch.full((3,), 1.4, device="cuda", requires_grad=True)
        for normalizer in ("softmax", "entmax15", alpha):
            report = explain(q, q, q, normalizer=normalizer, mask=WindowMask((4, 4), 3, 1))
            assert report.chosen == "triton", str(report)
            assert "window" in report.path
