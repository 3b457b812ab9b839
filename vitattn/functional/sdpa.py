"""The ``"sdpa"`` backend: ``torch.nn.functional.scaled_dot_product_attention`` for the calls where it
computes what the reference computes: softmax, no returned weights, any mask or bias (a
:class:`~vitattn.functional.GaussianBias` made dense first), a :class:`~vitattn.functional.WindowMask`
(as its ``(N, N)`` boolean keep-mask, folded into the mask), dropout.

An additive float mask on the CPU runs SDPA's math kernel when a gradient is needed: the CPU's fused
kernel gets the backward of a row that a finite mask fills entirely (``finfo.min``, ``-1e30``) wrong,
taking each weight of that row as 1 where the forward (and the reference) has uniform weights."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .dispatch import AttentionCall, run_in_call_dtype
from .gaussian import GaussianBias
from .scoring import additive_terms, apply_mask, is_keep_mask

__all__ = ["SdpaBackend"]


def _additive(call: AttentionCall) -> bool:
    """Whether SDPA gets an additive float mask (a bias, or a float mask) rather than a boolean one."""
    return call.bias is not None or (call.mask is not None and not is_keep_mask(call.mask))


def _math_kernel(call: AttentionCall) -> bool:
    """SDPA's math kernel for a differentiated call with an additive mask on the CPU, whose fused
    backward is wrong on a row that a finite mask fills."""
    return _additive(call) and call.needs_grad and call.q.device.type == "cpu"


def _sdpa(call: AttentionCall) -> torch.Tensor:
    mask = call.mask
    window = None if call.window is None else call.window.dense(call.q.device)
    if not _additive(call):
        # SDPA gives a row whose keys are all dropped zeros, as the reference does
        attn_mask = mask if window is None else window if mask is None else mask & window
    else:
        attn_mask = apply_mask(additive_terms(call.bias, mask, call.q.dtype), window, call.q.dtype)
    kernel = sdpa_kernel(SDPBackend.MATH) if _math_kernel(call) else contextlib.nullcontext()
    with kernel:
        return F.scaled_dot_product_attention(
            call.q, call.k, call.v, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=call.scale
        )


class SdpaBackend:
    """PyTorch's fused softmax attention (flash / memory-efficient / math kernels)."""

    name = "sdpa"
    features = frozenset({"window"})

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        if call.normalizer != "softmax":
            return f"normalizer {call.normalizer!r} (SDPA computes softmax only)"
        if call.return_weights:
            return "return_weights=True (SDPA does not return the weights)"
        if min(*call.q.shape, call.k.shape[2], call.v.shape[3]) == 0:
            return "an empty dimension (B, H, Nq, Nk, D or Dv of 0: SDPA's output is then detached)"
        return None

    def builds_scores(self, call: AttentionCall) -> bool:
        """Whether the call builds ``(Nq, Nk)`` terms it did not bring: a Gaussian bias' dense bias or a
        window's boolean mask (SDPA then cannot take its flash kernel)."""
        return isinstance(call.bias, GaussianBias) or call.window is not None

    def path(self, call: AttentionCall) -> str:
        window = call.window is not None
        if not _additive(call):
            if window:
                both = " and the mask" if call.mask is not None else ""
                return f"scaled_dot_product_attention with the window as an (N, N) boolean mask{both}"
            return "scaled_dot_product_attention" + (" with the mask" if call.mask is not None else "")
        if call.bias is None:
            fold = "mask and window" if window else "mask"
            path = f"scaled_dot_product_attention with the {fold} as one additive mask"
        else:
            fold = "bias, mask and window" if window else "bias (and mask)"
            path = f"scaled_dot_product_attention with the {fold} as one dense additive mask"
        return path + (", math kernel (for the gradient on the CPU)" if _math_kernel(call) else "")

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        return run_in_call_dtype(call, _sdpa), None
