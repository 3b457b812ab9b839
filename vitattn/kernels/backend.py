"""The ``"triton"`` attention backend: what the fused kernels support, and the call into them.

Importing this module does not import triton; :meth:`TritonBackend.run` does, on first use.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence

import torch

from ..functional.dispatch import AttentionCall
from ..functional.dtypes import compute_dtype
from ..functional.gaussian import GaussianBias

MAX_HEAD_DIM = 128
MAX_BATCH_HEADS = 65535  # the launch grid's second axis
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NORMALIZERS = ("softmax", "entmax15")
TF32_ENV = "VITATTN_TRITON_TF32"
FLOAT32_REASON = (
    "float32 inputs go to SDPA/torch unless VITATTN_TRITON_TF32=1 or torch.backends.cuda.matmul.allow_tf32 "
    "is set"
)
_TRUE = ("1", "true", "on", "yes", "y")


def interpret_requested() -> bool:
    """``TRITON_INTERPRET`` is set to a true value (Triton's own reading of the variable)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def interpreter_mismatch() -> bool:
    """``TRITON_INTERPRET`` is set but triton was imported without it (its own helpers are compiled ones)."""
    lang = sys.modules.get("triton.language")
    return lang is not None and type(lang.zeros).__name__ != "InterpretedFunction"


def tf32_allowed() -> bool:
    """TF32 dots are allowed for float32 inputs: ``VITATTN_TRITON_TF32=1``, or torch's own matmul switch
    (``torch.backends.cuda.matmul.allow_tf32``, or ``fp32_precision == "tf32"`` in torch >= 2.9)."""
    if os.environ.get(TF32_ENV, "").strip().lower() in _TRUE:
        return True
    matmul = torch.backends.cuda.matmul
    with warnings.catch_warnings():  # newer torch deprecates reading allow_tf32
        warnings.simplefilter("ignore")
        if getattr(matmul, "fp32_precision", None) == "tf32":
            return True
        return bool(getattr(matmul, "allow_tf32", False))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype if autocast is on for ``device_type`` (cuda / cpu), else ``None``."""
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def launch_dtype(
    dtypes: Sequence[torch.dtype], autocast: torch.dtype | None = None
) -> tuple[torch.dtype | None, str | None]:
    """``(dtype, None)``: the one dtype q, k, v are cast to before the kernels run, or ``(None, reason)``.

    The autocast dtype when autocast is on (timm's ``qk_norm`` hands over float32 q, k and a bfloat16 v
    under autocast), else the common (promoted) dtype of the inputs. The kernels compute in float32,
    so an input whose :func:`~vitattn.functional.compute_dtype` is wider (float64) is declined: autocast
    does not narrow float64 either.
    """
    for dtype in dtypes:
        if not dtype.is_floating_point or compute_dtype(dtype) != torch.float32:
            return None, f"dtype {dtype} is not one of float16, bfloat16, float32"
    if autocast is not None:
        if autocast not in DTYPES:
            return None, f"autocast dtype {autocast} is not one of float16, bfloat16, float32"
        return autocast, None
    return functools.reduce(torch.promote_types, dtypes), None


def float32_reason(device_type: str, dtype: torch.dtype, explicit: bool, tf32: bool) -> str | None:
    """Why ``backend="auto"`` leaves float32 CUDA inputs to the other backends, or ``None``.

    The kernels' float32 path is IEEE float32 dots (slow, no tensor cores) unless TF32 is allowed;
    ``backend="auto"`` takes float32 on CUDA only with TF32 allowed. A named ``backend="triton"`` (and
    the CPU interpreter) still runs it, in IEEE float32 unless TF32 is allowed.
    """
    if device_type == "cuda" and dtype == torch.float32 and not explicit and not tf32:
        return FLOAT32_REASON
    return None


# ``F32_DOT`` of the kernels (a constexpr): how ``_common._dot`` multiplies.
DOT_NATIVE, DOT_IEEE, DOT_TF32 = 0, 1, 2


def dot_mode(dtype: torch.dtype, device_type: str, tf32: bool, interpreting: bool) -> int:
    """``DOT_TF32`` for float32 on a GPU with TF32 allowed, ``DOT_IEEE`` for other float32 (and for
    bfloat16 in the interpreter, whose numpy dot has no bfloat16), else ``DOT_NATIVE`` (fp16 / bf16
    tensor-core dots). The interpreter always runs float32 exactly (IEEE)."""
    if dtype == torch.float32:
        return DOT_TF32 if tf32 and device_type == "cuda" and not interpreting else DOT_IEEE
    if dtype == torch.bfloat16 and interpreting:
        return DOT_IEEE
    return DOT_NATIVE


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
        dtype, reason = launch_dtype([q.dtype, call.k.dtype, call.v.dtype], autocast_dtype(q.device.type))
        if reason is not None:
            return reason
        reason = float32_reason(q.device.type, dtype, explicit, tf32_allowed())
        if reason is not None:
            return reason
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

        autocast = autocast_dtype(call.q.device.type)
        dtype, reason = launch_dtype([call.q.dtype, call.k.dtype, call.v.dtype], autocast)
        if dtype is None:
            raise ValueError(f"backend='triton' cannot run this call: {reason}")
        q, k, v = (t.to(dtype) for t in (call.q, call.k, call.v))  # differentiable, no-op if equal
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
            q, k, v, entmax=call.normalizer == "entmax15", scale=call.scale, add=add, keep=keep, **kwargs,
        )
        # under autocast the output is in the autocast dtype (as SDPA's); otherwise in v's dtype
        return (out if autocast is not None else out.to(call.v.dtype)), None
