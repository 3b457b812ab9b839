"""The row-blocked Gaussian softmax attention with autograd (CPU training path): gradcheck in float64,
the dense formula in float32 on drawn shapes, no ``(B, H, N, N)`` tensor, and its dispatch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import vitattn.functional.cpu.softmax as cpu_softmax
import vitattn.functional.sdpa as sdpa
from vitattn.functional import GaussianBias, attention
from vitattn.functional.cpu.scratch import release
from vitattn.functional.cpu.softmax import gaussian_softmax_attention, gaussian_softmax_attention_train

from .helpers import count_calls
from .reference_formulas import naive_gaug_bias


def _leaves(b, h, gh, gw, prefix, d, dtype, seed=0, broadcast=None, mag=1.0):
    g = torch.Generator().manual_seed(seed)
    n = prefix + gh * gw
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * mag for _ in range(3))
    sb, sh = (1 if broadcast == "batch" else b), (1 if broadcast == "heads" else h)
    sigma = torch.exp(torch.randn(sb, sh, gh * gw, 2, generator=g, dtype=torch.float64))
    alpha = torch.rand(sb, sh, gh * gw, 1, generator=g, dtype=torch.float64) * 3
    return [t.to(dtype).requires_grad_() for t in (q, k, v, sigma, alpha)]


def _dense_reference(q, k, v, sigma, alpha, grid, prefix, scale):
    """softmax(q kᵀ scale + bias) v in float64 with the bias from its definition (autograd through it)."""
    bias = naive_gaug_bias(sigma, alpha, grid, prefix, grid)
    return torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale + bias, -1) @ v.double()


@pytest.mark.parametrize(
    "b, h, grid, prefix, rows, broadcast, initial",
    [
        (2, 2, (3, 4), 1, 5, None, None),  # prefix block, then patch blocks of 5, 5, 2
        (1, 3, (2, 3), 0, None, "batch", None),  # no prefix, one block, sigma broadcast over the batch
        (2, 1, (3, 3), 2, 4, "heads", None),  # two prefix rows, sigma broadcast over the heads
        (1, 2, (4, 3), 1, 3, None, (2, 2)),  # a resolution change: variances rescaled, the clamp binds
    ],
)
def test_gradcheck_float64(b, h, grid, prefix, rows, broadcast, initial):
    q, k, v, sigma, alpha = _leaves(b, h, *grid, prefix, 3, torch.float64, broadcast=broadcast)

    def fn(q, k, v, sigma, alpha):
        bias = GaussianBias(sigma, alpha, grid, prefix, initial_grid_size=initial)
        limit = None if rows is None else b * (prefix + grid[0] * grid[1]) * rows
        return gaussian_softmax_attention_train(q, k, v, 0.6, bias, block_elements=limit)

    assert torch.autograd.gradcheck(fn, (q, k, v, sigma, alpha))


@st.composite
def train_cases(draw):
    gh, gw = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    prefix = draw(st.sampled_from([0, 1, 3]))
    b, h, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16]))
    rows = draw(st.one_of(st.none(), st.integers(1, gh * gw + 2)))
    broadcast = draw(st.sampled_from([None, "batch", "heads"]))
    mag = draw(st.sampled_from([0.5, 2.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return (b, h, gh, gw, prefix, d, broadcast, mag, seed), rows


@settings(max_examples=40, deadline=None)
@given(train_cases())
def test_float32_matches_the_dense_formula(case):
    (b, h, gh, gw, prefix, d, broadcast, mag, seed), rows = case
    limit = None if rows is None else b * (prefix + gh * gw) * rows
    leaves = _leaves(b, h, gh, gw, prefix, d, torch.float32, seed=seed, broadcast=broadcast, mag=mag)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    scale = d**-0.5
    out = gaussian_softmax_attention_train(
        *leaves[:3], scale, GaussianBias(leaves[3], leaves[4], (gh, gw), prefix), block_elements=limit
    )
    ref = _dense_reference(*ref_leaves, (gh, gw), prefix, scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad.float())
    want = torch.autograd.grad(ref, ref_leaves, grad)
    for name, a, w in zip(("q", "k", "v", "sigma", "alpha"), got, want, strict=True):
        assert a.shape == w.shape, name
        top = w.abs().max().clamp_min(1e-3).item()
        err = (a.double() - w).abs().max().item() / top
        assert err <= 1e-4, f"d{name}: error {err:.2e} relative to max |grad| {top:.2e}"


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns while active (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shapes = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.numel = t.numel()
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def test_no_dense_tensor_is_saved_or_allocated():
    b, h, gh, gw, prefix, d = 2, 3, 8, 8, 1, 16
    n = prefix + gh * gw
    q, k, v, sigma, alpha = _leaves(b, h, gh, gw, prefix, d, torch.float32)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    rows = 16
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _LargestTensor() as largest_fwd:
        out = gaussian_softmax_attention_train(
            q, k, v, 0.25, GaussianBias(sigma, alpha, (gh, gw), prefix), block_elements=b * n * rows
        )
    assert saved and all(len(s) < 4 or s[-1] != n or s[-2] != n for s in saved), saved
    assert max(torch.Size(s).numel() for s in saved) <= b * h * n * d  # nothing bigger than q, k, v, out
    with _LargestTensor() as largest:
        out.sum().backward()
    for mode in (largest_fwd, largest):  # scratch blocks are (B, rows, N) = 2 * 16 * 65 < B H N D
        assert 0 < mode.numel <= b * h * n * d, mode.shapes
    assert sigma.grad is not None and alpha.grad is not None and q.grad is not None


def test_masks_and_bad_inputs_are_declined_clearly():
    q, k, v, sigma, alpha = _leaves(1, 1, 2, 2, 1, 4, torch.float32)
    bias = GaussianBias(sigma, alpha, (2, 2), 1)
    with pytest.raises(TypeError, match="one dtype, float32 or float64"):
        gaussian_softmax_attention_train(q, k.double(), v, 1.0, bias)
    with pytest.raises(ValueError, match="N = bias.num_tokens = 5"):
        gaussian_softmax_attention_train(q[:, :, :4], k[:, :, :4], v[:, :, :4], 1.0, bias)
    with pytest.raises(ValueError, match="limit must be >= 1 scores per block, got 0"):
        gaussian_softmax_attention_train(q, k, v, 1.0, bias, block_elements=0)
    out = gaussian_softmax_attention_train(q, k, v, 1.0, bias)
    w = torch.ones_like(out, requires_grad=True)
    (gq,) = torch.autograd.grad(out, q, w, create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        gq.sum().backward()  # no double backward: said so, not silently wrong


def test_training_dispatch_takes_the_fused_path_not_sdpa(monkeypatch):
    def no_sdpa(*args, **kwargs):
        raise AssertionError("SDPA was called for a Gaussian-biased training call")

    calls = count_calls(monkeypatch, cpu_softmax, "gaussian_softmax_attention_train")
    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", no_sdpa)
    q, k, v, sigma, alpha = _leaves(2, 3, 4, 4, 1, 8, torch.float32)
    bias = GaussianBias(sigma, alpha, (4, 4), 1)
    out = attention(q, k, v, bias=bias)
    assert calls == [1]
    ref = _dense_reference(q, k, v, sigma, alpha, (4, 4), 1, 8**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    out.sum().backward()
    assert sigma.grad is not None and alpha.grad is not None
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="SDPA was called"):  # a mask still takes the dense path
        monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", no_sdpa)
        attention(q, k, v, bias=bias, mask=torch.ones(17, 17, dtype=torch.bool))


def test_inference_mode_then_training_share_the_block_buffers():
    """The block buffers outlive the call: made under inference mode, a training call still writes them."""
    release()  # the next call allocates them afresh
    q, k, v, sigma, alpha = _leaves(2, 2, 5, 5, 1, 8, torch.float32)
    bias = GaussianBias(sigma, alpha, (5, 5), 1)
    with torch.inference_mode():
        fast = gaussian_softmax_attention(q, k, v, 0.3, bias)
    out = gaussian_softmax_attention_train(q, k, v, 0.3, bias)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), fast, atol=1e-6, rtol=1e-5)  # other row blocks: ulps
    assert q.grad is not None and sigma.grad is not None


@pytest.mark.parametrize("offset", [-300.0, 200.0])
def test_gradients_of_rows_near_the_exp_range(offset):
    """The backward recomputes each block with the forward's step, including its maxima-subtracted
    retry: rows whose scores all sit near -300 or +200 still give the float64 gradients (within
    float32's rounding of scores that large) and nothing non-finite."""
    b, h, gh, gw, prefix, d = 2, 2, 3, 3, 1, 8
    leaves = _leaves(b, h, gh, gw, prefix, d, torch.float32, seed=4)
    scale = 0.5
    with torch.no_grad():  # every score of a row shifted by the same offset: a key component all keys share
        leaves[1][..., 0] = 1.0
        leaves[0][:, :, 2, 0] = offset / scale
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    out = gaussian_softmax_attention_train(
        *leaves[:3], scale, GaussianBias(leaves[3], leaves[4], (gh, gw), prefix), block_elements=b * 10 * 4
    )
    ref = _dense_reference(*ref_leaves, (gh, gw), prefix, scale)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad.float())
    want = torch.autograd.grad(ref, ref_leaves, grad)
    for name, a, w in zip(("q", "k", "v", "sigma", "alpha"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        top = w.abs().max().clamp_min(1e-3).item()
        err = (a.double() - w).abs().max().item() / top
        assert err <= 5e-4, f"d{name}: error {err:.2e} relative to max |grad| {top:.2e}"
