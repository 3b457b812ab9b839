"""Fenchel–Young losses (``vitattn.functional.fy_loss``) against the ``entmax`` package's losses, torch's
cross-entropy / KL, plain float64 restatements and ``torch.autograd.gradcheck``."""

from __future__ import annotations

import entmax
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from vitattn.functional import fy_loss
from vitattn.functional.fy_loss import fy_loss_formula

from .reference_formulas import plain_attention

F64 = torch.float64
NORMALIZERS = ["softmax", "entmax15", "sparsemax", 1.3, 2.5]


def reference_probs(z: torch.Tensor, normalizer: str | float) -> torch.Tensor:
    """The ``entmax`` package's (or torch's) normalizer along the last dim, in float64."""
    if normalizer == "softmax":
        return torch.softmax(z, -1)
    if normalizer == "entmax15":
        return entmax.entmax15(z, dim=-1)
    if normalizer == "sparsemax":
        return entmax.sparsemax(z, dim=-1)
    return entmax.entmax_bisect(z, alpha=float(normalizer), dim=-1, n_iter=200)


def restated_loss(z: torch.Tensor, y: torch.Tensor, normalizer: str | float) -> torch.Tensor:
    """The definition in float64 from the package's probabilities: Ω*(z) − ⟨z, y⟩ + Ω(y), Ω = −H."""
    p = reference_probs(z, normalizer)
    if normalizer == "softmax":
        ent = lambda q: -(q * torch.where(q > 0, q.log(), torch.zeros_like(q))).sum(-1)  # noqa: E731
    else:
        a = {"entmax15": 1.5, "sparsemax": 2.0}.get(normalizer, normalizer)  # type: ignore[arg-type]
        ent = lambda q: (1 - (q**a).sum(-1)) / (a * (a - 1))  # noqa: E731  (rows on the simplex)
    return (z * p).sum(-1) + ent(p) - (z * y).sum(-1) - ent(y)


def rand_rows(*shape: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


# ---- one-hot targets: the entmax package's losses ------------------------------------------------------
PACKAGE_LOSSES = {
    "entmax15": lambda r: entmax.Entmax15Loss(k=None, reduction=r),
    "sparsemax": lambda r: entmax.SparsemaxLoss(k=None, reduction=r),
    1.3: lambda r: entmax.EntmaxBisectLoss(alpha=1.3, n_iter=200, reduction=r),
    2.5: lambda r: entmax.EntmaxBisectLoss(alpha=2.5, n_iter=200, reduction=r),
}


@pytest.mark.parametrize("normalizer", list(PACKAGE_LOSSES), ids=str)
def test_one_hot_equals_the_entmax_package(normalizer: str | float) -> None:
    z = rand_rows(6, 11, seed=1).requires_grad_()
    labels = torch.tensor([0, 3, 10, 5, 5, 7])
    y = F.one_hot(labels, 11).to(F64)
    ours = fy_loss(z, y, normalizer)
    theirs = PACKAGE_LOSSES[normalizer]("none")(z, labels)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-10)
    # the package's default reduction, "elementwise_mean", is the sum over rows / rows
    torch.testing.assert_close(ours.mean(), PACKAGE_LOSSES[normalizer]("elementwise_mean")(z, labels))
    w = rand_rows(6, seed=2)  # an arbitrary upstream gradient per row
    (g_ours,) = torch.autograd.grad((ours * w).sum(), z)
    (g_theirs,) = torch.autograd.grad((theirs * w).sum(), z)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-9, atol=1e-10)


def test_softmax_is_cross_entropy_minus_target_entropy() -> None:
    z = rand_rows(5, 9, seed=3).requires_grad_()
    y = torch.softmax(rand_rows(5, 9, seed=4), -1)
    ours = fy_loss(z, y, "softmax")
    kl = F.kl_div(torch.log_softmax(z, -1), y, reduction="none").sum(-1)
    torch.testing.assert_close(ours, kl)
    ce = -(y * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(ours, ce + (y * y.log()).sum(-1))
    labels = torch.tensor([1, 0, 8, 4, 4])  # one-hot: H(y) = 0, the loss is torch's cross-entropy
    torch.testing.assert_close(
        fy_loss(z, F.one_hot(labels, 9).to(F64), "softmax"), F.cross_entropy(z, labels, reduction="none")
    )
    (g,) = torch.autograd.grad(ours.sum(), z)
    (g_kl,) = torch.autograd.grad(kl.sum(), z)
    torch.testing.assert_close(g, g_kl)


# ---- dense targets: the definition, the gradient, gradcheck ---------------------------------------------
def dense_target(shape: tuple[int, ...], normalizer: str | float, seed: int) -> torch.Tensor:
    """A target distribution: the package's normalizer of other scores (sparse for the entmaxes)."""
    return reference_probs(rand_rows(*shape, seed=seed), normalizer)


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=str)
def test_value_is_the_definition_and_gradient_is_p_minus_target(normalizer: str | float) -> None:
    z = rand_rows(4, 3, 13, seed=5).requires_grad_()
    y = dense_target((4, 3, 13), "entmax15" if normalizer == "softmax" else normalizer, seed=6)
    loss = fy_loss(z, y, normalizer)
    assert loss.shape == (4, 3) and loss.dtype == F64
    torch.testing.assert_close(loss, restated_loss(z.detach(), y, normalizer), rtol=1e-9, atol=1e-10)
    assert (loss >= -1e-12).all()
    w = rand_rows(4, 3, seed=7)
    (g,) = torch.autograd.grad((loss * w).sum(), z)
    expected = (reference_probs(z.detach(), normalizer) - y) * w[..., None]
    torch.testing.assert_close(g, expected, rtol=1e-8, atol=1e-10)
    # the same gradient by autograd through the plain formula (through the normalizer itself)
    (g_plain,) = torch.autograd.grad((fy_loss_formula(z, y, normalizer, -1) * w).sum(), z)
    torch.testing.assert_close(g_plain, g, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=str)
