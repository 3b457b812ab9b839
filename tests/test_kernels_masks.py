"""The Triton kernels under TRITON_INTERPRET=1: masks by large finite values.

How the interpreter flag is read, and why the tests carry ``@pytest.mark.triton_interpreter``: see
``tests/test_kernels.py`` (the same header logic; ``conftest.py`` runs them in a child pytest when
triton was imported earlier without the flag).

* Additive masks drawn by hypothesis from ``0, -1e4, -65504, -1e6, finfo(float32).min, -inf``, with rows
  masked entirely by one of them, against ``backend="reference"`` in float64 on the same inputs. q and k
  are dyadic (multiples of 1/2, scale 1/4), so ``q kᵀ * scale + mask`` is exact in float32 for every
  mask value and the reference sees the very scores the kernel sees.
* The entmax-1.5 threshold search runs on max-shifted scores: a row masked by ``-1e6`` converges in a
  handful of passes (counted by wrapping the kernel's ``listed_scores``), not at the cap of 32.
* The gradient of an additive mask that broadcasts over the queries, the keys or both, summed over the
  tile before the atomic adds.

(The kernels skip no work: every key loop loads its tiles unconditionally, so that they pipeline; the
passes of the entmax-1.5 search are counted in ``tests/test_kernels_entmax_search.py``.)
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import entmax
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vitattn.functional import attention

triton = pytest.importorskip("triton")

interpreted = pytest.mark.triton_interpreter

MASK_VALUES = (-1e4, -65504.0, -1e6, torch.finfo(torch.float32).min, float("-inf"))
FINITE_FILLS = MASK_VALUES[:4]


def _dyadic(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Entries in {-1, -1/2, 0, 1/2, 1}: ``q kᵀ / 4`` is a multiple of 1/16 below 4 (exact in float32)."""
    return torch.randint(-2, 3, shape, generator=g).double() / 2


