"""Bad input at the functional boundary: a clear error naming the argument and the value, or the right
number where the value is defined (empty head dims, negative amplitudes); value checks on tensors
only where they are free (the reference backend, analysis) or asked for (``VITATTN_CHECK_VALUES``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitattn.analysis import attention_rollout, gradient_rollout
from vitattn.functional import GaussianBias, WindowMask, attention, scores, set_value_checks
from vitattn.functional.value_checks import value_checks_enabled

from .test_backends import TORCH_BACKENDS, _run


def _qkv(n: int = 17, d: int = 8, dv: int | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 2, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, torch.randn(2, 2, n, d if dv is None else dv, generator=g, dtype=torch.float64)


def _bias(sigma_value: float | None = None, alpha_value: float | None = None) -> GaussianBias:
    g = torch.Generator().manual_seed(1)
    sigma = torch.rand(2, 2, 16, 2, generator=g, dtype=torch.float64) + 0.5
    alpha = torch.rand(2, 2, 16, 1, generator=g, dtype=torch.float64)
    if sigma_value is not None:
        sigma[1, 0, 3, 1] = sigma_value
    if alpha_value is not None:
        alpha[0, 1, 5, 0] = alpha_value
    return GaussianBias(sigma, alpha, (4, 4), 1)


# ---- Python arguments: always checked ---------------------------------------------------------------
@pytest.mark.parametrize("value", [1.7, "1", None, True, -1])
@pytest.mark.parametrize("cls", ["GaussianBias", "WindowMask"])
def test_num_prefix_tokens_must_be_an_int(cls: str, value: object) -> None:
    error = ValueError if value == -1 and not isinstance(value, bool) else TypeError
    with pytest.raises(error, match=f"num_prefix_tokens must be an int >= 0, got {value!r}"):
        if cls == "GaussianBias":
            GaussianBias(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 1), (2, 2), value)  # type: ignore[arg-type]
        else:
            WindowMask((2, 2), 3, value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [np.int64(1), torch.tensor(1)])
def test_integer_like_prefix_counts_are_taken(value: object) -> None:
    assert GaussianBias(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 1), (2, 2), value).num_prefix_tokens == 1  # type: ignore[arg-type]
    assert WindowMask((2, 2), 3, value).num_prefix_tokens == 1  # type: ignore[arg-type]


def test_a_window_and_a_bias_on_different_grids_are_refused() -> None:
    """2x8 and 4x4 have the same 16 tokens: the layouts, not the counts, must agree."""
    q = torch.randn(1, 1, 16, 4)
    bias = GaussianBias(torch.ones(1, 1, 16, 2), torch.ones(1, 1, 16, 1), (2, 8))
    with pytest.raises(ValueError, match=r"WindowMask on grid \(4, 4\).*GaussianBias on grid \(2, 8\)"):
        attention(q, q, q, bias=bias, mask=WindowMask((4, 4), 3))
    q17 = torch.randn(1, 1, 17, 4)
    bias17 = GaussianBias(torch.ones(1, 1, 16, 2), torch.ones(1, 1, 16, 1), (4, 4), 1)
    window17 = WindowMask((2, 8), 3, 1)  # the same 17 tokens, another grid
    with pytest.raises(ValueError, match=r"grid \(2, 8\), 1 prefix tokens.*grid \(4, 4\), 1 prefix tokens"):
        attention(q17, q17, q17, bias=bias17, mask=window17)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_scale_is_refused(scale: float) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"scale must be finite, got {scale!r}"):
        attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="scale must be finite"):
        scores(q, k, scale=scale)


@pytest.mark.parametrize("scale", ["1", True, torch.ones(2)])
def test_a_scale_that_is_not_a_number_is_refused(scale: object) -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="scale must be a real number or None"):
        attention(q, k, v, scale=scale)  # type: ignore[arg-type]


def test_a_negative_or_numpy_scale_is_a_number() -> None:
    q, k, v = _qkv()
    torch.testing.assert_close(attention(q, k, v, scale=np.float32(0.5)), attention(q, k, v, scale=0.5))
    torch.testing.assert_close(attention(q, k, v, scale=-0.5), attention(-q, k, v, scale=0.5))


# ---- empty head dims: defined outputs and gradients -------------------------------------------------
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
@pytest.mark.parametrize("dims", [(0, 3), (4, 0), (0, 0)], ids=["D=0", "Dv=0", "both"])
@pytest.mark.parametrize("backend", ["auto", *TORCH_BACKENDS])
def test_empty_head_dims(normalizer: str, dims: tuple[int, int], backend: str) -> None:
    """D = 0: no scores but the bias (uniform / entmax of the bias), default scale 1; Dv = 0: an empty
    output. Both attached to autograd, gradients of the right shapes, equal to the reference's."""
    d, dv = dims
    q, k, v = _qkv(d=d, dv=dv)
    call = {"q": q, "k": k, "v": v, "normalizer": normalizer, "bias": _bias()}
    if backend not in ("auto", "reference"):
        from vitattn.functional import explain

        reason = explain(**call, backend=backend)[backend]
        assert reason is not None
        assert "an empty dimension" in reason or "softmax only" in reason
        return
    out, grads = _run(call, backend)
    want, want_grads = _run(call, "reference")
    assert out.shape == (2, 2, 17, dv)
    torch.testing.assert_close(out, want)
    if d == 0 and dv > 0:  # uniform (softmax of the bias) averages of v on prefix rows
        torch.testing.assert_close(out[:, :, 0], v.mean(2) if normalizer == "softmax" else out[:, :, 0])
    for got, ref, leaf in zip(grads, want_grads, (q, k, v, None, None), strict=False):
        assert got is not None
        if leaf is not None:
            assert got.shape == leaf.shape
        torch.testing.assert_close(got, ref)


