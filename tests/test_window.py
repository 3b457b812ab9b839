"""Neighbourhood attention as a mask (``WindowMask``): the window rule against a dense boolean mask built
independently (tests/reference_formulas.py), every backend and row-blocked path against the plain
formula with that mask (softmax, entmax-1.5, sparsemax, alpha-entmax; with and without a Gaussian bias;
several blocks), the dispatcher's answers, and the key-range rule a fused kernel can skip tiles by."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vitattn.functional import GaussianBias, WindowMask, attention, explain, scores, window_starts
from vitattn.functional.cpu import (
    entmax15_attention,
    gaussian_softmax_attention,
    gaussian_softmax_attention_train,
)

from .reference_formulas import naive_gaug_bias, naive_window_keep, plain_attention

TORCH_BACKENDS = ("cpu_blocked", "sdpa", "reference")


@st.composite
def windows(draw, max_grid: int = 9) -> WindowMask:
    """A drawn window: grids up to ``max_grid`` a side, windows 1..9 (even ones and ones larger than the
    grid included), dilations 1..3, 0..3 prefix tokens."""
    grid = (draw(st.integers(1, max_grid)), draw(st.integers(1, max_grid)))
    window = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    dilation = draw(st.sampled_from([(1, 1), (1, 1), (2, 2), (1, 3), (3, 2)]))
    return WindowMask(grid, window, draw(st.integers(0, 3)), dilation)


def _naive(w: WindowMask) -> torch.Tensor:
    return naive_window_keep(w.grid_size, w.window, w.dilation, w.num_prefix_tokens)


# ---- the rule ----------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(windows())
def test_dense_mask_is_the_definition(w):
    assert torch.equal(w.dense(), _naive(w))


@settings(max_examples=60, deadline=None)
@given(windows())
def test_every_query_sees_its_window_of_its_own_sub_grid(w):
    """Each patch query keeps itself and exactly min(k, m) keys per axis, m its sub-grid's length;
    prefix rows and columns keep everything."""
    keep, p = w.dense(), w.num_prefix_tokens
    (gh, gw), (kh, kw), (dh, dw) = w.grid_size, w.window, w.dilation
    assert keep[:p].all() and keep[:, :p].all()
    for i in range(gh):
        for j in range(gw):
            t = p + i * gw + j
            m_rows, m_cols = len(range(i % dh, gh, dh)), len(range(j % dw, gw, dw))
            assert keep[t, t]
            assert int(keep[t, p:].sum()) == min(kh, m_rows) * min(kw, m_cols)


def test_borders_shift_inward_and_the_interior_is_centred():
    """NATTEN's rule on a 7-wide axis with k = 3: the corner windows are shifted inward, not clipped."""
    assert window_starts(7, 3) == [(0, 3), (0, 3), (1, 3), (2, 3), (3, 3), (4, 3), (4, 3)]
    assert window_starts(4, 7) == [(0, 4)] * 4  # a window larger than the axis: the whole axis
    # dilation 2 on 9 positions: sub-grids 0,2,4,6,8 and 1,3,5,7
    assert window_starts(9, 3, 2) == [(0, 3), (1, 3), (0, 3), (1, 3), (2, 3), (3, 3), (4, 3), (3, 3), (4, 3)]
    assert window_starts(6, 4) == [(0, 4), (0, 4), (0, 4), (1, 4), (2, 4), (2, 4)]  # even: 2 before, 1 after


@settings(max_examples=60, deadline=None)
@given(windows(), st.data())
def test_key_span_covers_every_kept_patch_key(w, data):
    """The fused kernels' tile rule: every patch key a query of [start, stop) keeps lies in key_span, and
    the span is tight to whole grid rows."""
    n, p, gw = w.num_tokens, w.num_prefix_tokens, w.grid_size[1]
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    lo, hi = w.key_span(start, stop)
    kept = w.dense()[max(start, p) : stop, p:].any(0).nonzero()[:, 0] + p
    if kept.numel() == 0:
        assert (lo, hi) == (0, 0)
        return
    assert lo <= int(kept.min()) and int(kept.max()) < hi
    assert (lo - p) % gw == 0 and (hi - p) % gw == 0
    assert int(kept.min()) - lo < gw and hi - 1 - int(kept.max()) < gw


