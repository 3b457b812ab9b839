"""Tests of vitattn.functional.entmax_alpha: exact sparsemax and general alpha-entmax."""

from __future__ import annotations

import math
import os

import entmax as entmax_ref
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck, gradgradcheck

from vitattn.functional.entmax_alpha import _entmax_forward, entmax, sparsemax

F64 = torch.float64
NEG_INF = -math.inf
ALPHAS = [1.1, 1.25, 1.33, 1.75, 2.5, 3.0]
EPS64 = torch.finfo(F64).eps

SETTINGS = settings(max_examples=int(os.environ.get("VITATTN_HYPOTHESIS_EXAMPLES", "100")), deadline=None)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def value_atol(alpha: float) -> float:
    """float64 tolerance on probabilities.

    For alpha <= 2 the map is well conditioned (errors ~1e-15 are observed). For alpha > 2,
    p = u^(1/(alpha-1)) has an infinite slope at u = 0: an entry within rounding (~eps) of the
    threshold gets p ~ eps^(1/(alpha-1)) in one implementation and 0 in the other, so the
    tolerance has to be of that order (1.5e-8 for alpha = 3).
    """
    if alpha <= 2.0:
        return 1e-10
    return max(1e-10, 10.0 * (4.0 * EPS64) ** (1.0 / (alpha - 1.0)))


