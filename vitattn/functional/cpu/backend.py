"""The ``"cpu_blocked"`` backend: the row-blocked CPU paths (Gaussian-biased softmax and entmax-1.5,
with or without a :class:`~vitattn.functional.WindowMask`, eager or as custom ops under
``torch.compile``, for inference and for training)."""

from __future__ import annotations

import torch

from ..dispatch import AttentionCall, run_in_call_dtype
from ..gaussian import GaussianBias
from . import entmax, ops, softmax

__all__ = ["CpuBlockedBackend"]

_DTYPES = (torch.float32, torch.float64)


class CpuBlockedBackend:
    """Row-blocked attention on the CPU without any ``N x N`` tensor: softmax with a
    :class:`GaussianBias` (the LocAt path) and entmax-1.5 with or without one."""

    name = "cpu_blocked"
    features = frozenset({"window"})  # written block by block (.window_blocks)

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        q = call.q
        if q.device.type != "cpu":
            return f"q is on {q.device.type}: the row-blocked paths run on the CPU"
        dtype = call.dtype
        if dtype not in _DTYPES:
            return f"dtype {dtype}: the row-blocked paths compute in float32 or float64"
        if call.return_weights:
            return "return_weights=True (the row-blocked paths never hold the (B, H, Nq, Nk) weights)"
        if call.mask is not None:
            return "a mask (the row-blocked paths take none)"
        if call.dropout_p > 0.0:
            return f"dropout_p={call.dropout_p} > 0 (the row-blocked paths have no dropout)"
        if call.bias is not None and not isinstance(call.bias, GaussianBias):
            return "a dense bias tensor (only a GaussianBias is written block by block)"
        if call.normalizer == "softmax":
            if call.bias is None:
                window = " (a window: as a boolean mask)" if call.window is not None else ""
                return f"softmax without a Gaussian bias (SDPA computes that fused{window})"
        elif call.normalizer != "entmax15":
            return f"normalizer {call.normalizer!r} (the row-blocked paths compute softmax and entmax15)"
        if min(*q.shape, call.k.shape[2], call.v.shape[3]) == 0:
            return "an empty dimension (B, H, Nq, Nk, D or Dv of 0)"
        return None

    def path(self, call: AttentionCall) -> str:
        """Which row-blocked path runs ``call`` (one the backend supports)."""
        kind = "Gaussian softmax" if call.normalizer == "softmax" else "entmax-1.5"
        if call.normalizer == "entmax15" and call.bias is not None:
            kind += " + Gaussian bias"
        if call.window is not None:
            kind += " + window"
        mode = "training" if call.needs_grad else "inference"
        if call.compiling:
            op = "vitattn::blocked_attention_cpu"
            if call.needs_grad:
                op = (
                    "vitattn::gaussian_attention_cpu_train"
                    if call.normalizer == "softmax"
                    else "vitattn::entmax15_attention_cpu_train"
                )
            return f"row-blocked {kind}, {mode}, custom op {op}"
        if call.needs_grad:
            return f"row-blocked {kind}, {mode}, autograd Function with a row-blocked backward"
        return f"row-blocked {kind}, {mode}, eager"

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        return run_in_call_dtype(call, self._run), None

    @staticmethod
    def _run(call: AttentionCall) -> torch.Tensor:
        q, k, v, scale = call.q, call.k, call.v, call.scale
        bias = call.bias if isinstance(call.bias, GaussianBias) else None
        window = call.window
        is_softmax = call.normalizer == "softmax"
        if call.compiling:  # the eager code as opaque ops: no per-thread buffers in the graph
            if not call.needs_grad:
                return ops.inference_op(q, k, v, scale, bias, entmax=not is_softmax, window=window)
            if is_softmax:
                assert bias is not None
                return ops.gaussian_softmax_train_op(q, k, v, scale, bias, window)
            return ops.entmax15_train_op(q, k, v, scale, bias, window)
        if is_softmax:
            assert bias is not None
            if call.needs_grad:
                return softmax.gaussian_softmax_attention_train(q, k, v, scale, bias, window=window)
            return softmax.gaussian_softmax_attention(q, k, v, scale, bias, window=window)
        return entmax.entmax15_attention(q, k, v, scale, bias, window=window)
