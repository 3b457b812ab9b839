"""The ``"sdpa"`` backend: ``torch.nn.functional.scaled_dot_product_attention`` for the calls where it
computes what the reference computes: softmax, no returned weights, any mask or bias (a
:class:`~vitattn.functional.GaussianBias` made dense first), dropout."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import AttentionCall, run_in_call_dtype
from .scoring import additive_terms, is_keep_mask

__all__ = ["SdpaBackend"]


def _sdpa(call: AttentionCall) -> torch.Tensor:
    mask = call.mask
    if call.bias is None and (mask is None or is_keep_mask(mask)):
        attn_mask = mask  # SDPA gives a row whose keys are all dropped zeros, as the reference does
    else:
        attn_mask = additive_terms(call.bias, mask, call.q.dtype)
    return F.scaled_dot_product_attention(
        call.q, call.k, call.v, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=call.scale
    )


class SdpaBackend:
    """PyTorch's fused softmax attention (flash / memory-efficient / math kernels)."""

    name = "sdpa"

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        if call.normalizer != "softmax":
            return f"normalizer {call.normalizer!r} (SDPA computes softmax only)"
        if call.return_weights:
            return "return_weights=True (SDPA does not return the weights)"
        if min(*call.q.shape[:3], call.k.shape[2]) == 0:
            return "an empty dimension (SDPA gives a bias or mask no gradient then)"
        return None

    def path(self, call: AttentionCall) -> str:
        if call.bias is None:
            return "scaled_dot_product_attention" + (" with the mask" if call.mask is not None else "")
        return "scaled_dot_product_attention with the bias (and mask) as one dense additive mask"

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        return run_in_call_dtype(call, _sdpa), None
