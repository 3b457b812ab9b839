"""Shared ``@triton.jit`` helpers of every attention kernel: tile loads, the score tile (``q kᵀ`` scaled,
plus the in-kernel Gaussian bias, the additive mask and the boolean mask) and the probabilities from
the saved row statistic. Every formula of the pipeline lives here once; the kernels only loop.

Conventions: a score tile is ``(BLOCK_M, BLOCK_N)`` float32, queries along rows and keys along columns,
``-inf`` wherever a key is masked or out of range. Masked loads fill with 0 (and padded head-dim
columns are zero in both operands, so they add nothing to ``q kᵀ``).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# Newton's stopping tolerance for the entmax threshold: sqrt(float32 eps), as in the torch path.
NEWTON_TOL: tl.constexpr = tl.constexpr(3.4526698e-04)
# A bound on the Newton passes over the keys (typically 2-8 are needed), not a tuning knob.
NEWTON_MAX_STEPS: tl.constexpr = tl.constexpr(32)


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """``a @ b`` accumulated in float32. ``F32_DOT`` (see ``backend.dot_mode``): 0 = the operands' own
    dot (fp16 / bf16 tensor cores), 1 = both upcast, IEEE float32, 2 = float32 operands as TF32."""
    if F32_DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    elif F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _offset(base, b, h, stride_b, stride_h):
    """Pointer to the ``(b, h)`` slice, in 64-bit arithmetic (large masks overflow int32)."""
    return base + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _tile_ptrs(base, offs_r, offs_c, stride_r, stride_c):
    """``base + offs_r * stride_r + offs_c * stride_c`` in 64-bit arithmetic: with a permuted layout (a
    row stride of B * H * D, a transposed operand) or a flat row index over B * H * N rows, the products
    pass 2^31 long before any tensor does."""
    return base + offs_r.to(tl.int64)[:, None] * stride_r + offs_c.to(tl.int64)[None, :] * stride_c


@triton.jit
def _load_tile(base, offs_r, offs_c, stride_r, stride_c, n_r, n_c):
    """``(len(offs_r), len(offs_c))`` tile with zeros outside ``n_r x n_c``."""
    ptrs = _tile_ptrs(base, offs_r, offs_c, stride_r, stride_c)
    return tl.load(ptrs, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c), other=0.0)


@triton.jit
def _store_tile(base, value, offs_r, offs_c, stride_r, stride_c, n_r, n_c):
    ptrs = _tile_ptrs(base, offs_r, offs_c, stride_r, stride_c)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c))


@triton.jit
def _gauss_rows(den_base, alpha_base, offs_m, n_q, num_prefix, s_dp, s_dc, s_ap):
    """Per query row: ``1 / den_row``, ``1 / den_col`` and ``alpha`` (alpha = 0 on prefix / padded rows).

    ``den`` is ``(.., Np, 2)`` = ``r * sigma + eps``; ``alpha`` is ``(.., Np)``; row ``i`` is patch ``i - P``.
    """
    p = offs_m - num_prefix
    ok = (p >= 0) & (offs_m < n_q)
    p = tl.where(ok, p, 0).to(tl.int64)
    inv_r = 1.0 / tl.load(den_base + p * s_dp, mask=ok, other=1.0).to(tl.float32)
    inv_c = 1.0 / tl.load(den_base + p * s_dp + s_dc, mask=ok, other=1.0).to(tl.float32)
    alpha = tl.load(alpha_base + p * s_ap, mask=ok, other=0.0).to(tl.float32)
    return inv_r, inv_c, alpha


@triton.jit
def _gauss_tile(offs_m, offs_n, n_k, inv_r, inv_c, alpha, num_prefix, grid_w, clamp):
    """GAug bias of a tile: ``(bias, e, a_row, a_col)`` with ``bias = alpha * e``, ``e = exp(a_row + a_col)``,
    ``a_m = max(-(coord_p,m - coord_t,m)^2 / 2, clamp) / den_p,m``; zero on prefix rows / columns."""
    pm = tl.maximum(offs_m - num_prefix, 0)
    pn = tl.maximum(offs_n - num_prefix, 0)
    d_row = ((pm // grid_w)[:, None] - (pn // grid_w)[None, :]).to(tl.float32)
    d_col = ((pm % grid_w)[:, None] - (pn % grid_w)[None, :]).to(tl.float32)
    a_row = tl.maximum(-0.5 * d_row * d_row, clamp) * inv_r[:, None]
    a_col = tl.maximum(-0.5 * d_col * d_col, clamp) * inv_c[:, None]
    inside = (offs_m[:, None] >= num_prefix) & (offs_n[None, :] >= num_prefix) & (offs_n[None, :] < n_k)
    e = tl.where(inside, tl.exp(a_row + a_col), 0.0)
    return alpha[:, None] * e, e, a_row, a_col


@triton.jit
def _scores(
    qk, gbias, offs_m, offs_n, n_q, n_k, scale,
    add_base, s_am, s_an, keep_base, s_km, s_kn,
    GAUSS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_KEEP: tl.constexpr,
):
    """``z = qk * scale (+ gaussian) (+ additive)``, ``-inf`` where masked or out of range."""
    z = qk * scale
    if GAUSS:
        z += gbias
    valid = (offs_m[:, None] < n_q) & (offs_n[None, :] < n_k)
    if HAS_ADD:
        add = tl.load(_tile_ptrs(add_base, offs_m, offs_n, s_am, s_an), mask=valid, other=0.0)
        z += add.to(tl.float32)
    if HAS_KEEP:
        keep = tl.load(_tile_ptrs(keep_base, offs_m, offs_n, s_km, s_kn), mask=valid, other=0)
        valid = valid & (keep != 0)
    return tl.where(valid, z, float("-inf"))


@triton.jit
def _probs(z, stat, ENTMAX: tl.constexpr):
    """``(p, g)`` of a score tile from the saved row statistic.

    softmax: ``stat`` = log-sum-exp, ``p = exp(z - stat)``, ``g = p``.
    entmax-1.5: ``stat`` = threshold tau in units of ``z / 2``, ``g = (z / 2 - tau)_+``, ``p = g^2``.
    Dead rows carry ``stat = +inf`` and give zeros.
    """
    if ENTMAX:
        g = tl.maximum(0.5 * z - stat[:, None], 0.0)
        return g * g, g
    else:
        p = tl.exp2((z - stat[:, None]) * LOG2E)
        return p, p


@triton.jit
def _score_block(
    q, k, offs_m, offs_n, n_q, n_k, scale,
    add_base, s_am, s_an, keep_base, s_mm, s_mn,
    inv_r, inv_c, alpha, num_prefix, grid_w, clamp,
    GAUSS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_KEEP: tl.constexpr, F32_DOT: tl.constexpr,
):
    """The masked score tile ``z`` of query tile ``q (BLOCK_M, D)`` against key tile ``k (BLOCK_N, D)``."""
    gbias = 0.0
    if GAUSS:
        gbias, _e, _ar, _ac = _gauss_tile(offs_m, offs_n, n_k, inv_r, inv_c, alpha, num_prefix, grid_w, clamp)
    return _scores(
        _dot(q, tl.trans(k), F32_DOT), gbias, offs_m, offs_n, n_q, n_k, scale,
        add_base, s_am, s_an, keep_base, s_mm, s_mn, GAUSS, HAS_ADD, HAS_KEEP,
    )