def _draw_mask(data: st.DataObject, b: int, h: int, n: int) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """``(mask, full)``: an additive float64 mask (B, H, N, N) and the rows masked by one finite fill."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    density = data.draw(st.sampled_from([0.2, 0.5, 0.8]), label="masked fraction")
    which = torch.randint(0, len(MASK_VALUES), (b, h, n, n), generator=g)
    mask = torch.tensor(MASK_VALUES, dtype=torch.float64)[which]
    mask = torch.where(torch.rand(b, h, n, n, generator=g) < density, mask, torch.zeros(()).double())
    mask[..., 0] = 0.0  # every row keeps a key unless masked entirely below
    full = []
    for _ in range(data.draw(st.integers(0, 3), label="fully masked rows")):
        bi, hi, i = (data.draw(st.integers(0, s - 1)) for s in (b, h, n))
        fill = data.draw(st.sampled_from(MASK_VALUES), label="fill")
        mask[bi, hi, i] = fill
        if fill != float("-inf"):
            full.append((bi, hi, i))
    return mask, full


ALPHAS = torch.tensor([1.3, 1.7])  # "alpha" below: alpha-entmax with one alpha per head (H = 2)


def _normalizers(name: str) -> tuple[Any, Any]:
    """``(kernel's, reference's)`` normalizer argument of ``name``: the name itself, or for ``"alpha"``
    :data:`ALPHAS` in float32 and in float64."""
    if name == "alpha":
        return ALPHAS, ALPHAS.double()
    return name, name


def _check_masked(normalizer: str, dtype: torch.dtype, data: st.DataObject) -> None:
    b, h = 1, 2
    n = data.draw(st.sampled_from([5, 23, 37]), label="N")
    d = data.draw(st.sampled_from([8, 16]), label="D")
    g = torch.Generator().manual_seed(n * 100 + d)
    q, k, v = (_dyadic((b, h, n, d), g) for _ in range(3))
    mask, full = _draw_mask(data, b, h, n)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    norm, ref_norm = _normalizers(normalizer)
    out = attention(*leaves, normalizer=norm, mask=mask.float(), scale=0.25, backend="triton")
    ref = attention(*ref_leaves, normalizer=ref_norm, mask=mask, scale=0.25, backend="reference")
    assert not out.isnan().any()
    fwd_tol, grad_tol = (2e-6, 2e-5) if dtype == torch.float32 else (2e-3, 4e-3)
    if normalizer == "alpha":
        fwd_tol = 1e-5  # tests/test_kernels_alpha.py's float32 tolerance (exp2 / log2 per score)
    # Softmax works in base 2 (log2(e) folded into the scale): on a row masked entirely by a finite
    # fill M its exponents are rounded at |M| log2(e), as the reference backend's float32 scores are at |M|.
    # entmax-1.5 halves the scores (exact) and shifts them by the row max: exact on such rows too.
    tol = torch.full(out.shape[:-1], fwd_tol, dtype=torch.float64)
    if normalizer == "softmax":
        for bi, hi, i in full:
            fill = mask[bi, hi, i, 0].abs().item()
            tol[bi, hi, i] = fwd_tol if fill > 1e30 else max(fwd_tol, 2**-21 * fill)
    err = (out.double() - ref).abs().amax(-1)
    assert (err <= tol).all(), f"forward error {(err / tol).max().item():.2f} x the tolerance"
    # rows masked entirely by -inf give zeros
    dead = (mask == float("-inf")).all(-1)
    assert torch.equal(out[dead].float(), torch.zeros_like(out[dead]).float())
    # The backward recomputes the scores and reads one float32 threshold per row: on a row whose
    # largest score is itself at a mask's magnitude (masked entirely by a finite value) that threshold
    # is rounded to float32 there (see docs/kernels.md). Such rows get no upstream gradient here;
    # every other row (the ones with an unmasked key) must match the reference.
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for bi, hi, i in full:
        grad[bi, hi, i] = 0.0
    got = torch.autograd.grad(out, leaves, grad.to(dtype))
    want = torch.autograd.grad(ref, ref_leaves, grad)
    for name, a, w in zip("qkv", got, want, strict=True):
        assert torch.isfinite(a).all(), name
        top = w.abs().max().clamp_min(1.0)
        err = ((a.double() - w).abs().max() / top).item()
        assert err <= grad_tol, f"d{name}: relative error {err:.2e} > {grad_tol:.0e}"


@interpreted
@pytest.mark.parametrize(
    "normalizer, dtype",
    [
        ("entmax15", torch.float32),
        ("entmax15", torch.float16),
        ("softmax", torch.float32),
        ("alpha", torch.float32),
    ],
    ids=["entmax15-float32", "entmax15-float16", "softmax-float32", "alpha-float32"],
)
@settings(max_examples=5)
@given(data=st.data())
def test_large_finite_masks(normalizer, dtype, data):
    _check_masked(normalizer, dtype, data)


@interpreted
@pytest.mark.parametrize("fill", FINITE_FILLS, ids=["-1e4", "-65504", "-1e6", "finfo.min"])
def test_entmax_fully_masked_row_matches_the_entmax_package(fill):
    """A row masked entirely by a finite value is the entmax of its (shifted) scores (the reference
    backend's)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (_dyadic((1, 1, 21, 16), g).float() for _ in range(3))
    mask = torch.zeros(1, 1, 21, 21)
    mask[0, 0, 4] = fill
    mask[0, 0, 9, 3:] = fill  # keys 0-2 unmasked
    out = attention(q, k, v, normalizer="entmax15", mask=mask, scale=0.25, backend="triton")
    z = (q.double() @ k.double().transpose(-1, -2)) * 0.25 + mask.double()
    z[0, 0, 4] = (q.double() @ k.double().transpose(-1, -2))[0, 0, 4] * 0.25  # shift invariance
    if fill == torch.finfo(torch.float32).min:
        z[0, 0, 4] = 0.0  # the scores vanish next to finfo.min: a uniform row, as in the reference backend
    want = entmax.entmax15(z, dim=-1) @ v.double()
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=0)