# ---- tensor values: checked by the reference and in value-check mode --------------------------------
@pytest.mark.parametrize("sigma", [-0.2, float("nan")])
def test_the_reference_refuses_a_negative_or_nan_sigma(sigma: float) -> None:
    q, k, v = _qkv()
    with pytest.raises(
        ValueError, match=r"bias.sigma must be >= 0 \(a variance\), got .* at index \(1, 0, 3, 1\)"
    ):
        attention(q, k, v, bias=_bias(sigma_value=sigma), backend="reference")


def test_value_checks_cover_every_backend() -> None:
    q, k, v = _qkv()
    bias = _bias(sigma_value=-0.2)
    attention(q, k, v, bias=bias, backend="cpu_blocked")  # off: not read back (no sync in the hot path)
    assert not value_checks_enabled()
    set_value_checks(True)
    try:
        for backend in ("auto", "cpu_blocked", "sdpa"):
            with pytest.raises(ValueError, match="bias.sigma must be >= 0"):
                attention(q, k, v, bias=bias, backend=backend)
        with pytest.raises(ValueError, match=r"bias.alpha must be finite, got inf at index \(0, 1, 5, 0\)"):
            attention(q, k, v, bias=_bias(alpha_value=float("inf")))
    finally:
        set_value_checks(False)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        set_value_checks(1)  # type: ignore[arg-type]


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_a_negative_amplitude_is_computed_exactly(normalizer: str) -> None:
    """A signed amplitude (a gated start's) pushes queries away from their neighbours: every backend that
    takes the call equals the reference, values and gradients."""
    q, k, v = _qkv()
    call = {"q": q, "k": k, "v": v, "normalizer": normalizer, "bias": _bias(alpha_value=-3.0)}
    want, want_grads = _run(call, "reference")
    for backend in ("auto", "cpu_blocked"):
        out, grads = _run(call, backend)
        torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
        for got, ref in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, ref, atol=1e-9, rtol=0)


# ---- rollout -----------------------------------------------------------------------------------------
def test_rollout_refuses_maps_without_heads() -> None:
    with pytest.raises(ValueError, match=r"maps\[1\] has 0 heads \(shape \(1, 0, 5, 5\)\)"):
        attention_rollout([torch.rand(1, 2, 5, 5), torch.rand(1, 0, 5, 5)])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_rollout_refuses_maps_that_are_not_weights(bad: float) -> None:
    """Scores instead of weights gave rows of (A + I) / 2 summing to 0, hence ±inf; now an error."""
    maps = [torch.softmax(torch.randn(1, 2, 5, 5), -1) for _ in range(2)]
    maps[1][0, 1, 2, 3] = bad
    with pytest.raises(ValueError, match=r"maps\[1\] must hold attention weights .* at index \(0, 1, 2, 3\)"):
        attention_rollout(maps)
    with pytest.raises(ValueError, match=r"maps\[1\] must hold attention weights"):
        gradient_rollout(maps, [torch.randn(1, 2, 5, 5) for _ in range(2)])
