"""GaussianBias.dense() against a direct, unoptimized statement of the GAug formula."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vitattn.functional import GaussianBias, gaussian_clamp, gaussian_eps, gaussian_exponent

from .helpers import bias_cases
from .reference_formulas import naive_gaug_bias


@given(bias_cases())
def test_dense_matches_naive_formula(case):
    sigma, alpha, grid, prefix, initial = case
    bias = GaussianBias(sigma, alpha, grid, num_prefix_tokens=prefix, initial_grid_size=initial)
    got = bias.dense()
    assert got.shape == (
        sigma.shape[0],
        sigma.shape[1],
        prefix + grid[0] * grid[1],
        prefix + grid[0] * grid[1],
    )
    torch.testing.assert_close(
        got, naive_gaug_bias(sigma, alpha, grid, prefix, initial), atol=1e-12, rtol=1e-10
    )


def test_float32_inputs_stay_close_to_float64():
    sigma = torch.rand(2, 3, 48, 2) * 10
    alpha = torch.rand(2, 3, 48, 1) * 3
    got = GaussianBias(sigma, alpha, (6, 8), 2).dense()
    assert got.dtype == torch.float32
    ref = naive_gaug_bias(sigma, alpha, (6, 8), 2, (6, 8))
    torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("grid", "eps", "clamp"),
    [
        ((8, 8), 0.1, -24.5),
        ((14, 14), 0.1, -84.5),
        ((32, 32), 0.2, -480.5),
        ((64, 48), 0.4, -1984.5),
        ((200, 200), 0.8, -6550.0),
    ],
)
def test_eps_and_clamp_rules(grid, eps, clamp):
    assert gaussian_eps(grid) == pytest.approx(eps)
    assert gaussian_clamp(grid) == pytest.approx(clamp)


def test_resolution_change_scales_sigma_and_keeps_initial_rules():
    sigma = torch.rand(1, 2, 16 * 16, 2, dtype=torch.float64) * 4
    alpha = torch.ones(1, 2, 256, 1, dtype=torch.float64)
    bias = GaussianBias(sigma, alpha, (16, 16), initial_grid_size=(8, 8))
    assert bias.resolution_scale == 2.0 and bias.eps == 0.1 and bias.clamp == -24.5
    torch.testing.assert_close(bias.dense(), naive_gaug_bias(sigma, alpha, (16, 16), 0, (8, 8)))
    # far keys hit the clamp of the initial grid: exp(-24.5 / (2 sigma + eps)) per axis at most
    far = bias.dense()[0, 0, 0, 255]
    expected = torch.exp(-24.5 / (2 * sigma[0, 0, 0, 0] + 0.1) - 24.5 / (2 * sigma[0, 0, 0, 1] + 0.1))
    torch.testing.assert_close(far, expected)


def test_gradients_reach_sigma_and_alpha():
    sigma = (torch.rand(1, 2, 12, 2, dtype=torch.float64) + 0.5).requires_grad_()
    alpha = torch.rand(1, 2, 12, 1, dtype=torch.float64).requires_grad_()
    fn = lambda s, a: GaussianBias(s, a, (3, 4), num_prefix_tokens=1).dense()  # noqa: E731
    assert torch.autograd.gradcheck(fn, (sigma, alpha))


def test_prefix_rows_and_columns_are_zero():
    bias = GaussianBias(torch.rand(1, 1, 9, 2) + 0.1, torch.rand(1, 1, 9, 1) + 0.5, (3, 3), 4).dense()
    assert torch.equal(bias[..., :4, :], torch.zeros(1, 1, 4, 13))
    assert torch.equal(bias[..., :, :4], torch.zeros(1, 1, 13, 4))
    assert (bias[..., 4:, 4:] > 0).all()


def test_errors_name_shapes():
    s, a = torch.rand(1, 2, 12, 2), torch.rand(1, 2, 12, 1)
    with pytest.raises(ValueError, match=r"Np = 4\*4 = 16 .* got shape \(1, 2, 12, 2\)"):
        GaussianBias(s, a, (4, 4))
    with pytest.raises(ValueError, match=r"alpha must be \(B, H, Np, 1\)"):
        GaussianBias(s, torch.rand(1, 2, 12, 2), (3, 4))
    with pytest.raises(ValueError, match="sigma must be 4-D"):
        GaussianBias(torch.rand(12, 2), a, (3, 4))
    with pytest.raises(ValueError, match="grid_size must be two positive ints"):
        GaussianBias(s, a, (0, 12))
    with pytest.raises(ValueError, match="num_prefix_tokens must be an int >= 0, got -1"):
        GaussianBias(s, a, (3, 4), num_prefix_tokens=-1)


@given(bias_cases(), st.sampled_from([1.0, 1.4426950408889634]), st.booleans(), st.booleans())
def test_key_major_factors_match_the_naive_formula(case, scale, hand_backward, given_table):
    """The factors' outer product is the patch block of the bias from its definition, times
    ``scale``; the hand-written backward and the plain one give the definition's gradients to σ and α."""
    sigma, alpha, grid, prefix, initial = case
    leaves = sigma.clone().requires_grad_(), alpha.clone().requires_grad_()
    bias = GaussianBias(*leaves, grid, num_prefix_tokens=prefix, initial_grid_size=initial)
    table = bias.numerator_table() if given_table else None
    ra_t, c_t = bias.key_major_factors(scale=scale, table=table, hand_backward=hand_backward)
    assert ra_t.dtype == torch.float64 and bias.key_major_factors(torch.float32)[0].dtype == torch.float32
    got = (ra_t.unsqueeze(-2) * c_t.unsqueeze(-3)).flatten(-3, -2).transpose(-1, -2)  # (B, H, Np q, Np k)
    ref_leaves = sigma.clone().requires_grad_(), alpha.clone().requires_grad_()
    want = scale * naive_gaug_bias(*ref_leaves, grid, prefix, initial)[:, :, prefix:, prefix:]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    w = torch.randn_like(want)
    got_grads = torch.autograd.grad((got * w).sum(), leaves)
    want_grads = torch.autograd.grad((want * w).sum(), ref_leaves)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)  # the -40 exponent floor: ~e^-40 apart
    ra, c = bias.scaled_factors()  # the same factors, queries first
    torch.testing.assert_close(ra.transpose(-1, -2), ra_t / scale, atol=0, rtol=1e-15)
    torch.testing.assert_close(c.transpose(-1, -2), c_t, atol=0, rtol=0)