@st.composite
def scores(draw: st.DrawFn, max_rank: int = 3, max_size: int = 9) -> tuple[torch.Tensor, int]:
    """float64 scores (normal, ties, huge scale, -inf masks, fully masked rows) and a dim."""
    rank = draw(st.integers(1, max_rank))
    shape = tuple(draw(st.lists(st.integers(1, max_size), min_size=rank, max_size=rank)))
    dim = draw(st.integers(-rank, rank - 1))
    kind = draw(st.sampled_from(["normal", "ties", "huge", "tiny"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "ties":  # few distinct dyadic values: many exact ties
        x = torch.randint(-3, 4, shape, generator=gen).to(F64) * 0.5
    else:
        scale = {"normal": draw(st.sampled_from([0.3, 1.0, 3.0, 10.0])), "huge": 1e4, "tiny": 1e-3}[kind]
        x = torch.randn(shape, generator=gen, dtype=F64) * scale
        if kind == "huge":
            x = x + 1e4
    mask_p = draw(st.sampled_from([0.0, 0.0, 0.3, 0.8]))
    if mask_p > 0:
        x = x.masked_fill(torch.rand(shape, generator=gen) < mask_p, NEG_INF)
    if draw(st.booleans()):  # some fully masked rows
        row_shape = tuple(1 if i == dim % rank else s for i, s in enumerate(shape))
        dead = torch.rand(row_shape, generator=gen) < 0.4
        x = x.masked_fill(dead.expand(shape), NEG_INF)
    return x, dim


def dead_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.isneginf(x).all(dim, keepdim=True)


def finite_reference_input(x: torch.Tensor, dim: int, alpha: float) -> torch.Tensor:
    """Shift rows to max 0 and replace -inf by a value that surely gets probability 0.

    The ``entmax`` package does not handle -inf, and its bisection loses precision on unshifted
    1e4-scale scores; both transformations leave the exact result unchanged.
    """
    dead = dead_rows(x, dim)
    x_max = torch.where(dead, 0.0, x.amax(dim, keepdim=True))
    z = x - x_max
    return torch.where(torch.isneginf(z), -(2.0 / (alpha - 1.0) + 10.0), z)


def ref_entmax(x: torch.Tensor, alpha: float, dim: int) -> torch.Tensor:
    xr = finite_reference_input(x, dim, alpha)
    if alpha == 2.0:
        return entmax_ref.sparsemax(xr, dim=dim)
    return entmax_ref.entmax_bisect(xr, alpha, dim=dim, n_iter=100)


def vjp(fn, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xr = x.detach().clone().requires_grad_(True)
    y = fn(xr)
    (grad,) = torch.autograd.grad(y, xr, dy)
    return y.detach(), grad


def check_against_reference(x: torch.Tensor, dim: int, alpha: float) -> None:
    fn = (lambda t: sparsemax(t, dim)) if alpha == 2.0 else (lambda t: entmax(t, alpha, dim))
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=F64)
    y, gx = vjp(fn, x, dy)
    dead = dead_rows(x, dim).expand(x.shape)
    assert not torch.isnan(y).any() and not torch.isnan(gx).any()
    assert (y >= 0).all()
    # fully masked rows: zeros and zero gradient; others sum to one, -inf entries get 0 and no gradient
    assert (y[dead] == 0).all() and (gx[dead] == 0).all()
    assert (y[torch.isneginf(x)] == 0).all() and (gx[torch.isneginf(x)] == 0).all()
    sums = y.sum(dim, keepdim=True)
    live = ~dead_rows(x, dim)
    torch.testing.assert_close(sums[live], torch.ones_like(sums[live]), atol=1e-12, rtol=0)

    ref_fn = lambda t: ref_entmax(t, alpha, dim)  # noqa: E731
    y_ref, gx_ref = vjp(ref_fn, x, dy)
    atol = value_atol(alpha)
    torch.testing.assert_close(y[~dead], y_ref[~dead], atol=atol, rtol=0)
    if alpha <= 2.0:
        g_scale = 1.0 + gx_ref.abs().max().item()
        torch.testing.assert_close(gx[~dead], gx_ref[~dead], atol=1e-8 * g_scale, rtol=0)
    else:
        # g = p^(2-alpha) is unbounded near the support boundary; compare where both agree on
        # which entries are clearly inside the support.
        clear = ((y > 1e-4) | (y == 0)) & ((y_ref > 1e-4) | (y_ref == 0))
        rows_ok = clear.all(dim, keepdim=True).expand(x.shape) & ~dead
        g_scale = 1.0 + gx_ref[rows_ok].abs().max().item() if rows_ok.any() else 1.0
        torch.testing.assert_close(gx[rows_ok], gx_ref[rows_ok], atol=1e-6 * g_scale, rtol=0)


# --------------------------------------------------------------------------------------------
# values and gradients against the entmax package
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(scores())
def test_sparsemax_matches_reference(case: tuple[torch.Tensor, int]) -> None:
    x, dim = case
    check_against_reference(x, dim, 2.0)


@SETTINGS
@given(scores(), st.sampled_from(ALPHAS))
def test_entmax_matches_bisect(case: tuple[torch.Tensor, int], alpha: float) -> None:
    x, dim = case
    check_against_reference(x, dim, alpha)


@pytest.mark.parametrize("alpha", [2.0, *ALPHAS])
@pytest.mark.parametrize("shape,dim", [((4, 197), -1), ((2, 3, 64, 64), -1), ((5, 33, 6), 1), ((40, 3), 0)])
def test_attention_shapes_against_reference(alpha: float, shape: tuple[int, ...], dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen, dtype=F64) * 4.0
    x = x.masked_fill(torch.rand(shape, generator=gen) < 0.2, NEG_INF)
    check_against_reference(x, dim, alpha)


def test_sparsemax_exact_on_michelot_worst_case() -> None:
    # Each Newton step (= Michelot step) drops a single entry: the loop must not stop early.
    z, tau, eps = [0.0, 0.0], -0.5, 1e-12
    for m in range(3, 15):
        eps *= 1.5 * m
        z.append(tau - eps)
        tau = ((m - 1) * tau + z[-1]) / m
    x = torch.tensor(z, dtype=F64)
    x = x[torch.randperm(len(z), generator=torch.Generator().manual_seed(0))]
    torch.testing.assert_close(sparsemax(x), entmax_ref.sparsemax(x, dim=0), atol=1e-15, rtol=0)


def test_ties_give_uniform_support() -> None:
    x = torch.tensor([[3.0, 3.0, 3.0, -30.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    for alpha in [2.0, *ALPHAS]:
        y = entmax(x, alpha)
        torch.testing.assert_close(y[0], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0], dtype=F64))
        torch.testing.assert_close(y[1], torch.full((4,), 0.25, dtype=F64))


def test_huge_magnitudes_float32() -> None:
    x = torch.randn(8, 50, generator=torch.Generator().manual_seed(2)) * 1e4
    for alpha in [2.0, 1.25, 3.0]:
        y = entmax(x, alpha)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.sum(-1), torch.ones(8), atol=1e-6, rtol=0)
        torch.testing.assert_close(y.double(), ref_entmax(x.double(), alpha, -1), atol=1e-5, rtol=0)


def test_general_solver_at_alpha_two_is_sparsemax() -> None:
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(3), dtype=F64) * 2
    torch.testing.assert_close(entmax(x, torch.tensor(2.0, dtype=F64)), sparsemax(x), atol=1e-13, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("alpha", [1.01, 1.1, 1.25, 1.75, 2.5, 3.0, 5.0])
def test_solver_converges_within_cap(dtype: torch.dtype, alpha: float) -> None:
    gen = torch.Generator().manual_seed(4)
    for n, scale in [(2, 1.0), (197, 0.01), (197, 1.0), (197, 10.0), (1024, 3.0)]:
        x = (torch.randn(64, n, generator=gen, dtype=F64) * scale).to(dtype)
        p, iters = _entmax_forward(x, alpha - 1.0, -1, compiling=False)
        assert iters < 60
        torch.testing.assert_close(p.sum(-1), torch.ones(64, dtype=dtype))


# --------------------------------------------------------------------------------------------
# gradients: gradcheck (x and alpha), alpha gradient against the entmax package
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradcheck_x(dim: int) -> None:
    x = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(5), dtype=F64).requires_grad_()
    assert gradcheck(lambda t: sparsemax(t, dim), (x,))
    for alpha in ALPHAS:
        assert gradcheck(lambda t, a=alpha: entmax(t, a, dim), (x,))


@pytest.mark.parametrize("alpha_shape", [(), (1,), (4, 1, 5), (1, 5)])
def test_gradcheck_alpha_tensor(alpha_shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 6, 5, generator=gen, dtype=F64)
    x[0, :2, 0] = NEG_INF
    x.requires_grad_()
    alpha = (1.15 + 1.6 * torch.rand(alpha_shape, generator=gen, dtype=F64)).requires_grad_()
    assert gradcheck(lambda t, a: entmax(t, a, 1), (x, alpha))


def test_gradgradcheck() -> None:
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(7), dtype=F64).requires_grad_()
    alpha = torch.tensor([[1.3], [1.8], [2.4]], dtype=F64, requires_grad=True)
    assert gradgradcheck(lambda t: sparsemax(t), (x,))
    assert gradgradcheck(lambda t, a: entmax(t, a), (x, alpha))


@SETTINGS
@given(scores(max_rank=3, max_size=7), st.floats(1.1, 3.0), st.booleans())
def test_alpha_grad_matches_bisect(case: tuple[torch.Tensor, int], alpha0: float, per_row: bool) -> None:
    x, dim = case
    shape = list(x.shape)
    shape[dim] = 1
    gen = torch.Generator().manual_seed(8)
    alpha = torch.full(shape if per_row else (), alpha0, dtype=F64)
    if per_row:
        alpha = alpha + 0.5 * torch.rand(shape, generator=gen, dtype=F64)
    dy = torch.randn(x.shape, generator=gen, dtype=F64)

    a1 = alpha.clone().requires_grad_()
    y1 = entmax(x, a1, dim)
    (g1,) = torch.autograd.grad(y1, a1, dy)
    a2 = alpha.clone().requires_grad_()
    y2 = entmax_ref.entmax_bisect(finite_reference_input(x, dim, 1.1), a2, dim, n_iter=100)
    (g2,) = torch.autograd.grad(y2, a2, dy)
    assert g1.shape == alpha.shape and g1.dtype == alpha.dtype
    assert torch.isfinite(g1).all()
    if per_row:  # fully masked rows contribute nothing
        assert (g1[dead_rows(x, dim).reshape(g1.shape)] == 0).all()
    # alpha > 2 rows: unbounded sensitivity at the support boundary (see value_atol)
    if (alpha <= 2.0).all():
        torch.testing.assert_close(g1, g2, atol=1e-8 * (1.0 + g2.abs().max().item()), rtol=1e-8)
    else:
        y_ok = ((y1 > 1e-3) | (y1 == 0)).all()
        if y_ok:
            torch.testing.assert_close(g1, g2, atol=1e-5 * (1.0 + g2.abs().max().item()), rtol=1e-5)


def test_alpha_grad_only_alpha_requires_grad() -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(9))
    alpha = torch.tensor(1.4, requires_grad=True)
    entmax(x, alpha).pow(2).sum().backward()
    assert alpha.grad is not None and torch.isfinite(alpha.grad)


