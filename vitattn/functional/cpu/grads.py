"""Gradients shared by the CPU row-blocked backwards: q, k, v from one block's score gradient, and the
separable bias factors' gradients from one block's bias gradient."""

from __future__ import annotations

import torch

__all__ = ["accumulate_qkv_grads", "factor_grads_into"]


def accumulate_qkv_grads(
    ds: torch.Tensor,
    p: torch.Tensor,
    q_b: torch.Tensor,
    k: torch.Tensor,
    go_b: torch.Tensor,
    dq_b: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    first: bool,
) -> None:
    """The gradients of ``out = P v`` with ``scores = scale q kᵀ`` from one block of query rows.

    ``ds: (units, rows, Nk)`` is the scores' gradient of the block and ``p: (units, rows, Nk)`` its
    probabilities (or what multiplies ``go_b`` into ``dv``: any view, e.g. a keys-first block
    transposed), ``q_b: (units, rows, D)`` and ``go_b: (units, rows, Dv)`` the block's rows of q and of
    the output gradient, ``k: (units, Nk, D)``. Writes ``dq_b = scale ds k`` and, over the blocks of
    one head, accumulates ``dk += scale dsᵀ q_b`` and ``dv += pᵀ go_b`` (``first``: the head's first
    block writes them). The scale goes inside the products (no pass over their results).
    """
    beta = 0.0 if first else 1.0  # beta = 0: the first write reads nothing
    dv.baddbmm_(p.transpose(1, 2), go_b, beta=beta)
    dq_b.baddbmm_(ds, k, beta=0.0, alpha=scale)
    dk.baddbmm_(ds.transpose(1, 2), q_b, beta=beta, alpha=scale)


def factor_grads_into(
    ds_p: torch.Tensor,
    factors_t: tuple[torch.Tensor, torch.Tensor],
    lo: int,
    hi: int,
    grads_t: tuple[torch.Tensor, torch.Tensor],
    prod_buf: torch.Tensor,
) -> None:
    """The separable bias' factor gradients from one block's bias gradient, keys first.

    ``ds_p: (..., gh, gw, rows)`` is the gradient of the bias between patch keys and the patch
    queries ``lo:hi``; ``factors_t`` are ``(alpha R)ᵀ: (..., gh, Np)`` and ``Cᵀ: (..., gw, Np)``, the
    bias being ``(alpha R)[q, row_t] * C[q, col_t]``. Writes ``d(alpha R) = sum over columns of dS C``
    and ``dC = sum over rows of dS (alpha R)`` into columns ``lo:hi`` of ``grads_t`` (same shapes as
    ``factors_t``); ``prod_buf`` is flat scratch of at least ``ds_p.numel()`` elements.
    """
    ra_t, c_t = factors_t
    dra_t, dc_t = grads_t
    prod = prod_buf[: ds_p.numel()].view(ds_p.shape)
    torch.mul(ds_p, c_t[..., None, :, lo:hi], out=prod)
    torch.sum(prod, dim=-2, out=dra_t[..., lo:hi])
    torch.mul(ds_p, ra_t[..., :, None, lo:hi], out=prod)
    torch.sum(prod, dim=-3, out=dc_t[..., lo:hi])
