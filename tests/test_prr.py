"""Functional PRR against a plain formula and timm's AttentionPoolPrr."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from vitattn.functional import prr


@given(
    st.integers(1, 3), st.integers(1, 20), st.sampled_from([(8, 1), (12, 3), (32, 4)]), st.integers(0, 999)
)
def test_matches_per_head_formula(b, n, ch, seed):
    c, h = ch
    x = torch.randn(b, n, c, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref = torch.cat(
        [F.softmax(xh @ xh.transpose(-1, -2) / (c / h) ** 0.5, -1) @ xh for xh in x.split(c // h, dim=-1)], -1
    )
    torch.testing.assert_close(prr(x, h), ref, atol=1e-12, rtol=0)


def test_matches_timm_attention_pool_prr():
    timm_layers = pytest.importorskip("timm.layers")
    if not hasattr(timm_layers, "AttentionPoolPrr"):
        pytest.skip("this timm has no AttentionPoolPrr")
    x = torch.randn(2, 17, 48)
    pool = timm_layers.AttentionPoolPrr(48, num_heads=6, pool_type="token").eval()
    torch.testing.assert_close(prr(x, 6)[:, 0], pool(x), atol=1e-6, rtol=0)
    pool = timm_layers.AttentionPoolPrr(48, num_heads=6, pool_type="avg").eval()
    torch.testing.assert_close(prr(x, 6).mean(1), pool(x), atol=1e-6, rtol=0)


def test_errors():
    with pytest.raises(ValueError, match=r"x must be 3-D \(B, N, C\)"):
        prr(torch.randn(2, 3), 1)
    with pytest.raises(ValueError, match=r"positive divisor of C, got 5 for x \(1, 4, 12\)"):
        prr(torch.randn(1, 4, 12), 5)


@given(st.integers(1, 3), st.integers(1, 12), st.data())
def test_rows_gives_the_first_rows(b, n, data):
    x = torch.randn(b, n, 12, dtype=torch.float64)
    rows = data.draw(st.integers(1, n))
    torch.testing.assert_close(prr(x, 3, rows=rows), prr(x, 3)[:, :rows], atol=1e-12, rtol=0)


def test_rows_errors():
    with pytest.raises(ValueError, match=r"rows must be an int in \[1, N=4\] or None, got 5"):
        prr(torch.randn(1, 4, 12), 3, rows=5)
    with pytest.raises(ValueError, match=r"got 0"):
        prr(torch.randn(1, 4, 12), 3, rows=0)