# --------------------------------------------------------------------------------------------
# masks, dtypes, shapes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [2.0, 1.25, 3.0, "tensor"])
def test_fully_masked_rows(alpha: float | str) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10), dtype=F64)
    x[1] = NEG_INF
    x[2, :5] = NEG_INF  # a single live entry
    x.requires_grad_()
    a = torch.full((4, 1), 1.6, dtype=F64, requires_grad=True) if alpha == "tensor" else alpha
    y = entmax(x, a)
    assert not torch.isnan(y).any()
    assert (y[1] == 0).all()
    torch.testing.assert_close(y[2], torch.tensor([0, 0, 0, 0, 0, 1.0], dtype=F64))
    y.mul(torch.arange(24, dtype=F64).reshape(4, 6)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all() and (x.grad[2] == 0).all()
    if alpha == "tensor":
        assert torch.isfinite(a.grad).all() and a.grad[1, 0] == 0 and a.grad[2, 0] == 0


def test_all_rows_masked() -> None:
    x = torch.full((2, 3, 5), NEG_INF, requires_grad=True)
    for fn in (lambda t: sparsemax(t, 1), lambda t: entmax(t, 1.7, 1), lambda t: entmax(t, 2.6, -1)):
        y = fn(x)
        assert (y == 0).all()
        (g,) = torch.autograd.grad(y.sum(), x)
        assert (g == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [2.0, 1.25, 2.5, "tensor"])
def test_half_dtypes(dtype: torch.dtype, alpha: float | str) -> None:
    x32 = torch.randn(3, 4, 33, generator=torch.Generator().manual_seed(11)) * 3
    x32[0, 0, :5] = NEG_INF
    x32[0, 1] = NEG_INF
    x = x32.to(dtype).requires_grad_()
    a = torch.tensor(1.6, requires_grad=True) if alpha == "tensor" else alpha
    y = entmax(x, a)
    assert y.dtype == dtype and y.shape == x.shape
    expected = entmax(x.detach().float(), a.detach() if isinstance(a, torch.Tensor) else a)
    torch.testing.assert_close(y.float(), expected, atol=1e-2 if dtype == torch.bfloat16 else 2e-3, rtol=0)
    y.float().pow(2).sum().backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()
    assert (x.grad[0, 1] == 0).all()
    if alpha == "tensor":
        assert a.grad.dtype == torch.float32 and torch.isfinite(a.grad)


def test_float32_matches_float64() -> None:
    x = torch.randn(6, 5, 40, generator=torch.Generator().manual_seed(12), dtype=F64) * 3
    for alpha in [2.0, 1.1, 1.33, 1.75, 2.5]:
        y32 = entmax(x.float(), alpha, dim=1)
        assert y32.dtype == torch.float32
        torch.testing.assert_close(y32.double(), entmax(x, alpha, dim=1), atol=2e-6, rtol=0)


def test_scalar_and_empty_inputs() -> None:
    assert sparsemax(torch.tensor(2.0)).item() == 1.0
    assert entmax(torch.tensor(2.0), 1.3).item() == 1.0
    assert entmax(torch.tensor(2.0), torch.tensor(2.7)).item() == 1.0
    assert entmax(torch.empty(0, 4), 1.3).shape == (0, 4)
    assert sparsemax(torch.empty(3, 0)).shape == (3, 0)
    # a single entry is always probability one
    torch.testing.assert_close(entmax(torch.randn(5, 1), 3.0), torch.ones(5, 1))


def test_dispatch_alpha_two_is_sparsemax() -> None:
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(13))
    assert torch.equal(entmax(x, 2.0), sparsemax(x))
    assert torch.equal(entmax(x, 2), sparsemax(x))


