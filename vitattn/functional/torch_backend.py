"""The pure-PyTorch reference backend: every normalizer x mask x bias combination.

Softmax without returned weights goes through ``scaled_dot_product_attention`` (which computes the
same thing, fused); everything else materializes the ``(B, H, Nq, Nk)`` scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import AttentionCall, register_backend
from .gaussian import GaussianBias
from .normalize import normalize


def dense_bias(call: AttentionCall, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive bias as a tensor (``GaussianBias`` made dense), or ``None``."""
    if call.bias is None:
        return None
    if isinstance(call.bias, GaussianBias):
        return call.bias.dense(dtype)
    return call.bias.to(dtype)


def additive_mask(call: AttentionCall, dtype: torch.dtype) -> torch.Tensor | None:
    """Bias and mask folded into one additive float tensor (``-inf`` where the mask drops a key)."""
    add = dense_bias(call, dtype)
    mask = call.mask
    if mask is None:
        return add
    if mask.dtype == torch.bool:
        if add is None:
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return add.masked_fill(~mask, float("-inf"))
    mask = mask.to(dtype)
    return mask if add is None else add + mask


def scores_of(call: AttentionCall) -> torch.Tensor:
    """``(B, H, Nq, Nk)`` scores ``q kᵀ * scale + bias (+ mask)``; half inputs give float32 scores."""
    q, k = call.q, call.k
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)).mul_(call.scale)
    add = additive_mask(call, work)
    return scores if add is None else scores + add


class TorchBackend:
    """Reference implementation; supports every call."""

    name = "torch"

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        return None

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        if call.normalizer == "softmax" and not call.return_weights:
            return self._sdpa(call), None
        scores = scores_of(call)
        probs = normalize(scores, call.normalizer, masked=call.mask is not None)
        weights = probs
        if call.dropout_p > 0.0:
            probs = F.dropout(probs, p=call.dropout_p)
        out = torch.matmul(probs.to(call.v.dtype), call.v)
        return out, (weights if call.return_weights else None)

    @staticmethod
    def _sdpa(call: AttentionCall) -> torch.Tensor:
        mask = call.mask
        if call.bias is None and (mask is None or mask.dtype == torch.bool):
            attn_mask = mask
        else:
            attn_mask = additive_mask(call, call.q.dtype)
        return F.scaled_dot_product_attention(
            call.q, call.k, call.v, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=call.scale
        )


register_backend(TorchBackend())
