"""The row-blocked Gaussian softmax path (CPU inference) against the plain formula and its dispatch; the
block planner and the scratch pool of the CPU paths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import vitattn.functional.cpu.softmax as cpu_softmax
from vitattn.functional import GaussianBias, attention, explain
from vitattn.functional.cpu.plan import Block, plan_blocks
from vitattn.functional.cpu.scratch import Slot, release, scratch
from vitattn.functional.cpu.softmax import gaussian_softmax_attention

from .helpers import count_calls
from .reference_formulas import naive_gaug_bias, plain_attention


@st.composite
def blocked_cases(draw):
    gh, gw = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    prefix = draw(st.sampled_from([0, 1, 3]))
    b, h, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 5, 8]))
    n = prefix + gh * gw
    rows = draw(st.one_of(st.none(), st.integers(1, n + 2)))
    limit = None if rows is None else b * n * rows  # blocks of about `rows` query rows
    broadcast = draw(st.sampled_from([None, "batch", "heads"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    sb = 1 if broadcast == "batch" else b
    sh = 1 if broadcast == "heads" else h
    sigma = torch.exp(torch.randn(sb, sh, gh * gw, 2, generator=g, dtype=torch.float64) * 2)
    alpha = torch.rand(sb, sh, gh * gw, 1, generator=g, dtype=torch.float64) * 4
    return q, k, v, GaussianBias(sigma, alpha, (gh, gw), prefix), limit


@given(blocked_cases())
def test_matches_plain_formula(case):
    q, k, v, bias, limit = case
    dense = naive_gaug_bias(bias.sigma, bias.alpha, bias.grid_size, bias.num_prefix_tokens, bias.grid_size)
    ref, _ = plain_attention(q, k, v, "softmax", scale=0.3, bias=dense)
    got = gaussian_softmax_attention(q, k, v, 0.3, bias, block_elements=limit)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)


def test_float32_close_to_float64_and_strided_inputs():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 1 + 5 * 7, 3, 2, 16, generator=g).permute(2, 0, 3, 1, 4)  # strided like a layer
    q, k, v = qkv.unbind(0)
    bias = GaussianBias(torch.rand(2, 2, 35, 2) * 5 + 0.1, torch.rand(2, 2, 35, 1) * 3, (5, 7), 1)
    got = gaussian_softmax_attention(q, k, v, 0.25, bias, block_elements=2 * 36 * 16)
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref, _ = plain_attention(q64, k64, v64, "softmax", scale=0.25, bias=bias.dense().double())
    assert got.dtype == torch.float32 and got.transpose(1, 2).is_contiguous()  # (B, N, H, Dv) in memory
    torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=1e-5)


def test_plan_blocks_splits_rows_evenly_under_the_limit():
    lim = 5 * 2**18
    assert plan_blocks(2, 785, 785, group_units=False) == [Block(0, 2, 0, 785)]  # 448 px, b2: one block
    assert [b.rows for b in plan_blocks(1, 3137, 3137, group_units=False)] == [393] * 7 + [386]  # 896 px
    assert [b.rows for b in plan_blocks(4, 785, 785, group_units=False)] == [393, 392]  # 448 px, b4
    assert plan_blocks(16, 197, 197, group_units=False) == [Block(0, 16, 0, 197)]  # 224 px, b16
    assert [b.rows for b in plan_blocks(10_000, 10_000, 50, group_units=False)] == [2] * 5_000
    assert [b.rows for b in plan_blocks(10**6, 10, 50, group_units=False)] == [1] * 10  # at least a row
    # entmax-1.5's grouping: whole heads while one fits, else one head's rows in near-equal pieces
    assert plan_blocks(96, 197, 197, group_units=True) == [Block(0, 32, 0, 197), Block(32, 64, 0, 197),
                                                           Block(64, 96, 0, 197)]  # fmt: skip
    assert plan_blocks(2, 785, 785, group_units=True) == [Block(0, 2, 0, 785)]
    assert [(b.u0, b.rows) for b in plan_blocks(2, 1500, 1500, group_units=True)] == [
        (0, 750),
        (0, 750),
        (1, 750),
        (1, 750),
    ]
    for units, nq, nk, limit in [(3, 7, 5, 11), (5, 9, 9, 200), (1, 1, 1, 1), (4, 13, 2, lim)]:
        for group in (False, True):
            blocks = plan_blocks(units, nq, nk, group_units=group, limit=limit)
            cover = sorted((u, r) for b in blocks for u in range(b.u0, b.u1) for r in range(b.r0, b.r1))
            assert cover == [(u, r) for u in range(units) for r in range(nq)]  # each pair exactly once
            assert all(b.units * b.rows * nk <= limit or b.rows == 1 for b in blocks)
    assert plan_blocks(0, 5, 5, group_units=True) == [] and plan_blocks(3, 0, 5, group_units=False) == []
    with pytest.raises(ValueError, match="limit must be >= 1"):
        plan_blocks(1, 4, 4, group_units=False, limit=0)


def test_scratch_is_reused_per_slot_and_grows():
    release()
    cpu = torch.device("cpu")
    first = scratch(Slot.SCORES, 1000, torch.float32, cpu)
    again = scratch(Slot.SCORES, 500, torch.float32, cpu)
    assert again.data_ptr() == first.data_ptr() and again.numel() == 500
    other = scratch(Slot.GRADS, 500, torch.float32, cpu)  # another slot: another buffer
    assert other.data_ptr() != first.data_ptr()
    bigger = scratch(Slot.SCORES, 10**6, torch.float32, cpu)
    assert bigger.numel() == 10**6
    assert scratch(Slot.SCORES, 10, torch.float64, cpu).dtype == torch.float64
    with torch.inference_mode():
        fresh = scratch(Slot.WORK, 10, torch.float32, cpu)
    assert not fresh.is_inference()  # usable in place by a later training call
    with pytest.raises(TypeError, match="slot must be a Slot"):
        scratch("scores", 10, torch.float32, cpu)  # type: ignore[arg-type]


def _case(requires_grad: bool = False):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 1 + 16, 8, generator=g, requires_grad=requires_grad) for _ in range(3))
    sigma = (torch.rand(2, 3, 16, 2, generator=g) * 4 + 0.5).requires_grad_(requires_grad)
    alpha = torch.rand(2, 3, 16, 1, generator=g).requires_grad_(requires_grad)
    return q, k, v, GaussianBias(sigma, alpha, (4, 4), 1)


def test_dispatch_uses_blocked_only_without_autograd(monkeypatch):
    calls = count_calls(monkeypatch, cpu_softmax, "gaussian_softmax_attention")
    q, k, v, bias = _case()
    with torch.no_grad():
        assert explain(q, k, v, bias=bias).path == "row-blocked Gaussian softmax, inference, eager"
        fast = attention(q, k, v, bias=bias)
    assert calls == [1]
    ref, _ = plain_attention(q, k, v, "softmax", bias=bias.dense())
    torch.testing.assert_close(fast.double(), ref.double(), atol=1e-6, rtol=1e-5)
    q, k, v, bias = _case(requires_grad=True)
    out = attention(q, k, v, bias=bias)  # autograd: the training path (tests/test_cpu_softmax_train.py)
    assert calls == [1]
    out.sum().backward()
    assert bias.sigma.grad is not None and bias.alpha.grad is not None
    with torch.no_grad():  # a mask, weights or a half dtype also leave the blocked path
        attention(q, k, v, bias=bias, mask=torch.ones(17, 17, dtype=torch.bool))
        attention(q, k, v, bias=bias, return_weights=True)
        attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias=bias)
    assert calls == [1]


def test_inputs_without_unit_last_stride():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 10, generator=g, dtype=torch.float64).transpose(-1, -2) for _ in range(3))
    bias = GaussianBias(torch.rand(1, 2, 9, 2, dtype=torch.float64) + 0.2, torch.rand(1, 2, 9, 1), (3, 3), 1)
    ref, _ = plain_attention(q, k, v, "softmax", scale=0.5, bias=bias.dense())
    torch.testing.assert_close(gaussian_softmax_attention(q, k, v, 0.5, bias, block_elements=4 * 10), ref)


@pytest.mark.parametrize("offset", [0.0, -300.0, 200.0, "mixed"])
def test_rows_near_the_exp_range_take_the_shifted_step(monkeypatch, offset):
    """Scores far below zero (every unshifted exp2 flushes to 0) or above float32's exp range (inf)
    must give the softmax all the same, by the maxima-subtracted retry; ordinary scores never retry."""
    shifted = []
    original = cpu_softmax._exp2_step

    def spy(*args):
        shifted.append(args[-1])
        return original(*args)

    monkeypatch.setattr(cpu_softmax, "_exp2_step", spy)
    g = torch.Generator().manual_seed(3)
    b, h, gh, gw, prefix, d = 2, 2, 3, 4, 1, 8
    n = prefix + gh * gw
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    # a constant added to every score of a row: q gets a component along a direction all keys share
    k[..., 0] = 1.0
    row_offset = torch.full((b, h, n), 0.0 if offset == "mixed" else float(offset))
    if offset == "mixed":
        row_offset[0, 0, 2], row_offset[1, 1, 5] = -300.0, 200.0
    scale = 0.5
    q[..., 0] = row_offset / scale
    sigma, alpha = torch.rand(b, h, gh * gw, 2, generator=g) + 0.3, torch.rand(b, h, gh * gw, 1, generator=g)
    bias = GaussianBias(sigma, alpha, (gh, gw), prefix)
    got = gaussian_softmax_attention(q, k, v, scale, bias, block_elements=b * n * 5)
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref, _ = plain_attention(q64, k64, v64, "softmax", scale=scale, bias=bias.dense().double())
    assert torch.isfinite(got).all()
    # float32 scores near -300 carry rounding of ulp(300) ~ 3e-5 in every path, hence the offset term
    atol = 2e-5 + 2e-7 * (300.0 if offset == "mixed" else abs(offset))
    torch.testing.assert_close(got.double(), ref, atol=atol, rtol=1e-5)
    assert any(shifted) == (offset != 0.0)  # a retry exactly when some row is out of range


def test_default_and_explicit_blocks(monkeypatch):
    """448 px, batch 2 (N = 785): one block per head by default (as in training), a smaller
    ``block_elements`` splits the rows evenly."""
    blocks = []
    original = cpu_softmax._exp2_step

    def spy(block, *rest):
        blocks.append((block.start, block.stop))
        return original(block, *rest)

    monkeypatch.setattr(cpu_softmax, "_exp2_step", spy)
    q, k, v = (torch.randn(2, 1, 785, 4) for _ in range(3))
    bias = GaussianBias(torch.rand(2, 1, 784, 2) + 0.5, torch.rand(2, 1, 784, 1), (28, 28), 1)
    gaussian_softmax_attention(q, k, v, 0.5, bias)
    assert blocks == [(0, 785)]
    blocks.clear()
    gaussian_softmax_attention(q, k, v, 0.5, bias, block_elements=2 * 785 * 393)
    assert blocks == [(0, 393), (393, 785)]
