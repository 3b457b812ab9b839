"""The pure-PyTorch reference backend: every normalizer x mask x bias combination.

Softmax without returned weights goes through ``scaled_dot_product_attention`` (which computes the
same thing, fused), except CPU calls with a :class:`GaussianBias` and no mask, which go through the
row-blocked paths of :mod:`.blocked` (no dense bias): the forward-only one for inference, the
autograd function with a recomputing backward for training; under ``torch.compile`` both as custom
ops (:mod:`.blocked_ops`). entmax-1.5 on the CPU without weights, mask or dropout (no bias, or a
:class:`GaussianBias`) goes through the row-blocked path of :mod:`.blocked_entmax` (compiled: its
op, for inference only); everything else materializes the ``(B, H, Nq, Nk)`` scores.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .blocked import gaussian_softmax_attention, gaussian_softmax_attention_train
from .blocked_entmax import entmax15_attention
from .blocked_ops import blocked_attention_op, gaussian_attention_train_op
from .dispatch import AttentionCall, autocast_dtype, register_backend
from .gaussian import GaussianBias
from .normalize import normalize
from .scoring import additive_terms, is_keep_mask, scores_unchecked
from .scoring import dense_bias as _dense_bias


def dense_bias(call: AttentionCall, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive bias as a tensor (``GaussianBias`` made dense), or ``None``."""
    return _dense_bias(call.bias, dtype)


def additive_mask(call: AttentionCall, dtype: torch.dtype) -> torch.Tensor | None:
    """Bias and mask folded into one additive float tensor (``-inf`` where the mask drops a key)."""
    return additive_terms(call.bias, call.mask, dtype)


def scores_of(call: AttentionCall) -> torch.Tensor:
    """``(B, H, Nq, Nk)`` scores of a validated call: :func:`vitattn.functional.scores` of its fields."""
    return scores_unchecked(call.q, call.k, call.scale, call.bias, call.mask)


def _needs_grad(call: AttentionCall) -> bool:
    """Whether autograd will record this call (grad mode on and an input that requires a gradient);
    the bias is none or a :class:`GaussianBias`."""
    tensors = [call.q, call.k, call.v]
    if isinstance(call.bias, GaussianBias):
        tensors += [call.bias.sigma, call.bias.alpha]
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _blocked_gaussian_applies(call: AttentionCall) -> bool:
    """CPU, float32/64, Gaussian bias, no mask, no dropout, nothing that needs a gradient: the
    row-blocked inference path (eager, or under ``torch.compile`` as its custom op)."""
    return _gaussian_rows_fit(call) and not _needs_grad(call)


def _fused_gaussian_training_applies(call: AttentionCall) -> bool:
    """Like :func:`_blocked_gaussian_applies`, but for a call autograd records (training; under
    ``torch.compile`` as its custom ops)."""
    return _gaussian_rows_fit(call) and _needs_grad(call)


def _row_blocks_fit(call: AttentionCall) -> bool:
    """What every CPU row-blocked path needs: no mask, no dropout, CPU float32/64, and no bias or a
    :class:`GaussianBias` (not a dense one)."""
    if call.mask is not None or call.dropout_p > 0.0:
        return False
    if call.bias is not None and not isinstance(call.bias, GaussianBias):
        return False
    return call.q.device.type == "cpu" and call.q.dtype in (torch.float32, torch.float64)


def _gaussian_rows_fit(call: AttentionCall) -> bool:
    """:func:`_row_blocks_fit` with a Gaussian bias, self-attention (Nq = Nk)."""
    if not isinstance(call.bias, GaussianBias) or not _row_blocks_fit(call):
        return False
    return call.q.shape[2] == call.k.shape[2]


def _blocked_entmax_applies(call: AttentionCall) -> bool:
    """:func:`_row_blocks_fit` for entmax-1.5 that returns no weights; under ``torch.compile`` only
    for inference (its custom op has no backward)."""
    if call.normalizer != "entmax15" or call.return_weights or not _row_blocks_fit(call):
        return False
    return not (torch.compiler.is_compiling() and _needs_grad(call))


class TorchBackend:
    """Reference implementation; supports every call."""

    name = "torch"

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        return None

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k, v cast to ``call.dtype`` (differentiable), then computed with autocast off, so that
        scores and normalizers run in :func:`~vitattn.functional.compute_dtype` of it, as the kernels
        do; the output is in ``call.dtype``."""
        dtype = call.dtype
        if any(t.dtype != dtype for t in (call.q, call.k, call.v)):
            call = dataclasses.replace(call, q=call.q.to(dtype), k=call.k.to(dtype), v=call.v.to(dtype))
        device_type = call.q.device.type
        if autocast_dtype(device_type) is None:
            return self._run(call)
        with torch.autocast(device_type, enabled=False):
            return self._run(call)

    def _run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        if call.normalizer == "softmax" and not call.return_weights:
            if _blocked_gaussian_applies(call):
                assert isinstance(call.bias, GaussianBias)
                if torch.compiler.is_compiling():  # as a custom op: no per-thread buffers in the graph
                    return blocked_attention_op(call.q, call.k, call.v, call.scale, call.bias, False), None
                return gaussian_softmax_attention(call.q, call.k, call.v, call.scale, call.bias), None
            if _fused_gaussian_training_applies(call):
                assert isinstance(call.bias, GaussianBias)
                compiled = torch.compiler.is_compiling()
                train = gaussian_attention_train_op if compiled else gaussian_softmax_attention_train
                return train(call.q, call.k, call.v, call.scale, call.bias), None
            return self._sdpa(call), None
        if _blocked_entmax_applies(call):
            bias = call.bias if isinstance(call.bias, GaussianBias) else None
            if torch.compiler.is_compiling():
                return blocked_attention_op(call.q, call.k, call.v, call.scale, bias, True), None
            return entmax15_attention(call.q, call.k, call.v, call.scale, bias), None
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
        if call.bias is None and (mask is None or is_keep_mask(mask)):
            attn_mask = mask
        else:
            attn_mask = additive_mask(call, call.q.dtype)
        return F.scaled_dot_product_attention(
            call.q, call.k, call.v, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=call.scale
        )


register_backend(TorchBackend())
