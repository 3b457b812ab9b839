"""The Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1) against the reference backend.

How the interpreter flag is read (triton 3.8): ``@triton.jit`` reads ``TRITON_INTERPRET`` when a function
is *defined*, returning an ``InterpretedFunction`` instead of a ``JITFunction``, and that includes
triton's own ``triton.language`` helpers (``tl.zeros``, ``tl.sum``...), defined when triton is first
imported. So the variable must be set before anything imports triton (torchvision, and through it timm,
do). This module sets it at import when triton is not imported yet (``pytest tests/test_kernels.py``),
and its ``@pytest.mark.triton_interpreter`` tests run in this process. Otherwise (the whole suite,
where earlier test modules imported timm) ``conftest.py`` runs them all in one child pytest with the
variable set, and each test here reports its own case's result (``tests/helpers.py``): the same cases
run under TRITON_INTERPRET=1 either way, and none shows as skipped.

Every case checks the forward output and every gradient (q, k, v, and sigma, alpha, the additive mask
where present) against ``backend="reference"`` run in float64 on the same (rounded) inputs.
Tolerances, as the max-abs error relative to the reference's max-abs (forward / gradients): float32
1e-5 / 2e-5 (observed <= 2.5e-6), float16 3e-3 / 4e-3 (observed <= 8e-4), bfloat16 2.5e-2 / 4e-2
(observed <= 1.2e-2; the interpreter loads bf16 and upcasts, p and dS are rounded to bf16 as on a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from unittest import mock

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from vitattn.functional import GaussianBias, attention, explain
from vitattn.functional.dispatch import AttentionCall
from vitattn.functional.window import WindowMask
from vitattn.kernels import backend as backend_module
from vitattn.kernels import configs
from vitattn.kernels.backend import TritonBackend

triton = pytest.importorskip("triton")
from vitattn.kernels import ops  # noqa: E402  (imports triton)

# in this process if triton is interpreted here, else in the interpreter child run (see conftest.py)
interpreted = pytest.mark.triton_interpreter

TOL = {  # dtype -> (forward, gradients): max-abs error relative to the reference's max-abs
    torch.float32: (1e-5, 2e-5),
    torch.float16: (3e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 4e-2),
}


@dataclass
class Case:
    normalizer: str
    kind: str  # none | gaussian | gaussian_keep | gaussian_add | gaussian_add_full | add | add_full | keep |
    # key_padding | bias_and_mask
    n: int = 37
    d: int = 16
    dtype: torch.dtype = torch.float32
    b: int = 2
    h: int = 2
    prefix: int = 1
    grid: tuple[int, int] = (6, 6)
    initial: tuple[int, int] | None = None
    mag: float = 2.0  # scale of q, k, v: larger gives sparser entmax rows and more Newton passes
    seed: int = 0
    signed: bool = False  # Gaussian amplitudes of either sign (GAug's gated identity start), else >= 0


def _make(case: Case):
    """Leaves for the kernel (``ours``) and float64 copies for the reference (``ref``), plus the kwargs."""
    g = torch.Generator().manual_seed(case.seed)
    b, h, n, d = case.b, case.h, case.n, case.d
    base = [torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * case.mag for _ in range(3)]
    ours = {name: t.to(case.dtype).requires_grad_() for name, t in zip("qkv", base, strict=True)}
    mask = None
    extra: dict[str, torch.Tensor] = {}
    if case.kind.startswith("gaussian"):
        n_p = case.grid[0] * case.grid[1]
        assert n == case.prefix + n_p
        gb = 1 if case.prefix == 1 else b  # broadcast over the batch (stride 0) or not
        extra["sigma"] = torch.exp(torch.randn(gb, h, n_p, 2, generator=g) * 0.7)
        extra["alpha"] = torch.rand(gb, h, n_p, 1, generator=g) * 3
        if case.signed:
            extra["alpha"] = extra["alpha"] * 2 - 3  # in [-3, 3]
    if case.kind in ("add", "bias_and_mask", "gaussian_add"):
        extra["add"] = (torch.randn(1, h, n, n, generator=g) * 2).to(case.dtype)
        extra["add"][..., 3] = float("-inf")
    if case.kind in ("add_full", "gaussian_add_full"):
        extra["add"] = (torch.randn(b, h, n, n, generator=g) * 2).to(case.dtype)
    if case.kind in ("keep", "gaussian_keep"):
        mask = torch.rand(b, 1, n, n, generator=g) < 0.6
        mask[..., 0] = True
    if case.kind == "key_padding":
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
        mask[0, ..., -5:] = False
    if case.kind == "bias_and_mask":
        extra["bias"] = torch.randn(b, 1, 1, n, generator=g).to(case.dtype)
    ours.update({k: t.detach().clone().requires_grad_() for k, t in extra.items()})
    ref = {k: t.detach().double().requires_grad_() for k, t in ours.items()}
    return ours, ref, mask


def _kwargs(leaves, case: Case, mask):
    kw = dict(normalizer=case.normalizer, mask=mask)
    if "sigma" in leaves:
        kw["bias"] = GaussianBias(
            leaves["sigma"], leaves["alpha"], case.grid, case.prefix, initial_grid_size=case.initial
        )
    if "add" in leaves:
        kw["mask"] = leaves["add"]
    if "bias" in leaves:
        kw["bias"] = leaves["bias"]
    return kw


def check(case: Case) -> None:
    ours, ref, mask = _make(case)
    out = attention(ours["q"], ours["k"], ours["v"], backend="triton", **_kwargs(ours, case, mask))
    expect = attention(ref["q"], ref["k"], ref["v"], backend="reference", **_kwargs(ref, case, mask))
    assert out.dtype == case.dtype and out.shape == expect.shape
    fwd_tol, grad_tol = TOL[case.dtype]
    err = ((out.double() - expect).abs().max() / expect.abs().max()).item()
    assert err <= fwd_tol, f"out: relative error {err:.2e} > {fwd_tol:.0e}"
    grad = torch.randn(expect.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, list(ours.values()), grad.to(case.dtype))
    want = torch.autograd.grad(expect, list(ref.values()), grad)
    for name, a, w in zip(ours, got, want, strict=True):
        assert a.shape == w.shape and torch.isfinite(a).all(), name
        top = w.abs().max().clamp_min(1e-6)
        err = ((a.double() - w).abs().max() / top).item()
        assert err <= grad_tol, f"d{name}: relative error {err:.2e} > {grad_tol:.0e}"


# A representative subset of normalizer x bias x shape (N in 37 / 77 / 130, D in 16 / 32 / 64,
# prefix 0 / 1 / 2, non-square grids, a resolution change whose clamp binds).
F32_CASES = [
    Case("softmax", "none", n=77, d=32, prefix=0, grid=(7, 11)),
    Case("softmax", "gaussian", n=37, d=16, prefix=1, grid=(6, 6)),
    Case("softmax", "gaussian", n=130, d=64, prefix=2, grid=(8, 16), b=1),
    Case("softmax", "gaussian_keep", n=77, d=32, prefix=0, grid=(7, 11), initial=(4, 4)),
    Case("softmax", "add", n=77, d=16),
    Case("softmax", "add_full", n=37, d=32),
    Case("softmax", "keep", n=130, d=16, b=1),
    Case("softmax", "key_padding", n=37, d=64),
    Case("softmax", "bias_and_mask", n=37, d=16),
    Case("entmax15", "none", n=130, d=16, b=1),
    Case("entmax15", "gaussian", n=77, d=32, prefix=0, grid=(7, 11)),
    Case("entmax15", "gaussian", n=37, d=64, prefix=1, grid=(6, 6), initial=(4, 4)),
    Case("entmax15", "gaussian_keep", n=130, d=16, prefix=2, grid=(8, 16), b=1),
    Case("entmax15", "add", n=37, d=32),
    Case("entmax15", "add_full", n=37, d=16),
    Case("entmax15", "keep", n=77, d=64),
    Case("entmax15", "key_padding", n=37, d=16),
    Case("entmax15", "bias_and_mask", n=77, d=16),
    Case("softmax", "keep", n=37, d=128, b=1, mag=1.0),
    Case("entmax15", "gaussian", n=37, d=128, b=1, mag=1.0),
    Case("softmax", "add", n=77, d=24, mag=6.0),
    Case("entmax15", "key_padding", n=77, d=40, mag=6.0),
    Case("entmax15", "none", n=37, d=16, mag=0.2),
    Case("softmax", "gaussian", n=37, d=16, prefix=1, grid=(6, 6), signed=True),
    Case("entmax15", "gaussian", n=77, d=32, prefix=0, grid=(7, 11), signed=True),
    # the grid-aligned key tiles of the Gaussian bias (interpreter tiles: 32 keys): whole tiles (no prefix,
    # the grid width a power of two, whole rows per tile), grid rows wider than a tile (two chunks of
    # columns), prefix keys filling tiles of their own, a padded grid width with an additive mask whose
    # gradient is stored (per (b, h)) or added atomically (broadcast over the batch), tiles of one whole
    # grid row of an unpadded grid after prefix keys (the forward's flat K / V descriptors)
    Case("softmax", "gaussian", n=64, d=16, prefix=0, grid=(4, 16), b=1),
    Case("softmax", "gaussian", n=98, d=16, prefix=2, grid=(3, 32), b=1),
    Case("softmax", "gaussian", n=122, d=16, prefix=2, grid=(3, 40), b=1),
    Case("softmax", "gaussian", n=60, d=16, prefix=40, grid=(4, 5), b=1),
    Case("softmax", "gaussian_add_full", n=37, d=16, prefix=1, grid=(6, 6)),
    Case("softmax", "gaussian_add", n=77, d=32, prefix=0, grid=(7, 11)),
    Case("entmax15", "gaussian_add_full", n=122, d=16, prefix=2, grid=(3, 40), b=1),
    Case("entmax15", "gaussian", n=64, d=16, prefix=0, grid=(4, 16), b=1),
]

HALF_CASES = [
    Case("softmax", "gaussian", n=77, d=32, prefix=0, grid=(7, 11), dtype=torch.float16),
    Case("softmax", "add", n=37, d=64, dtype=torch.float16),
    Case("entmax15", "gaussian_keep", n=37, d=32, dtype=torch.float16),
    Case("entmax15", "key_padding", n=77, d=16, dtype=torch.float16),
    Case("entmax15", "gaussian", n=130, d=64, prefix=2, grid=(8, 16), b=1, dtype=torch.float16),
    Case("softmax", "gaussian", n=37, d=16, dtype=torch.bfloat16),
    Case("entmax15", "gaussian", n=37, d=32, dtype=torch.bfloat16),
]


def _id(case: Case) -> str:
    name = f"{case.normalizer}-{case.kind}-N{case.n}-D{case.d}-P{case.prefix}-{str(case.dtype)[6:]}"
    return f"{name}-signed" if case.signed else name


@interpreted
@pytest.mark.parametrize("case", F32_CASES, ids=_id)
def test_float32_matches_reference(case):
    check(case)


@interpreted
@pytest.mark.parametrize("case", HALF_CASES, ids=_id)
def test_half_precision_matches_reference(case):
    check(case)


POINTER_CASES = [
    Case("softmax", "gaussian", n=130, d=64, prefix=2, grid=(8, 16), b=1),
    Case("softmax", "gaussian_add", n=122, d=16, prefix=2, grid=(3, 40), b=1),
    Case("softmax", "none", n=77, d=24, prefix=0),
    Case("softmax", "gaussian", n=37, d=32, dtype=torch.float16),
]


@interpreted
@pytest.mark.parametrize("case", POINTER_CASES, ids=_id)
def test_pointer_loads_match_reference(case, monkeypatch):
    """The K / V tiles through pointers (sm_80, and where TMA cannot read the tensors) instead of the
    tensor descriptors the interpreter runs by default (sm_90's path)."""
    monkeypatch.setenv("VITATTN_KV_TMA", "0")
    check(case)


@interpreted
@pytest.mark.parametrize(
    "case",
    [
        Case("softmax", "gaussian", n=130, d=64, prefix=2, grid=(8, 16), b=1),
        Case("softmax", "gaussian_add", n=122, d=16, prefix=2, grid=(3, 40), b=1),
        Case("softmax", "add", n=77, d=24, prefix=0),
    ],
    ids=_id,
)
def test_backward_64_bit_offsets_match_reference(case, monkeypatch):
    """The backward's tile offsets in 64 bits (``OFFS32`` off: tensors whose offsets pass 2^31) instead of
    the 32-bit offsets every test tensor fits."""
    assert ops.offsets_fit_i32(_launch_of(case))
    monkeypatch.setattr(ops, "I32_LIMIT", 1)
    assert not ops.offsets_fit_i32(_launch_of(case))
    check(case)


def _launch_of(case: Case) -> ops.KernelLaunch:
    """A launch of ``case``'s shapes on meta tensors (q, k, v contiguous; no bias: the offsets' check
    reads only the shapes, strides and the grid width)."""
    q, k, v = (torch.empty(case.b, case.h, case.n, case.d, device="meta") for _ in range(3))
    args = (None, None, None, None, case.d**-0.5, case.prefix, case.grid[1], 0.0, False, False)
    return ops.KernelLaunch(q, k, v, *args)


def test_offsets_fit_i32_sees_large_strides():
    """A query tensor whose row stride passes 2^31 over its rows (a strided view) needs 64-bit offsets."""
    q = torch.empty(1, 1, 64, 16, device="meta")
    big = torch.empty_strided((1, 1, 64, 16), (0, 0, 2**26, 1), device="meta")
    assert ops.offsets_fit_i32(
        ops.KernelLaunch(q, q, q, None, None, None, None, 0.25, 0, 1, 0.0, False, False)
    )
    launch = ops.KernelLaunch(big, q, q, None, None, None, None, 0.25, 0, 1, 0.0, False, False)
    assert not ops.offsets_fit_i32(launch)
    assert not ops.offsets_fit_i32(
        ops.KernelLaunch(q, q, q, None, None, None, None, 0.25, 0, 1, 0.0, False, False), 2**31
    )


@pytest.mark.parametrize(
    ("d", "entmax", "gauss", "alpha_entmax", "pays"),
    [
        (64, False, True, False, True),  # grid-aligned Gaussian softmax at head dim 64
        (64, True, False, False, True),  # entmax-1.5's list kernels without bias
        (128, False, False, False, False),  # head dim 128: the offsets' registers spilled
        (64, True, True, False, False),  # list kernels with a Gaussian bias
        (48, False, False, True, False),  # alpha-entmax
    ],
)
def test_tile_offsets_pay_where_measured(d, entmax, gauss, alpha_entmax, pays):
    """``ops.tile_offsets_pay``: the builds of the static report where the held 32-bit offsets spilled do
    not take them (docs/kernels.md, "Tile offsets from a scalar pointer")."""
    n = 64
    q = torch.empty(1, 2, n, d, device="meta")
    den = torch.empty(1, 2, n, 2, device="meta") if gauss else None
    alpha = torch.empty(1, 2, n, device="meta") if gauss else None
    ent = torch.empty(1, 2, n, device="meta") if alpha_entmax else None
    launch = ops.KernelLaunch(
        q, q, q, None, None, den, alpha, d**-0.5, 0, 8 if gauss else 1, 0.0, entmax, False, ent
    )
    assert ops.tile_offsets_pay(launch) is pays
    assert ops.use_tile_offsets(launch) is pays  # these offsets fit: the flag is the measured rule
    assert not ops.use_tile_offsets(launch, 2**31)


@pytest.mark.parametrize(
    ("entmax", "gauss", "alpha_entmax", "window", "lists"),
    [
        (False, True, False, False, False),  # LocAt: the grid-aligned kernels
        (True, True, False, False, False),  # entmax-1.5 + Gaussian: grid-aligned, over its live tiles
        (False, True, True, False, False),  # alpha-entmax + Gaussian: grid-aligned
        (True, False, False, False, True),  # entmax-1.5 without a bias: its live token tiles
        (False, False, True, False, True),  # alpha-entmax without a bias
        (True, True, False, True, True),  # a window: its tile lists
    ],
)
def test_backward_family(entmax, gauss, alpha_entmax, window, lists):
    """``KernelLaunch.list_backward``: a Gaussian bias without a window takes the grid-aligned backward
    for every normalizer (the bias per tile), which holds its tile offsets at head dim 64."""
    n, d = 64, 64
    q = torch.empty(1, 2, n, d, device="meta")
    den = torch.empty(1, 2, n, 2, device="meta") if gauss else None
    alpha = torch.empty(1, 2, n, device="meta") if gauss else None
    ent = torch.empty(1, 2, n, device="meta") if alpha_entmax else None
    win = WindowMask((8, 8), (3, 3)) if window else None
    launch = ops.KernelLaunch(q, q, q, None, None, den, alpha, d**-0.5, 0, 8, 0.0, entmax, False, ent, win)
    assert launch.list_backward is lists
    if not lists:
        assert ops.use_tile_offsets(launch, lists=False)


@interpreted
@pytest.mark.parametrize(
    "case",
    [
        Case("softmax", "gaussian", n=98, d=16, prefix=2, grid=(3, 32), b=1),
        Case("softmax", "keep", n=77, d=32),
        Case("entmax15", "gaussian_keep", n=77, d=32, prefix=0, grid=(7, 11)),
    ],
    ids=_id,
)
def test_sm80_forwards_sum_whole_rows(case):
    """On sm_80 the forwards sum each tile's rows (``configs.ROW_PARTS_BY_ARCH``: one part, the
    ``PARTS = 1`` path of ``row_partial_sums``) instead of keeping partial sums."""
    assert configs.ROW_PARTS_BY_ARCH[80] == 1
    with ops.assume_arch(80):
        check(case)


@interpreted
@pytest.mark.parametrize("tiles", [(16, 32), (32, 16)], ids=["M16xN32", "M32xN16"])
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_unequal_tiles(normalizer, tiles, monkeypatch):
    monkeypatch.setattr(configs, "INTERPRET", configs.TileConfig(*tiles, 4, 1))
    check(Case(normalizer, "gaussian_keep", n=37, d=16, b=1))


@interpreted
@pytest.mark.parametrize(
    ("tile", "widths", "by_rows"),
    [
        ((32, 32), {"fwd_softmax": 16, "bwd_dkdv": 32, "bwd_dq": 16}, {}),
        ((16, 32), {"fwd_softmax": 32, "bwd_dkdv": 16, "bwd_dq": 32}, {("bwd_dkdv", 16): 32}),
    ],
    ids=["narrow-fwd-dq", "by-rows"],
)
@pytest.mark.parametrize(
    "case",
    [
        Case("softmax", "gaussian", n=122, d=16, prefix=2, grid=(3, 40), b=1),
        Case("softmax", "gaussian_add", n=77, d=32, prefix=0, grid=(7, 11)),
    ],
    ids=_id,
)
def test_grid_tile_widths(case, tile, widths, by_rows, monkeypatch):
    """Grid-aligned key tiles narrower than ``min(GWP, BLOCK_N)`` (several chunks of grid columns per
    grid row, two or more grid rows per tile) and a width chosen per query-tile height
    (``configs.GRID_TILE_W_BY_ROWS``): the kernels, the dK/dV program count and the ``EVEN_N`` flags
    agree, and the numbers are the reference's."""
    monkeypatch.setattr(configs, "INTERPRET", configs.TileConfig(*tile, 4, 1))
    monkeypatch.setattr(configs, "GRID_TILE_W", widths)
    monkeypatch.setattr(configs, "GRID_TILE_W_BY_ROWS", by_rows)
    check(case)


@interpreted
@pytest.mark.parametrize("pair", [True, False], ids=["pair", "no-pair"])
def test_dq_two_grid_rows_per_tile(pair, monkeypatch):
    """dQ's key tiles of two grid rows: taken apart (two vectors of row factors, sm_90's path) or as one
    ``(BLOCK_M, 2)`` tensor (sm_80's, ``configs.DQ_ROW_PAIR_BY_ARCH``), with prefix keys and a last partial
    tile: the numbers are the reference's either way."""
    monkeypatch.setattr(configs, "INTERPRET", configs.TileConfig(32, 32, 4, 1))
    monkeypatch.setattr(configs, "GRID_TILE_W", {"fwd_softmax": 32, "bwd_dkdv": 32, "bwd_dq": 16})
    monkeypatch.setattr(configs, "DQ_ROW_PAIR_BY_ARCH", dict.fromkeys(configs.DQ_ROW_PAIR_BY_ARCH, pair))
    check(Case("softmax", "gaussian_add", n=102, d=16, prefix=2, grid=(5, 20), b=1))


@interpreted
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_cross_attention_strides_and_value_dim(normalizer):
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(2, 21, 3, 24, generator=g) * 2).transpose(1, 2)  # (B, H, Nq, D), not contiguous
    k = (torch.randn(2, 3, 24, 50, generator=g) * 2).transpose(-1, -2)  # (B, H, Nk, D), D-stride != 1
    v = torch.randn(2, 3, 50, 40, generator=g)  # Dv = 40 != D
    mask = torch.ones(2, 1, 1, 50, dtype=torch.bool)
    mask[1, ..., :7] = False
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, normalizer=normalizer, mask=mask, scale=0.3, backend="triton")
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = attention(*ref_leaves, normalizer=normalizer, mask=mask, scale=0.3, backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    grad = torch.randn(ref.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad.float())
    for a, w in zip(got, torch.autograd.grad(ref, ref_leaves, grad), strict=True):
        torch.testing.assert_close(a.double(), w, atol=1e-4, rtol=0)


@interpreted
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_fully_masked_rows_give_zeros(normalizer, mask_dtype):
    q, k, v = (torch.randn(1, 2, 37, 16, requires_grad=True) for _ in range(3))
    keep = torch.rand(1, 2, 37, 37) < 0.5
    keep[..., 0] = True
    keep[0, 1, 5] = False
    keep[0, 0, 30:] = False
    mask = keep if mask_dtype == torch.bool else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    if mask_dtype != torch.bool:
        mask.requires_grad_()
    out = attention(q, k, v, normalizer=normalizer, mask=mask, backend="triton")
    assert torch.equal(out[0, 1, 5], torch.zeros(16)) and torch.equal(out[0, 0, 30:], torch.zeros(7, 16))
    assert not out.isnan().any()
    leaves = [q, k, v] + ([mask] if mask.requires_grad else [])
    grads = torch.autograd.grad(out.sum(), leaves)
    for t in grads:
        assert torch.isfinite(t).all()
    assert torch.equal(grads[0][0, 1, 5], torch.zeros(16))
    ref = attention(q, k, v, normalizer=normalizer, mask=mask, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


@interpreted
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_inference_without_gradients(normalizer):
    q, k, v = (torch.randn(1, 2, 37, 32) * 2 for _ in range(3))
    with torch.no_grad():
        out = attention(q, k, v, normalizer=normalizer, backend="triton")
    ref = attention(q, k, v, normalizer=normalizer, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


# ---- dispatch -----------------------------------------------------------------------------------------


def _call(q, **kw) -> AttentionCall:
    base = dict(normalizer="softmax", scale=0.5, mask=None, bias=None, return_weights=False, dropout_p=0.0)
    base.update(kw)
    return AttentionCall(q, q, q, **base)


@interpreted
def test_reasons_name_the_failed_condition(monkeypatch):
    backend = TritonBackend()
    q = torch.randn(1, 2, 5, 16)
    assert backend.unsupported(_call(q), explicit=True) is None
    assert "backend='auto' runs the Triton kernels on CUDA only" in backend.unsupported(_call(q))
    assert "float64" in backend.unsupported(_call(q.double()), explicit=True)
    assert "head dim" in backend.unsupported(_call(torch.randn(1, 1, 4, 160)), explicit=True)
    assert "return_weights=True" in backend.unsupported(_call(q, return_weights=True), explicit=True)
    assert "dropout_p" in backend.unsupported(_call(q, dropout_p=0.1), explicit=True)
    assert "not softmax or entmax15" in backend.unsupported(_call(q, normalizer="sparsemax"), explicit=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "not CUDA, and TRITON_INTERPRET is unset" in backend.unsupported(_call(q), explicit=True)
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: q is on cpu, not CUDA"):
        attention(q, q, q, backend="triton")


@interpreted
def test_a_gaussian_bias_past_the_exact_coordinates_is_declined(monkeypatch):
    """The kernels' float32 grid coordinates are exact below ``MAX_GAUSSIAN_TOKENS`` tokens; at or past it
    the backend declines with the count (lowered here: 26 tokens, a class token and a 5 x 5 grid)."""
    q = torch.randn(1, 2, 26, 16)
    sigma, alpha = torch.full((1, 2, 25, 2), 2.0), torch.ones(1, 2, 25, 1)
    call = _call(q, bias=GaussianBias(sigma, alpha, (5, 5), num_prefix_tokens=1))
    assert TritonBackend().unsupported(call, explicit=True) is None
    monkeypatch.setattr(backend_module, "MAX_GAUSSIAN_TOKENS", 26)
    reason = TritonBackend().unsupported(call, explicit=True)
    assert reason is not None and "GaussianBias over N = 26 tokens" in reason and "below 26 tokens" in reason


@interpreted
def test_explicit_backend_errors_say_why():
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match=r"backend='triton' cannot run this call: return_weights=True"):
        attention(q, q, q, backend="triton", return_weights=True)
    with pytest.raises(ValueError, match="dtype torch.float64 is not one of"):
        attention(q.double(), q.double(), q.double(), backend="triton")
    with pytest.raises(ValueError, match=r"normalizer 1.3 is not softmax or entmax15"):
        attention(q, q, q, backend="triton", normalizer=1.3)


@interpreted
def test_auto_uses_torch_on_cpu_even_when_interpreting():
    q = torch.randn(1, 2, 5, 16)
    with mock.patch.object(TritonBackend, "run", side_effect=AssertionError("auto chose triton on CPU")):
        attention(q, q, q, backend="auto")
        attention(q, q, q, backend="auto", normalizer="entmax15")
    assert "backend='auto' runs the Triton kernels on CUDA only" in explain(_call(q))["triton"]
    assert TritonBackend().unsupported(_call(q), explicit=True) is None  # by name, the interpreter runs it


def test_package_imports_and_falls_back_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, vitattn\n"
        "from vitattn.functional import attention, explain\n"
        "from vitattn.functional.dispatch import AttentionCall\n"
        "q = torch.randn(1, 2, 5, 8)\n"
        "assert attention(q, q, q).shape == q.shape\n"
        "r = explain(AttentionCall(q, q, q, 'softmax', 0.5, None, None, False, 0.0))['triton']\n"
        "assert r == 'triton is not installed', r\n"
        "assert 'vitattn.kernels.ops' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def test_kernels_are_not_imported_until_used():
    code = (
        "import sys, torch, vitattn\n"
        "from vitattn.functional import attention\n"
        "q = torch.randn(1, 2, 5, 8)\n"
        "attention(q, q, q)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('vitattn.kernels.'))\n"
        "assert loaded == ['vitattn.kernels.backend', 'vitattn.kernels.env'], loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