def test_zero_exactly_at_the_normalizer_output(normalizer: str | float) -> None:
    z = rand_rows(3, 8, seed=8)
    loss = fy_loss(z, reference_probs(z, normalizer), normalizer)
    torch.testing.assert_close(loss, torch.zeros(3, dtype=F64), rtol=0, atol=1e-9)


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=str)
def test_gradcheck(normalizer: str | float) -> None:
    z = rand_rows(3, 7, seed=9).requires_grad_()
    y = torch.softmax(rand_rows(3, 7, seed=10), -1)
    assert torch.autograd.gradcheck(lambda s: fy_loss(s, y, normalizer), (z,))


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_dim(dim: int) -> None:
    z = rand_rows(5, 6, 4, seed=11).requires_grad_()
    y = torch.softmax(rand_rows(5, 6, 4, seed=12), dim)
    loss = fy_loss(z, y, "entmax15", dim=dim)
    moved = fy_loss(z.movedim(dim, -1), y.movedim(dim, -1), "entmax15")
    torch.testing.assert_close(loss, moved)
    g1, g2 = (torch.autograd.grad(out.sum(), z)[0] for out in (loss, moved))
    torch.testing.assert_close(g1, g2)


@given(
    rows=st.integers(1, 5),
    n=st.integers(1, 12),
    scale=st.sampled_from([0.1, 1.0, 10.0, 100.0]),
    normalizer=st.sampled_from(NORMALIZERS),
    seed=st.integers(0, 2**31 - 1),
)
def test_drawn_rows_match_the_definition(rows: int, n: int, scale: float, normalizer, seed: int) -> None:
    z = rand_rows(rows, n, seed=seed, scale=scale).requires_grad_()
    y = torch.softmax(rand_rows(rows, n, seed=seed + 1, scale=scale), -1)
    loss = fy_loss(z, y, normalizer)
    torch.testing.assert_close(loss, restated_loss(z.detach(), y, normalizer), rtol=1e-7, atol=1e-7 * scale)
    (g,) = torch.autograd.grad(loss.sum(), z)
    torch.testing.assert_close(g, reference_probs(z.detach(), normalizer) - y, rtol=1e-7, atol=1e-7)


# ---- masks, dead rows, precision, errors ---------------------------------------------------------------
@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=str)
def test_masked_entries_and_dead_rows(normalizer: str | float) -> None:
    z = rand_rows(4, 6, seed=13)
    z[0, [1, 4]] = float("-inf")  # masked keys, target 0 there: the loss of the row without them
    z[2] = float("-inf")  # a dead row
    z[3, 0] = float("-inf")  # a masked key the target puts mass on
    y = torch.softmax(rand_rows(4, 6, seed=14), -1)
    y[0, [1, 4]] = 0.0
    y[0] /= y[0].sum()
    z.requires_grad_()
    loss = fy_loss(z, y, normalizer)
    keep = [0, 2, 3, 5]
    alone = fy_loss(z.detach()[0, keep], y[0, keep], normalizer)
    torch.testing.assert_close(loss[0], alone)
    torch.testing.assert_close(loss[1], fy_loss(z.detach()[1], y[1], normalizer))
    assert loss[2] == 0 and loss[3] == float("inf")
    (g,) = torch.autograd.grad(loss[:3].sum(), z)
    assert torch.isfinite(g).all() and (g[2] == 0).all() and (g[0, [1, 4]] == 0).all()


def test_half_precision_computes_in_float32() -> None:
    z = rand_rows(3, 10, seed=15).to(torch.bfloat16).requires_grad_()
    y = torch.softmax(rand_rows(3, 10, seed=16), -1).to(torch.bfloat16)
    loss = fy_loss(z, y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, fy_loss(z.detach().float(), y.float()))
    loss.sum().backward()
    assert z.grad.dtype == torch.bfloat16 and torch.isfinite(z.grad.float()).all()