def test_to_ints_round_trip_and_bad_arguments():
    w = WindowMask((3, 5), (3, 1), 2, (1, 2))
    assert WindowMask.from_ints(w.to_ints()) == w and hash(WindowMask.from_ints(w.to_ints())) == hash(w)
    with pytest.raises(ValueError, match="window"):
        WindowMask(4, 0)
    with pytest.raises(ValueError, match="dilation"):
        WindowMask(4, 3, dilation=(1, 0))
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        WindowMask(4, 3, -1)
    q = torch.randn(1, 1, 10, 4)
    with pytest.raises(ValueError, match=r"WindowMask describes N = 1 prefix \+ 4x4 patches = 17 tokens"):
        attention(q, q, q, mask=WindowMask(4, 3, 1))


# ---- every path against the plain formula with the dense mask ------------------------------------------


# what each backend takes with a window: (normalizer, Gaussian bias) pairs, None = drawn
BACKEND_CALLS = {
    "sdpa": [("softmax", False), ("softmax", True)],
    "cpu_blocked": [("softmax", True), ("entmax15", False), ("entmax15", True)],
    "reference": [("sparsemax", None), (1.3, None), ("softmax", None), ("entmax15", None)],
}


@st.composite
def window_calls(draw, kinds=None):
    """A float64 call with a drawn window (mostly smaller than the grid), a normalizer and maybe a
    Gaussian bias on the same layout; ``kinds``: the (normalizer, bias) pairs to draw from."""
    w = draw(windows(max_grid=6))
    if draw(st.booleans()):  # a window that drops keys on most grids
        w = WindowMask(w.grid_size, draw(st.sampled_from([1, 2, 3, (3, 2)])), w.num_prefix_tokens, w.dilation)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b, h, n = draw(st.integers(1, 2)), draw(st.integers(1, 3)), w.num_tokens
    q, k, v = (torch.randn(b, h, n, 4, generator=g, dtype=torch.float64) for _ in range(3))
    call = {"q": q, "k": k, "v": v, "mask": w}
    kinds = kinds or [(nz, None) for nz in ("softmax", "entmax15", "sparsemax", 1.3)]
    call["normalizer"], with_bias = draw(st.sampled_from(kinds))
    if with_bias if with_bias is not None else draw(st.booleans()):
        np_ = w.grid_size[0] * w.grid_size[1]
        sigma = torch.exp(torch.randn(1, h, np_, 2, generator=g, dtype=torch.float64))
        alpha = torch.rand(1, h, np_, 1, generator=g, dtype=torch.float64) * 2
        call["bias"] = GaussianBias(sigma, alpha, w.grid_size, w.num_prefix_tokens)
    return call


def _leaves(call):
    out = [call["q"], call["k"], call["v"]]
    if "bias" in call:
        out += [call["bias"].sigma, call["bias"].alpha]
    return out


def _fresh(call):
    out = dict(call)
    for name in ("q", "k", "v"):
        out[name] = call[name].detach().clone().requires_grad_()
    if "bias" in call:
        gb = call["bias"]
        sigma, alpha = (t.detach().clone().requires_grad_() for t in (gb.sigma, gb.alpha))
        out["bias"] = GaussianBias(sigma, alpha, gb.grid_size, gb.num_prefix_tokens)
    return out


def _plain(call):
    """The plain formula (the `entmax` package's normalizers) with the independently built mask."""
    w, bias = call["mask"], call.get("bias")
    dense_bias = None
    if bias is not None:
        dense_bias = naive_gaug_bias(bias.sigma, bias.alpha, w.grid_size, w.num_prefix_tokens, w.grid_size)
    q, k, v = call["q"], call["k"], call["v"]
    return plain_attention(q, k, v, call["normalizer"], None, _naive(w), dense_bias)[0]