def test_dispatch_alpha_one_and_a_half() -> None:
    mod = pytest.importorskip("vitattn.functional.entmax15")
    x = torch.randn(4, 3, 9, generator=torch.Generator().manual_seed(14), dtype=F64)
    assert torch.equal(entmax(x, 1.5, dim=1), mod.entmax15(x, dim=1))
    general = entmax(x, torch.tensor(1.5, dtype=F64), dim=1)  # the Newton solver, not dispatched
    torch.testing.assert_close(entmax(x, 1.5, dim=1), general, atol=1e-10, rtol=0)


@pytest.mark.slow
def test_torch_compile_fullgraph() -> None:
    # The eager backend traces with dynamo (fixed iteration counts, no graph break) but skips
    # inductor codegen, which would take ~20 s per function on CPU.
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(2, 3, 20, 20, generator=gen)
    x[0, 0, 2] = NEG_INF
    alpha = torch.full((2, 3, 20, 1), 2.5, requires_grad=True)
    cases = [
        (lambda t: sparsemax(t), (x,)),
        (lambda t: entmax(t, 1.3), (x,)),
        (lambda t, a: entmax(t, a), (x, alpha)),
    ]
    for fn, args in cases:
        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        y = compiled(*args)
        torch.testing.assert_close(y, fn(*args), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


def test_errors() -> None:
    x = torch.randn(2, 3, 4)
    for bad in [1.0, 0.5, -2.0, math.inf, math.nan]:
        with pytest.raises(ValueError, match="alpha"):
            entmax(x, bad)
    with pytest.raises(ValueError, match=r"alpha .*\(2, 1, 4\)"):
        entmax(x, torch.tensor([[[1.5, 0.9, 1.5, 2.0]]]).expand(2, 1, 4), dim=1)
    with pytest.raises(ValueError, match=r"alpha of shape \(5\) does not broadcast to x \(2, 3, 4\)"):
        entmax(x, torch.full((5,), 1.5))
    with pytest.raises(ValueError, match=r"alpha of shape \(4\) must have size 1 along dim=2 of x"):
        entmax(x, torch.full((4,), 1.5))
    with pytest.raises(ValueError, match=r"\(2, 3, 1\)"):
        entmax(x, torch.full((2, 3, 4), 1.5), dim=-1)
    with pytest.raises(ValueError, match=r"alpha of shape \(1, 2, 3, 1\) does not broadcast"):
        entmax(x, torch.full((1, 2, 3, 1), 1.5))
    with pytest.raises(ValueError, match=r"dim=3 is out of range for x of shape \(2, 3, 4\)"):
        entmax(x, 1.3, dim=3)
    with pytest.raises(ValueError, match=r"dim=-4 is out of range for x"):
        sparsemax(x, dim=-4)
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got dtype torch.int64"):
        sparsemax(torch.arange(4))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        entmax(torch.arange(4), 1.3)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        sparsemax([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="alpha must be a float or a torch.Tensor"):
        entmax(x, "1.5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="alpha"):
        entmax(x, torch.tensor(True))