def test_no_gradient_reaches_the_target() -> None:
    z = rand_rows(2, 5, seed=17).requires_grad_()
    y = torch.softmax(rand_rows(2, 5, seed=18), -1).requires_grad_()
    fy_loss(z, y).sum().backward()
    assert y.grad is None and z.grad is not None


def test_errors_name_the_argument() -> None:
    z = rand_rows(2, 5)
    with pytest.raises(ValueError, match=r"scores has shape \(2, 5\), target has shape \(2, 4\)"):
        fy_loss(z, torch.zeros(2, 4, dtype=F64))
    with pytest.raises(TypeError, match="target must be a floating-point tensor"):
        fy_loss(z, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="scores must be a torch.Tensor"):
        fy_loss([1.0, 2.0], z)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dim=2 is out of range for scores of shape \(2, 5\)"):
        fy_loss(z, z, dim=2)
    with pytest.raises(ValueError, match="normalizer must be one of"):
        fy_loss(z, z, "relu")
    with pytest.raises(ValueError, match="alpha must be > 1"):
        fy_loss(z, z, 0.5)


def test_attention_sized_rows_match_attention_probs() -> None:
    """On attention-shaped scores, the gradient is the layer's probabilities minus the target."""
    q, k, v = (rand_rows(2, 3, 9, 4, seed=s) for s in (19, 20, 21))
    _, probs = plain_attention(q, k, v, "entmax15")
    s = ((q @ k.transpose(-1, -2)) * 4**-0.5).requires_grad_()
    y = torch.softmax(rand_rows(2, 3, 9, 9, seed=22), -1)
    (g,) = torch.autograd.grad(fy_loss(s, y).sum(), s)
    torch.testing.assert_close(g, probs - y)


# ---- precision, targets outside the simplex, reduction ----------------------------------------------
@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=str)
@pytest.mark.parametrize("layout", ["near 30", "times 30"])
def test_float32_scores_lose_no_precision(normalizer: str | float, layout: str) -> None:
    """Large float32 scores, a target close to the prediction (a loss near 0): within 1e-6 of float64
    (the unshifted ``logsumexp(z) − ⟨z, y⟩`` was off by 6e-6 near 30)."""
    from vitattn.functional import normalize

    g = torch.Generator().manual_seed(3)
    z = (
        torch.randn(128, 40, generator=g) + 30
        if layout == "near 30"
        else torch.randn(128, 40, generator=g) * 30
    )
    y = normalize(z + 0.1 * torch.randn(128, 40, generator=g), normalizer, -1)
    exact = fy_loss(z.double(), y.double(), normalizer)
    assert (fy_loss(z, y, normalizer).double() - exact).abs().max() < 1e-6


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=str)
def test_a_negative_target_gives_nan_for_every_normalizer(normalizer: str | float) -> None:
    z = rand_rows(3, 5)
    y = torch.softmax(rand_rows(3, 5, seed=1), -1)
    y[1, 0] -= 0.5
    y[1, 1] += 0.5
    loss = fy_loss(z, y, normalizer)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=str)
def test_value_checks_refuse_a_target_off_the_simplex(normalizer: str | float) -> None:
    from vitattn.functional.value_checks import set_value_checks

    z, y = rand_rows(3, 5), torch.softmax(rand_rows(3, 5, seed=1), -1)
    negative, unnormalized = y.clone(), y.clone()
    negative[2, 4] = -0.25
    unnormalized[0] *= 2
    set_value_checks(True)
    try:
        with pytest.raises(ValueError, match=r"target must be >= 0 .*-0\.25 at index \(2, 4\)"):
            fy_loss(z, negative, normalizer)
        with pytest.raises(
            ValueError, match="target's rows must sum to 1 along dim=1, got a row summing to 2"
        ):
            fy_loss(z, unnormalized, normalizer)
        fy_loss(z, y, normalizer)  # a distribution passes
    finally:
        set_value_checks(False)
    assert torch.isfinite(fy_loss(z, unnormalized, normalizer)).all()  # off: not read back


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_reduction_mean_and_sum(normalizer: str) -> None:
    z = rand_rows(2, 3, 7).requires_grad_()
    y = torch.softmax(rand_rows(2, 3, 7, seed=2), -1)
    rows = fy_loss(z, y, normalizer)
    assert rows.shape == (2, 3)
    torch.testing.assert_close(fy_loss(z, y, normalizer, reduction="mean"), rows.mean())
    torch.testing.assert_close(fy_loss(z, y, normalizer, reduction="sum"), rows.sum())
    (grad,) = torch.autograd.grad(fy_loss(z, y, normalizer, reduction="mean"), z)
    (want,) = torch.autograd.grad(rows.mean(), z)
    torch.testing.assert_close(grad, want)
    with pytest.raises(
        ValueError, match=r"reduction must be one of \['none', 'mean', 'sum'\], got 'batchmean'"
    ):
        fy_loss(z, y, normalizer, reduction="batchmean")  # type: ignore[arg-type]
