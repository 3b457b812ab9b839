"""GaussianBias.dense() against a direct, unoptimized statement of the GAug formula."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vitattn.functional import GaussianBias, gaussian_clamp, gaussian_eps

from .reference_formulas import naive_gaug_bias


@st.composite
def bias_cases(draw):
    gh, gw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    prefix = draw(st.sampled_from([0, 1, 5]))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    resize = draw(st.sampled_from([None, (1, 1), (2, 3), (4, 4)]))
    initial = (gh, gw) if resize is None else (max(1, gh - resize[0]), max(1, gw - resize[1]))
    log_sigma = draw(st.floats(-6, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    sigma = torch.exp(torch.randn(b, h, gh * gw, 2, generator=g, dtype=torch.float64) * 2 + log_sigma)
    alpha = torch.rand(b, h, gh * gw, 1, generator=g, dtype=torch.float64) * 3
    return sigma, alpha, (gh, gw), prefix, initial


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
    with pytest.raises(ValueError, match="num_prefix_tokens must be >= 0"):
        GaussianBias(s, a, (3, 4), num_prefix_tokens=-1)


@st.composite
def bias_row_blocks(draw):
    """A drawn bias and a block of its query rows ``start:stop``."""
    sigma, alpha, grid, prefix, initial = draw(bias_cases())
    bias = GaussianBias(sigma, alpha, grid, num_prefix_tokens=prefix, initial_grid_size=initial)
    start = draw(st.integers(0, bias.num_tokens - 1))
    return bias, start, draw(st.integers(start + 1, bias.num_tokens))


@given(bias_row_blocks())
def test_write_rows_is_a_row_slice_of_dense(drawn):
    bias, start, stop = drawn
    b, h, n = bias.sigma.shape[0], bias.sigma.shape[1], bias.num_tokens
    out = torch.full((b, h, stop - start, n), float("nan"), dtype=torch.float64)
    bias.write_rows(out, start)
    torch.testing.assert_close(out, bias.dense()[:, :, start:stop], atol=0, rtol=0)


@given(bias_row_blocks())
def test_write_columns_is_a_transposed_row_slice_of_dense(drawn):
    bias, start, stop = drawn
    factors_t = bias.key_major_factors()
    ra = factors_t[0]
    out = torch.full((ra.shape[0], ra.shape[1], bias.num_tokens, stop - start), float("nan"), dtype=ra.dtype)
    bias.write_columns(out, start, factors_t)
    want = bias.dense()[:, :, start:stop].transpose(-1, -2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    # one head's (B, N, rows) block, its views made once and written again for another head
    block = bias.column_block(torch.full_like(out[:, 0], float("nan")), start)
    for j in range(ra.shape[1]):
        block.write((factors_t[0][:, j], factors_t[1][:, j]))
        torch.testing.assert_close(block.out, want[:, j], atol=0, rtol=0)


@given(bias_cases(), st.sampled_from([1.0, 1.4426950408889634]))
def test_key_major_factors_match_the_naive_formula(case, scale):
    """The factors' outer product is the patch block of the bias from its definition, times
    ``scale``; the hand-written backward gives the definition's gradients to σ and α."""
    sigma, alpha, grid, prefix, initial = case
    leaves = sigma.clone().requires_grad_(), alpha.clone().requires_grad_()
    bias = GaussianBias(*leaves, grid, num_prefix_tokens=prefix, initial_grid_size=initial)
    ra_t, c_t = bias.key_major_factors(scale=scale)
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


def test_write_columns_rejects_a_block_that_does_not_fit():
    bias = GaussianBias(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 1), (2, 2), 1)
    ra, c = bias.scaled_factors()
    factors_t = (ra.transpose(-1, -2), c.transpose(-1, -2))
    with pytest.raises(ValueError, match=r"query rows 3\.\.6 of a \(B, H, 5, 5\) bias, keys first"):
        bias.write_columns(torch.empty(1, 1, 5, 3), 3, factors_t)
    with pytest.raises(ValueError, match=r"do not fit out of shape \(1, 1, 4, 2\)"):
        bias.write_columns(torch.empty(1, 1, 4, 2), 0, factors_t)


def test_write_rows_rejects_a_block_that_does_not_fit():
    bias = GaussianBias(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 1), (2, 2), 1)
    with pytest.raises(ValueError, match=r"rows 3\.\.6 of a \(B, H, 5, 5\) bias do not fit out of shape"):
        bias.write_rows(torch.empty(1, 1, 3, 5), 3)
    with pytest.raises(ValueError, match=r"do not fit out of shape \(1, 1, 2, 4\)"):
        bias.write_rows(torch.empty(1, 1, 2, 4), 0)


def test_cached_numerators_from_inference_mode_serve_autograd_later():
    grid = (3, 5)  # a grid no other test uses, so the first call below fills the cache
    sigma, alpha = torch.rand(1, 2, 15, 2) + 0.5, torch.rand(1, 2, 15, 1)
    with torch.inference_mode():
        first = GaussianBias(sigma.clone(), alpha.clone(), grid, 1).dense()
    sigma.requires_grad_(True)
    bias = GaussianBias(sigma, alpha, grid, 1).dense()
    bias.sum().backward()  # a cached inference tensor saved for backward would raise here
    assert sigma.grad is not None and torch.isfinite(sigma.grad).all()
    torch.testing.assert_close(bias.detach(), first)
