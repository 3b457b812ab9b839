"""entmax15 against the `entmax` package (values, gradients), gradcheck, masks, dtypes and errors."""

from __future__ import annotations

import importlib
import math

import entmax as entmax_pkg
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vitattn.functional import entmax15
from vitattn.functional.entmax15 import entmax15_threshold

NEG_INF = float("-inf")


@st.composite
def rows_with_masks(draw, max_dims: int = 3, max_size: int = 24):
    """A float64 tensor with random -inf entries (every slice along ``dim`` keeps one finite entry)."""
    ndim = draw(st.integers(1, max_dims))
    shape = tuple(draw(st.lists(st.integers(1, max_size), min_size=ndim, max_size=ndim)))
    dim = draw(st.integers(-ndim, ndim - 1))
    scale = draw(st.sampled_from([1e-3, 0.1, 1.0, 3.0, 30.0, 1e4]))
    seed = draw(st.integers(0, 2**31 - 1))
    ties = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    if ties:  # few distinct values: many exact ties, also at the threshold
        x = torch.randint(-2, 3, shape, generator=g).to(torch.float64) * scale
    if draw(st.booleans()):
        drop = torch.rand(shape, generator=g) < 0.4
        keep_one = torch.zeros(shape, dtype=torch.bool)
        keep_one.select(dim, 0).fill_(True)
        x = x.masked_fill(drop & ~keep_one, NEG_INF)
    return x, dim


@given(rows_with_masks())
def test_matches_entmax_package_float64(case):
    x, dim = case
    ours = entmax15(x, dim=dim)
    ref = entmax_pkg.entmax15(x, dim=dim)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(ours.sum(dim), torch.ones_like(ours.sum(dim)), atol=1e-12, rtol=0)


@given(rows_with_masks())
def test_gradients_match_entmax_package(case):
    x, dim = case
    g = torch.randn(x.shape, dtype=torch.float64)
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    entmax15(a, dim=dim).backward(g)
    entmax_pkg.entmax15(b, dim=dim).backward(g)
    torch.testing.assert_close(a.grad, b.grad.masked_fill(torch.isneginf(x), 0.0), atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", [(2, 3, 197, 197), (1, 2, 785, 785)])
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_attention_sized_rows_float32_and_float64(shape, scale):
    x = torch.randn(shape, dtype=torch.float64) * scale
    ref = entmax_pkg.entmax15(x, dim=-1)
    torch.testing.assert_close(entmax15(x), ref, atol=1e-8, rtol=0)
    torch.testing.assert_close(entmax15(x.float()), ref.float(), atol=1e-5, rtol=0)


def test_support_is_exact_not_approximate():
    # A row where many entries sit just below the threshold: a converged-but-approximate threshold
    # would put them on the support; the exact one does not.
    x = torch.tensor([[2.0, 1.0] + [0.0 - 1e-9 * i for i in range(50)]], dtype=torch.float64)
    ours = entmax15(x)
    ref = entmax_pkg.entmax15(x)
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref, atol=1e-14, rtol=0)


def test_threshold_closed_form_holds():
    z = torch.randn(5, 40, dtype=torch.float64) * 2
    x, tau = entmax15_threshold(z)
    p = (x - tau).clamp_min(0) ** 2
    torch.testing.assert_close(p.sum(-1), torch.ones(5, dtype=torch.float64), atol=1e-14, rtol=0)


def test_fully_masked_rows_give_zeros_and_zero_grads():
    x = torch.randn(3, 4, 9, dtype=torch.float64)
    x[0, 1] = NEG_INF
    x[2, :] = NEG_INF
    x.requires_grad_()
    p = entmax15(x)
    assert not p.isnan().any()
    assert torch.equal(p[0, 1], torch.zeros(9, dtype=torch.float64))
    assert torch.equal(p[2], torch.zeros(4, 9, dtype=torch.float64))
    torch.testing.assert_close(p[1].sum(-1), torch.ones(4, dtype=torch.float64))
    p.backward(torch.randn_like(p))
    assert not x.grad.isnan().any()
    assert torch.equal(x.grad[2], torch.zeros(4, 9, dtype=torch.float64))


def test_single_element_and_uniform_rows():
    assert torch.equal(entmax15(torch.tensor([[3.0]])), torch.tensor([[1.0]]))
    n = 37
    torch.testing.assert_close(entmax15(torch.zeros(2, n)), torch.full((2, n), 1.0 / n))


@pytest.mark.parametrize("magnitude", [1e6, 1e20, 1e30])
def test_huge_magnitudes_float32(magnitude):
    x = torch.randn(4, 33) * magnitude
    p = entmax15(x)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p, entmax_pkg.entmax15(x.double()).float(), atol=1e-6, rtol=0)