class _Counter:
    """Counts the calls of a kernel module's ``@triton.jit`` helper (the interpreter runs them as Python)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> None:
        self.calls = 0
        inner = getattr(module, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)


def _kernel_module(name: str) -> types.ModuleType:
    from vitattn.kernels import ops

    ops.kernels()  # (re)imports the kernel modules for this interpreter setting
    return sys.modules[f"vitattn.kernels.{name}"]


@interpreted
@pytest.mark.parametrize("fill", FINITE_FILLS, ids=["-1e4", "-65504", "-1e6", "finfo.min"])
def test_entmax_masked_row_does_not_run_newton_to_the_cap(fill, monkeypatch):
    """One key block (N = 20 < BLOCK_N = 32): score tiles = 1 (row max) + search passes + 1 (output).
    Without the shift, a row at -1e6 has a float32 spacing of 0.06 there, the step never drops below
    the tolerance and the whole query block runs all 32 passes."""
    counter = _Counter(monkeypatch, _kernel_module("entmax15"), "listed_scores")
    g = torch.Generator().manual_seed(0)  # the unshifted search (before) ran 32 passes at -1e6 here
    q, k, v = (torch.randn(1, 1, 20, 16, generator=g) for _ in range(3))
    mask = torch.zeros(1, 1, 20, 20)
    mask[0, 0, 7] = fill
    out = attention(q, k, v, normalizer="entmax15", mask=mask, backend="triton")
    passes = counter.calls - 2
    assert 1 <= passes <= 8, f"{passes} Newton passes"
    # the other rows against the reference (row 7's scores are rounded in float32 at the mask's
    # magnitude, so it is checked on exact scores in the test above)
    ref = attention(
        q.double(), k.double(), v.double(), normalizer="entmax15", mask=mask.double(), backend="reference"
    )
    rows = torch.arange(20) != 7
    torch.testing.assert_close(out[0, 0, rows].double(), ref[0, 0, rows], atol=2e-5, rtol=0)


@interpreted
def test_softmax_row_masked_by_finfo_min_is_uniform():
    """Softmax scales an additive mask by log2(e) in base 2: finfo.min must not overflow to -inf there
    (a row masked entirely by it is uniform in the reference backend, not dead)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 9, 16, generator=g) for _ in range(3))
    mask = torch.zeros(1, 1, 9, 9)
    mask[0, 0, 2] = torch.finfo(torch.float32).min
    mask[0, 0, 5, 4:] = torch.finfo(torch.float32).min
    out = attention(q, k, v, mask=mask, backend="triton")
    ref = attention(q.double(), k.double(), v.double(), mask=mask.double(), backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)
    torch.testing.assert_close(out[0, 0, 2], v[0, 0].mean(0), atol=2e-6, rtol=0)


@interpreted
@pytest.mark.parametrize(
    "shape",
    [(2, 1, 1, 37), (2, 1, 37, 1), (1, 1, 37, 37), (1, 1, 1, 1)],
    ids=["keys", "queries", "heads-and-batch", "scalar"],
)
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_broadcast_additive_mask_gradients(normalizer, shape):
    """The gradient of an additive mask that broadcasts: summed over the tile's query rows (a per-key mask),
    its keys (a per-query mask), or both, before the atomic adds; against the reference in float64."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(shape, generator=g, dtype=torch.float64)
    leaves = [t.float().requires_grad_() for t in (q, k, v, mask)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    out = attention(*leaves[:3], normalizer=normalizer, mask=leaves[3], backend="triton")
    ref = attention(*ref_leaves[:3], normalizer=normalizer, mask=ref_leaves[3], backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad.float())
    want = torch.autograd.grad(ref, ref_leaves, grad)
    assert got[3].shape == shape
    for name, a, w in zip("qkvm", got, want, strict=True):
        tol = 1e-4 * max(1.0, w.abs().max().item())
        torch.testing.assert_close(a.double(), w, atol=tol, rtol=0, msg=name)


@interpreted
@pytest.mark.parametrize("normalizer", ["entmax15", "alpha"])
@pytest.mark.parametrize("magnitude", [1.0, 30.0, 1000.0])
def test_unmasked_rows_with_large_scores_keep_their_precision(normalizer, magnitude):
    """Without an additive mask the entmax forwards measure each score against the row's threshold
    ``a m + tau`` (``_common.threshold_excess``), rounded once to float32 at the row max' scale: the error
    stays within two float32 spacings of the largest score (the scores themselves are rounded there),
    against the float64 reference on the same float32 inputs. Scores up to ~4000 (magnitude 1000), 37
    keys in odd tiles; alpha-entmax with one alpha per head (1.3, 1.7)."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 2, 37, 16, generator=g) for _ in range(3))
        norm, ref_norm = _normalizers(normalizer)
        scale = magnitude / 4
        out = attention(q, k, v, normalizer=norm, scale=scale, backend="triton")
        ref = attention(
            q.double(), k.double(), v.double(), normalizer=ref_norm, scale=scale, backend="reference"
        )
        zmax = (q.double() @ k.double().transpose(-1, -2) * scale).abs().amax((-2, -1), keepdim=True)
        tol = 2e-6 + 2.0**-22 * zmax  # (B, H, 1, 1): per head, two spacings of its largest score
        err = (out.double() - ref).abs().amax((-2, -1), keepdim=True)
        assert (err <= tol).all(), f"seed {seed}: error {(err / tol).max().item():.2f} x the tolerance"