def _values_and_grads(fn, call):
    fresh = _fresh(call)
    out = fn(fresh)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    return out.detach(), torch.autograd.grad(out, _leaves(fresh), grad)


@settings(max_examples=30, deadline=None)
@given(st.data())
@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_every_backend_matches_the_plain_formula_with_the_dense_mask(backend, data):
    """Each backend on the calls it takes with a window (checked: it does take them)."""
    call = data.draw(window_calls(BACKEND_CALLS[backend]))
    assert explain(**call, backend=backend)[backend] is None
    atol = 2e-7 if call["normalizer"] == 1.3 else 1e-10  # the package bisects alpha-entmax to ~1e-8
    out, grads = _values_and_grads(lambda c: attention(**c, backend=backend), call)
    want, want_grads = _values_and_grads(_plain, call)
    torch.testing.assert_close(out, want, atol=atol, rtol=0)
    for got, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, ref, atol=50 * atol, rtol=0)


@settings(max_examples=40, deadline=None)
@given(window_calls(BACKEND_CALLS["cpu_blocked"]), st.sampled_from([7, 40, 10**6]), st.booleans())
def test_row_blocked_paths_over_several_blocks(call, block_elements, grad):
    """The row-blocked paths with blocks of a few rows (and of one row's part of a head), where a block's
    window rows start inside the prefix tokens or mid-grid, forward and backward."""
    w = call["mask"]

    def blocked(c):
        q, k, v, gb = c["q"], c["k"], c["v"], c.get("bias")
        if c["normalizer"] == "entmax15":
            return entmax15_attention(q, k, v, 0.5, gb, block_elements=block_elements, window=w)
        fn = gaussian_softmax_attention_train if grad else gaussian_softmax_attention
        return fn(q, k, v, 0.5, gb, block_elements=block_elements, window=w)

    def reference(c):
        return attention(**c, scale=0.5, backend="reference")

    if not grad:
        with torch.no_grad():
            torch.testing.assert_close(blocked(call), reference(call), atol=1e-12, rtol=0)
        return
    out, grads = _values_and_grads(blocked, call)
    want, want_grads = _values_and_grads(reference, call)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    for got, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("normalizer, with_bias", BACKEND_CALLS["cpu_blocked"])
@pytest.mark.parametrize("window, dilation, prefix", [((3, 2), 1, 1), (3, (2, 1), 0), ((1, 5), 1, 2)])
@pytest.mark.parametrize("block_elements", [30, 10**6])
def test_row_blocked_paths_on_fixed_layouts(normalizer, with_bias, window, dilation, prefix, block_elements):
    """The same on fixed layouts that drop both key rows and key columns (a 5x6 grid), values and
    gradients: every path and block split is reached whatever hypothesis draws."""
    g = torch.Generator().manual_seed(3)
    w = WindowMask((5, 6), window, prefix, dilation)
    q, k, v = (torch.randn(2, 2, w.num_tokens, 4, generator=g, dtype=torch.float64) for _ in range(3))
    call = {"q": q, "k": k, "v": v, "mask": w, "normalizer": normalizer}
    if with_bias:
        sigma = torch.rand(2, 1, 30, 2, generator=g, dtype=torch.float64) + 0.5
        alpha = torch.rand(2, 1, 30, 1, generator=g, dtype=torch.float64)
        call["bias"] = GaussianBias(sigma, alpha, (5, 6), prefix)
    assert not _naive(w)[prefix:, prefix:].all(0).any()  # every key is dropped by some query

    def blocked(c):
        q, k, v, gb = c["q"], c["k"], c["v"], c.get("bias")
        if normalizer == "entmax15":
            return entmax15_attention(q, k, v, 0.5, gb, block_elements=block_elements, window=w)
        return gaussian_softmax_attention_train(q, k, v, 0.5, gb, block_elements=block_elements, window=w)

    out, grads = _values_and_grads(blocked, call)
    want, want_grads = _values_and_grads(lambda c: attention(**c, scale=0.5, backend="reference"), call)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    for got, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    if normalizer == "softmax":  # the inference function too
        with torch.no_grad():
            bias = call["bias"]
            fast = gaussian_softmax_attention(q, k, v, 0.5, bias, block_elements=block_elements, window=w)
        torch.testing.assert_close(fast, want, atol=1e-12, rtol=0)


