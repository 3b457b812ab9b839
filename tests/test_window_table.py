"""``vitattn.kernels.windows.window_table``: the per-token table the list kernels test a window with (its
centre and half-width in window coordinates per query, its own coordinates per key), against the
window's definition (``naive_window_keep``), without Triton: the kernels' penalty, ``max(|wr - ctr_r| -
half_r, |wc - ctr_c| - half_c)`` and ``min(z, -inf * penalty)``, restated in torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vitattn.functional import WindowMask
from vitattn.kernels import windows

from .reference_formulas import naive_window_keep


@st.composite
def window_masks(draw: st.DrawFn) -> WindowMask:
    gh, gw = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    kh, kw = draw(st.integers(1, gh)), draw(st.integers(1, gw))
    dh, dw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return WindowMask((gh, gw), (kh, kw), draw(st.integers(0, 2)), (dh, dw))


def _penalty(table: torch.Tensor) -> torch.Tensor:
    """``(N, N)``: the kernels' window penalty of query ``i`` (rows) and key ``j`` (columns)."""
    ctr_r, half_r, ctr_c, half_c, own_r, own_c = table[:, :, None].unbind(0)
    d_r = (own_r.T - ctr_r).abs() - half_r
    d_c = (own_c.T - ctr_c).abs() - half_c
    return torch.fmax(d_r, d_c)


@settings(max_examples=150, deadline=None)
@given(window_masks())
def test_table_penalty_is_the_windows_keep_mask(window: WindowMask) -> None:
    """Kept keys have a penalty of at most -1/2 (NaN for a prefix key), the others at least 1/2, and
    ``min(z, -inf * penalty)`` keeps exactly the window's scores: every grid, window and dilation drawn,
    with 0-2 prefix tokens."""
    keep = naive_window_keep(window.grid_size, window.window, window.dilation, window.num_prefix_tokens)
    penalty = _penalty(windows.window_table(window, torch.device("cpu")))
    p = window.num_prefix_tokens
    assert penalty[:, :p].isnan().all() and not penalty[:, p:].isnan().any()
    assert (penalty[:, p:][keep[:, p:]] <= -0.5).all()
    assert (penalty[~keep] >= 0.5).all()
    z = torch.zeros_like(penalty)
    assert torch.equal(torch.fmin(z, penalty * float("-inf")) == 0, keep)


def test_window_coordinates_fold_the_dilation() -> None:
    """Along an axis of dilation 3, positions 1, 4, 7 (one sub-grid) get consecutive coordinates, and
    positions of another sub-grid lie a whole stride away."""
    coords = windows.window_coordinate(torch.tensor([1, 4, 7, 2, 5]), 3, 16)
    assert coords.tolist() == [16, 17, 18, 32, 33]


def test_a_grid_too_large_for_exact_coordinates_is_refused() -> None:
    window = WindowMask((4096, 4096), (7, 7), 0, (4096, 1))
    with pytest.raises(ValueError, match=r"grid \(4096, 4096\) with dilation \(4096, 1\) is too large"):
        windows.window_table(window, torch.device("cpu"))