@given(
    st.lists(st.integers(-60, 60), min_size=1, max_size=30),
    st.floats(1e-3, 1e4),
    st.tuples(st.integers(1, 200), st.integers(1, 200)),
)
def test_gaussian_exponent_is_the_stated_formula(offsets, den, initial):
    """max(max(-d^2 / 2, clamp) / den, -40), written out per element in float64."""
    clamp = gaussian_clamp(initial)
    offset = torch.tensor(offsets, dtype=torch.float64)
    got = gaussian_exponent(offset, torch.tensor(den, dtype=torch.float64), clamp)
    for d, e in zip(offsets, got.tolist(), strict=True):
        assert e == pytest.approx(max(max(-0.5 * d * d, clamp) / den, -40.0), rel=1e-15, abs=0)


@given(bias_cases())
def test_dense_bias_is_alpha_times_exp_of_the_stated_exponents(case):
    """Every path's bias comes from gaussian_exponent: the dense form, floor included, per element."""
    sigma, alpha, grid, prefix, initial = case
    bias = GaussianBias(sigma, alpha, grid, num_prefix_tokens=prefix, initial_grid_size=initial)
    gh, gw = grid
    rows = torch.arange(gh * gw, dtype=torch.float64).div(gw, rounding_mode="floor")
    cols = torch.arange(gh * gw, dtype=torch.float64).remainder(gw)
    den = bias.denominators()  # (B, H, Np, 2)
    e_row = gaussian_exponent(rows[:, None] - rows[None, :], den[..., 0:1], bias.clamp)
    e_col = gaussian_exponent(cols[:, None] - cols[None, :], den[..., 1:2], bias.clamp)
    want = alpha * torch.exp(e_row + e_col)
    torch.testing.assert_close(bias.dense()[:, :, prefix:, prefix:], want, atol=1e-300, rtol=1e-13)