def test_scores_take_a_window_and_inf_keys_outside_it_do_not_reach_a_row():
    """``scores(mask=window)`` puts -inf outside the window; an inf key that a query's window drops
    leaves that query's output finite, on the paths that drop scores (reference, row-blocked). SDPA
    adds the mask as -inf to an inf score (NaN), for any boolean mask: not a window property."""
    w = WindowMask((4, 4), 3, 1)
    q, k, v = (torch.randn(1, 2, 17, 8) for _ in range(3))
    s = scores(q, k, mask=w)
    assert torch.equal(torch.isneginf(s[0, 0]), ~_naive(w))
    k_bad = k.clone()
    k_bad[0, 0, 1] = float("inf")  # patch (0, 0): outside the windows of the rows 2.. of the grid
    far = ~_naive(w)[:, 1]  # queries that drop key 1
    gb = GaussianBias(torch.rand(1, 2, 16, 2) + 0.5, torch.rand(1, 2, 16, 1), (4, 4), 1)
    for normalizer, bias in (("softmax", None), ("softmax", gb), ("entmax15", None), ("entmax15", gb)):
        for backend in ("cpu_blocked", "reference"):
            if explain(q, k_bad, v, normalizer=normalizer, mask=w, bias=bias, backend=backend)[backend]:
                continue
            out = attention(q, k_bad, v, normalizer=normalizer, mask=w, bias=bias, backend=backend)
            clean = attention(q, k, v, normalizer=normalizer, mask=w, bias=bias, backend="reference")
            assert torch.isfinite(out[0, 0, far]).all(), (normalizer, backend)
            torch.testing.assert_close(out[0, 0, far], clean[0, 0, far], atol=1e-5, rtol=1e-5)


# ---- dispatch --------------------------------------------------------------------------------------------


def test_which_backend_takes_a_window_and_why_the_others_decline():
    w = WindowMask((4, 4), 3, 1)
    q = torch.randn(2, 3, 17, 8)
    gb = GaussianBias(torch.rand(2, 3, 16, 2) + 0.5, torch.rand(2, 3, 16, 1), (4, 4), 1)
    plain = explain(q, q, q, mask=w)
    assert plain.chosen == "sdpa" and "window as an (N, N) boolean mask" in plain.path
    assert "SDPA computes that fused (a window: as a boolean mask)" in plain["cpu_blocked"]
    # the Triton kernels take windows (tests/test_kernels_window.py): on CPU they decline for the device only
    assert "not CUDA" in plain["triton"] or "on CUDA only" in plain["triton"]
    assert "WindowMask" not in plain["triton"]
    for normalizer, bias in (("softmax", gb), ("entmax15", None), ("entmax15", gb)):
        report = explain(q, q, q, normalizer=normalizer, mask=w, bias=bias)
        assert report.chosen == "cpu_blocked" and report.path.split(",")[0].endswith("+ window"), report
    sparse = explain(q, q, q, normalizer="sparsemax", mask=w)
    assert sparse.chosen == "reference" and "window keep-mask" in sparse.path
    assert "WindowMask(grid_size=(4, 4), window=(3, 3)" in str(sparse)


