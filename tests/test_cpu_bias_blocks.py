"""The Gaussian bias as the CPU row-blocked paths write it (rows first, keys first) against its dense form,
and the numerator table they keep."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vitattn.functional import GaussianBias
from vitattn.functional.cpu.bias_blocks import column_block, numerator_table, write_rows

from .helpers import bias_cases


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
    write_rows(bias, out, start, bias.scaled_factors())
    torch.testing.assert_close(out, bias.dense()[:, :, start:stop], atol=0, rtol=0)


@given(bias_row_blocks())
def test_column_block_is_a_transposed_row_slice_of_dense(drawn):
    bias, start, stop = drawn
    factors_t = bias.key_major_factors()
    ra = factors_t[0]
    out = torch.full((ra.shape[0], ra.shape[1], bias.num_tokens, stop - start), float("nan"), dtype=ra.dtype)
    column_block(bias, out, start).write(factors_t)
    want = bias.dense()[:, :, start:stop].transpose(-1, -2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    # one head's (B, N, rows) block, its views made once and written again for another head
    block = column_block(bias, torch.full_like(out[:, 0], float("nan")), start)
    for j in range(ra.shape[1]):
        block.write((factors_t[0][:, j], factors_t[1][:, j]))
        torch.testing.assert_close(block.out, want[:, j], atol=0, rtol=0)


def test_column_block_rejects_a_block_that_does_not_fit():
    bias = GaussianBias(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 1), (2, 2), 1)
    ra, c = bias.scaled_factors()
    factors_t = (ra.transpose(-1, -2), c.transpose(-1, -2))
    with pytest.raises(ValueError, match=r"query rows 3\.\.6 of a \(B, H, 5, 5\) bias, keys first"):
        column_block(bias, torch.empty(1, 1, 5, 3), 3).write(factors_t)
    with pytest.raises(ValueError, match=r"do not fit out of shape \(1, 1, 4, 2\)"):
        column_block(bias, torch.empty(1, 1, 4, 2), 0).write(factors_t)


def test_write_rows_rejects_a_block_that_does_not_fit():
    bias = GaussianBias(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 1), (2, 2), 1)
    with pytest.raises(ValueError, match=r"rows 3\.\.6 of a \(B, H, 5, 5\) bias do not fit out of shape"):
        write_rows(bias, torch.empty(1, 1, 3, 5), 3, bias.scaled_factors())
    with pytest.raises(ValueError, match=r"do not fit out of shape \(1, 1, 2, 4\)"):
        write_rows(bias, torch.empty(1, 1, 2, 4), 0, bias.scaled_factors())


def test_cached_numerators_from_inference_mode_serve_autograd_later():
    grid = (3, 5)  # a grid no other test uses, so the first call below fills the cache
    sigma, alpha = torch.rand(1, 2, 15, 2) + 0.5, torch.rand(1, 2, 15, 1)
    with torch.inference_mode():
        first_bias = GaussianBias(sigma.clone(), alpha.clone(), grid, 1)
        table = numerator_table(first_bias)
        first = first_bias.dense()
    assert not table.is_inference() and numerator_table(first_bias) is table  # kept, usable by autograd
    torch.testing.assert_close(table, first_bias.numerator_table(), atol=0, rtol=0)
    sigma.requires_grad_(True)
    gb = GaussianBias(sigma, alpha, grid, 1)
    ra_t, c_t = gb.key_major_factors(table=numerator_table(gb), hand_backward=True)
    bias = (ra_t.unsqueeze(-2) * c_t.unsqueeze(-3)).flatten(-3, -2).transpose(-1, -2)
    bias.sum().backward()  # a cached inference tensor saved for backward would raise here
    bias = torch.nn.functional.pad(bias, (1, 0, 1, 0))
    assert sigma.grad is not None and torch.isfinite(sigma.grad).all()
    torch.testing.assert_close(bias.detach(), first)
