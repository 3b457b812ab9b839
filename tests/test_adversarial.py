"""The adversarial suite: hostile inputs drawn by hypothesis, every torch backend against ``reference``.

The input classes that found defects before, as strategies: extreme score magnitudes (×30, 1e4),
rows masked by ``-inf``, ``finfo.min`` and ``-1e30`` (alone and mixed with partly masked rows),
constant and differentiated masks, empty head dims (D = 0, Dv = 0), a single token, Gaussian biases
with σ = 0, huge σ, negative α and a resolution change, windows beside them, α-entmax with α near 1
and far above 2, a tensor of α per head, a NaN in one query, non-contiguous and broadcast operands.

Each drawn call must give, on every backend that accepts it, the reference's values and gradients
(q, k, v, σ, α, a float mask, a tensor α), NaN only in the rows a NaN touches, and never NaN where
the reference is finite. Bounded example counts keep it in the fast tier (a few seconds).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vitattn.functional import GaussianBias, WindowMask, attention, explain

from .test_backends import TORCH_BACKENDS, _fresh, _leaves

F64 = torch.float64
FILLS = {"-inf": float("-inf"), "finfo.min": torch.finfo(F64).min, "-1e30": -1e30}


@st.composite
def hostile_calls(draw) -> dict:
    """One hostile float64 call (the classes in the module docstring), and which q rows hold a NaN."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    d, dv = draw(st.sampled_from([0, 1, 3, 4, 8])), draw(st.sampled_from([0, 1, 4]))
    layout = draw(st.sampled_from(["free", "grid"]))
    if layout == "grid":
        gh, gw, prefix = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.sampled_from([0, 1, 2]))
        nq = nk = prefix + gh * gw
    else:
        nq, nk = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    q = torch.randn(b, h, nq, d, generator=g, dtype=F64) * magnitude
    k = torch.randn(b, h, nk, d, generator=g, dtype=F64)
    v = torch.randn(b, h, nk, dv, generator=g, dtype=F64)
    if draw(st.booleans()):  # non-contiguous: transposed storage
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    # softmax drawn as often as the rest together: three of the four backends compute it
    others = st.sampled_from(["entmax15", "sparsemax", 1.0001, 1.3, 4.0, "tensor"])
    normalizer = draw(st.one_of(st.just("softmax"), others))
    if normalizer == "tensor":
        normalizer = 1.05 + 2.0 * torch.rand(h, generator=g, dtype=F64)
    call: dict = {"q": q, "k": k, "v": v, "normalizer": normalizer}
    if layout == "grid":
        kind = draw(st.sampled_from(["none", "gaussian", "window", "both"]))
        if kind in ("gaussian", "both"):
            sigma = torch.rand(b, h, gh * gw, 2, generator=g, dtype=F64) * draw(
                st.sampled_from([0.0, 1.0, 1e6])
            )
            alpha = torch.randn(b, h, gh * gw, 1, generator=g, dtype=F64) * 3  # signed
            initial = draw(st.sampled_from([(gh, gw), (gh + 3, gw + 1)]))
            call["bias"] = GaussianBias(sigma, alpha, (gh, gw), prefix, initial)
        if kind in ("window", "both"):
            call["mask"] = WindowMask(
                (gh, gw), draw(st.integers(1, 3)), prefix, draw(st.sampled_from([1, 2]))
            )
    else:
        fill = draw(st.sampled_from(["none", "bool", *FILLS]))
        if fill != "none":
            keep = torch.rand(b, h, nq, nk, generator=g) > 0.4
            dead = draw(st.lists(st.integers(0, nq - 1), min_size=1, max_size=nq, unique=True))
            keep[:, :, dead] = False
            if fill == "bool":
                call["mask"] = keep
            else:
                call["mask"] = torch.zeros(b, h, nq, nk, dtype=F64).masked_fill(~keep, FILLS[fill])
    nan_rows = []
    if d > 0 and draw(st.booleans()):
        row = draw(st.integers(0, nq - 1))
        q = call["q"] = call["q"].clone()
        q[0, 0, row, 0] = float("nan")
        nan_rows = [row]
    call["scale"] = draw(st.sampled_from([None, 0.5, -0.25]))
    return {"call": call, "mask_grad": draw(st.booleans()), "nan_rows": nan_rows}


def _run(call: dict, backend: str, mask_grad: bool) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    fresh = _fresh(call)
    if isinstance(fresh.get("mask"), torch.Tensor) and not mask_grad:
        fresh["mask"] = fresh["mask"].detach()
    out = attention(**fresh, backend=backend)
    leaves = [t for t in _leaves(fresh) if t.requires_grad]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    grads = (
        torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        if out.requires_grad
        else [None] * len(leaves)
    )
    return out.detach(), list(grads)


def _agree(got: torch.Tensor | None, want: torch.Tensor | None, nan_rows: list[int], what: str) -> None:
    if want is None or got is None:
        for t in (got, want):
            assert t is None or not t.abs().nan_to_num(1.0).any(), f"{what}: a gradient only one side has"
        return
    if nan_rows:  # a NaN reaches its own row (and through it, gradients anywhere): compare the rest only
        assert not torch.isnan(got).any() or torch.isnan(want).any(), (
            f"{what}: NaN the reference does not have"
        )
        return
    assert not torch.isnan(got).any() or torch.isnan(want).any(), (
        f"{what}: NaN where the reference is NaN-free"
    )
    scale = max([1.0, *want.abs().nan_to_num(0.0, 0.0, 0.0).flatten().tolist()])
    torch.testing.assert_close(got, want, atol=1e-8 * scale, rtol=1e-7, equal_nan=True, msg=what)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=hostile_calls())
@pytest.mark.parametrize("backend", ["auto", *[b for b in TORCH_BACKENDS if b != "reference"]])
def test_hostile_calls_match_the_reference(drawn: dict, backend: str) -> None:
    call, mask_grad, nan_rows = drawn["call"], drawn["mask_grad"], drawn["nan_rows"]
    if backend != "auto" and explain(**_fresh(call), backend=backend)[backend] is not None:
        return  # declined, with a reason (tests/test_backends.py checks the reasons)
    want, want_grads = _run(call, "reference", mask_grad)
    got, grads = _run(call, backend, mask_grad)
    assert got.shape == want.shape
    if nan_rows:
        clean = torch.ones(got.shape[:3], dtype=torch.bool)
        clean[0, 0, nan_rows] = False
        torch.testing.assert_close(got[clean], want[clean], atol=1e-8, rtol=1e-7, equal_nan=True)
    else:
        _agree(got, want, [], f"{backend} output")
    for i, (a, w) in enumerate(zip(grads, want_grads, strict=True)):
        _agree(a, w, nan_rows, f"{backend} gradient {i}")