def test_the_fast_paths_without_a_window_are_unchanged():
    """No window: the row-blocked path names and choices of before (the window adds nothing there)."""
    q = torch.randn(2, 3, 17, 8)
    report = explain(q, q, q, normalizer="entmax15")
    assert report.path == "row-blocked entmax-1.5, inference, eager"


# ---- custom ops and torch.compile ------------------------------------------------------------------------


def _op_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = WindowMask((3, 4), 3, 1, (1, 2))
    q, k, v = (torch.randn(2, 3, 13, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sigma = torch.rand(2, 3, 12, 2, generator=g, dtype=torch.float64) + 0.5
    alpha = torch.rand(2, 3, 12, 1, generator=g, dtype=torch.float64)
    return w, q, k, v, sigma, alpha


def test_custom_ops_take_the_window():
    """The ops with a window (and without: the operand defaults to None) against the eager paths, and
    torch.library's opcheck with the window operand; the training ops' gradients against the reference."""
    from vitattn.functional.cpu.entmax import flat_factors
    from vitattn.functional.cpu.ops import entmax15_train_op, gaussian_softmax_train_op, inference_op
    from vitattn.functional.cpu.softmax import prepare

    w, q, k, v, sigma, alpha = _op_case()
    gb = GaussianBias(sigma, alpha, (3, 4), 1)
    ints = w.to_ints()
    ops = torch.ops.vitattn
    inference, softmax_train = ops.blocked_attention_cpu.default, ops.gaussian_attention_cpu_train.default
    torch.library.opcheck(inference, (q, k, v, sigma, alpha, 0.3, 3, 4, 1, 3, 4, False, ints))
    torch.library.opcheck(inference, (q, k, v, None, None, 0.3, 0, 0, 0, 0, 0, True, ints))
    qq, kk, vv, ra_t, c_t = prepare(q, k, v, gb, eager=False)
    torch.library.opcheck(softmax_train, (qq, kk, vv, ra_t, c_t, 0.3, 3, 4, 1, ints))
    ra, c = flat_factors(gb, 2, 3, q.dtype, eager=False)
    torch.library.opcheck(ops.entmax15_attention_cpu_train.default, (q, k, v, ra, c, 0.3, 3, 4, 1, ints))
    for normalizer, bias in (("softmax", gb), ("entmax15", None), ("entmax15", gb)):
        call = {"q": q, "k": k, "v": v, "normalizer": normalizer, "mask": w, "bias": bias}
        want = attention(**call, scale=0.3, backend="reference")
        got = inference_op(q, k, v, 0.3, bias, entmax=normalizer == "entmax15", window=w)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)

        def train_op(c, normalizer=normalizer):
            fn = gaussian_softmax_train_op if normalizer == "softmax" else entmax15_train_op
            return fn(c["q"], c["k"], c["v"], 0.3, c.get("bias"), w)

        call = {key: value for key, value in call.items() if value is not None}
        out, grads = _values_and_grads(train_op, call)
        ref, ref_grads = _values_and_grads(lambda c: attention(**c, scale=0.3, backend="reference"), call)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
        for got_g, want_g in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got_g, want_g, atol=1e-10, rtol=0)


@pytest.mark.slow
def test_compiled_window_layers_call_the_ops_and_match_eager():
    """torch.compile of window layers: a LocAt + window model calls the row-blocked ops (inference and
    training) and agrees with eager, gradients included; a softmax neighbourhood model compiles too."""
    import timm

    import vitattn

    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    for attention_kind, normalizer in (("locat", "softmax"), ("locat", "entmax15"), ("window", "softmax")):
        model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2)
        vitattn.patch(model, attention=attention_kind, normalizer=normalizer, window=3)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            torch.testing.assert_close(compiled.eval()(x), model.eval()(x), atol=1e-5, rtol=1e-5)
        out = compiled.train()(x)
        out.sum().backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        for name, grad in got.items():
            torch.testing.assert_close(grad, model.get_parameter(name).grad, atol=1e-5, rtol=1e-4, msg=name)