def test_gradcheck_float64():
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: entmax15(t, dim=-1), (x,))
    y = torch.randn(6, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: entmax15(t, dim=1), (y,))
    # masked entries: gradcheck perturbs finite entries only where -inf is kept out
    z = torch.randn(4, 6, dtype=torch.float64)
    z[:, :2] = -50.0  # far off the support: zero gradient, like a mask
    assert torch.autograd.gradcheck(entmax15, (z.requires_grad_(),))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_computed_in_float32(dtype):
    x = (torch.randn(3, 5, 50) * 3).to(dtype)
    x.requires_grad_()
    p = entmax15(x)
    assert p.dtype == dtype
    ref = entmax_pkg.entmax15(x.detach().float())
    torch.testing.assert_close(p.float(), ref, atol=4e-3, rtol=0)
    p.float().pow(2).sum().backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()


def test_fixed_steps_give_the_same_probabilities(monkeypatch):
    """Under torch.compile the search takes a fixed number of Newton steps and the closed form for every
    row (no data-dependent exit): decided once, at the normalizer's entry, and exact all the same."""
    mod = importlib.import_module("vitattn.functional.entmax15")  # the module, not the function

    x = torch.randn(3, 40, 50, dtype=torch.float64, requires_grad=True) * 2
    g = torch.randn_like(x)
    eager = entmax15(x)
    (ge,) = torch.autograd.grad(eager, x, g)
    monkeypatch.setattr(mod.torch.compiler, "is_compiling", lambda: True)
    fixed = entmax15(x)
    (gf,) = torch.autograd.grad(fixed, x, g)
    torch.testing.assert_close(eager, fixed, atol=1e-15, rtol=0)
    torch.testing.assert_close(ge, gf, atol=1e-14, rtol=0)
    torch.testing.assert_close(fixed, entmax_pkg.entmax15(x, dim=-1), atol=1e-12, rtol=0)


def test_sparsity_grows_with_scale():
    x = torch.randn(64, 100, dtype=torch.float64)
    nnz = [int((entmax15(x * s) > 0).sum()) for s in (0.1, 1.0, 10.0)]
    assert nnz[0] > nnz[1] > nnz[2] >= 64
    assert math.isclose(float(entmax15(x * 1e3).max(-1).values.min()), 1.0)


def test_compiles_without_graph_breaks():
    compiled = torch.compile(entmax15, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 3, 29, dtype=torch.float64)
    torch.testing.assert_close(compiled(x), entmax_pkg.entmax15(x, dim=-1), atol=1e-10, rtol=0)


def test_errors_name_argument_and_shape():
    with pytest.raises(TypeError, match="floating-point"):
        entmax15(torch.arange(4))
    with pytest.raises(ValueError, match=r"dim=3 is out of range for x of shape \(2, 3\)"):
        entmax15(torch.randn(2, 3), dim=3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        entmax15([1.0, 2.0])  # type: ignore[arg-type]


@pytest.mark.parametrize("early_step", [10.0, 0.05, 0.0])
def test_early_closed_form_and_its_fallback_are_exact(monkeypatch, early_step):
    """The closed form after a loose Newton search is checked row by row; rows whose support is not
    settled continue Newton. A huge early step (one Newton step, most rows fall back) and none at all
    give the package's result too."""
    mod = importlib.import_module("vitattn.functional.entmax15")
    monkeypatch.setattr(mod, "_EARLY_STEP", early_step)
    fallbacks = []
    original = mod._closed_form_and_count

    def spy(x, tau, work):
        fallbacks.append(x.shape[0])
        return original(x, tau, work)

    monkeypatch.setattr(mod, "_closed_form_and_count", spy)
    x = torch.randn(300, 197, dtype=torch.float64) * 3
    x[:5, :100] = 0.0  # exact ties among the top entries
    ref = entmax_pkg.entmax15(x, dim=-1)
    torch.testing.assert_close(entmax15(x), ref, atol=1e-12, rtol=0)
    first_call = list(fallbacks)  # the closed form for all 300 rows, then for the unsettled ones if any
    torch.testing.assert_close(entmax15(x.float()), ref.float(), atol=1e-6, rtol=0)
    if early_step == 10.0:
        assert len(first_call) == 2 and first_call[1] > 30  # many rows not settled after one Newton step
    g = torch.randn_like(x)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    entmax15(a).backward(g)
    entmax_pkg.entmax15(b, dim=-1).backward(g)
    torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=0)


def test_backward_keeps_sqrt_p_only_when_a_gradient_is_needed():
    saved = []
    x = torch.randn(4, 50, dtype=torch.float64)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        p = entmax15(x)  # no gradient: nothing saved
        assert saved == []
        q = entmax15(x.clone().requires_grad_())
    (g,) = saved
    torch.testing.assert_close(g.square(), q.detach(), atol=0, rtol=0)
    torch.testing.assert_close(p, q.detach(), atol=0, rtol=0)


def test_inference_mode_then_autograd_then_new_values():
    """Inference mode first, then autograd, then other values: each call is on its own."""
    x = torch.randn(6, 40, dtype=torch.float64) * 2
    ref = entmax_pkg.entmax15(x, dim=-1)
    with torch.inference_mode():
        first = entmax15(x)
    a = x.clone().requires_grad_()
    second = entmax15(a)
    second.sum().backward()
    third = entmax15(x * 3)
    torch.testing.assert_close(first, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(second.detach(), ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(third, entmax_pkg.entmax15(x * 3, dim=-1), atol=1e-12, rtol=0)
