"""The ``"triton"`` attention backend: what the fused kernels support, and the call into them.

Importing this module does not import triton; :meth:`TritonBackend.run` does, on first use.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from ..functional.dispatch import AttentionCall
from ..functional.gaussian import GaussianBias

MAX_HEAD_DIM = 128
MAX_BATCH_HEADS = 65535  # the launch grid's second axis
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NORMALIZERS = ("softmax", "entmax15")


def interpret_requested() -> bool:
    """``TRITON_INTERPRET`` is set to a true value (Triton's own reading of the variable)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y")


def interpreter_mismatch() -> bool:
    """``TRITON_INTERPRET`` is set but triton was imported without it (its own helpers are compiled ones)."""
    lang = sys.modules.get("triton.language")
    return lang is not None and type(lang.zeros).__name__ != "InterpretedFunction"


def _tensors(call: AttentionCall) -> list[tuple[str, torch.Tensor]]:
    out = [("q", call.q), ("k", call.k), ("v", call.v)]
    if call.mask is not None:
        out.append(("mask", call.mask))
    if isinstance(call.bias, GaussianBias):
        out += [("bias.sigma", call.bias.sigma), ("bias.alpha", call.bias.alpha)]
    elif call.bias is not None:
        out.append(("bias", call.bias))
    return out


class TritonBackend:
    """Fused flash-style kernels: softmax / entmax-1.5 x no bias / Gaussian / additive / boolean mask."""

    name = "triton"

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        q = call.q
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if q.device.type != "cuda":
            if not interpret_requested():
                return f"q is on {q.device.type}, not CUDA, and TRITON_INTERPRET is unset"
            if not explicit:
                return (
                    f"q is on {q.device.type}: backend='auto' runs the Triton kernels on CUDA only "
                    "(pass backend='triton' to run them in the interpreter)"
                )
        if interpret_requested() and interpreter_mismatch():
            return "TRITON_INTERPRET=1 was set after triton was imported (set it before importing torch/timm)"
        for name, t in _tensors(call):
            if t.device != q.device:
                return f"{name} is on {t.device} but q is on {q.device}"
        if q.dtype not in DTYPES:
            return f"dtype {q.dtype} is not one of float16, bfloat16, float32"
        d, dv = q.shape[-1], call.v.shape[-1]
        if max(d, dv) > MAX_HEAD_DIM:
            return f"head dim D={d}, Dv={dv} exceeds {MAX_HEAD_DIM}"
        if call.return_weights:
            return "return_weights=True (the kernels never materialize the (B, H, Nq, Nk) weights)"
        if call.dropout_p > 0.0:
            return f"dropout_p={call.dropout_p} > 0 (the kernels have no dropout)"
        if call.normalizer not in NORMALIZERS:
            return f"normalizer {call.normalizer!r} is not softmax or entmax15"
        n_q, n_k = q.shape[2], call.k.shape[2]
        gauss_n = call.bias.num_tokens if isinstance(call.bias, GaussianBias) else None
        if gauss_n is not None and not n_q == n_k == call.v.shape[2] == gauss_n:
            return f"q/k/v must share N = {gauss_n} with a GaussianBias, got Nq={n_q}, Nk={n_k}"
        if q.shape[0] * q.shape[1] > MAX_BATCH_HEADS:
            return f"B * H = {q.shape[0] * q.shape[1]} exceeds {MAX_BATCH_HEADS}"
        if min(q.shape[0], q.shape[1], n_q, n_k, d, dv) == 0:
            return "an empty dimension"
        return None

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        from .ops import fused_attention

        add = keep = None
        kwargs = {}
        if isinstance(call.bias, GaussianBias):
            gb = call.bias
            kwargs = dict(sigma_den=gb.denominators(), alpha=gb.alpha, num_prefix=gb.num_prefix_tokens,
                          grid_w=gb.grid_size[1], clamp=gb.clamp)
        elif call.bias is not None:
            add = call.bias
        if call.mask is not None:
            if call.mask.dtype == torch.bool:
                keep = call.mask
            else:
                add = call.mask if add is None else add + call.mask
        if add is not None and add.dtype not in DTYPES:
            add = add.float()
        out = fused_attention(
            call.q, call.k, call.v, entmax=call.normalizer == "entmax15", scale=call.scale,
            add=add, keep=keep, **kwargs,
        )
        return out, None
