"""The ``"triton"`` attention backend: what the fused kernels support, and the call into them.

Importing this module does not import triton; :meth:`TritonBackend.run` does, on first use.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence

import torch

from ..functional.dispatch import AttentionCall, autocast_dtype, operand_dtype
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


@torch.compiler.assume_constant_result
def tf32_allowed() -> bool:
    """TF32 dots are allowed for float32 inputs: ``VITATTN_TRITON_TF32=1``, or torch's own matmul switch
    (``torch.backends.cuda.matmul.allow_tf32``, or ``fp32_precision == "tf32"`` in torch >= 2.9).

    A constant under ``torch.compile`` (read when the graph is traced, not guarded on)."""
    if os.environ.get(TF32_ENV, "").strip().lower() in _TRUE:
        return True
    matmul = torch.backends.cuda.matmul
    with warnings.catch_warnings():  # newer torch deprecates reading allow_tf32
        warnings.simplefilter("ignore")
        if getattr(matmul, "fp32_precision", None) == "tf32":
            return True
        return bool(getattr(matmul, "allow_tf32", False))


def launch_dtype(
    dtypes: Sequence[torch.dtype], autocast: torch.dtype | None = None
) -> tuple[torch.dtype | None, str | None]:
    """``(dtype, None)``: the one dtype q, k, v are cast to before the kernels run, or ``(None, reason)``.

    That dtype is :func:`~vitattn.functional.dispatch.operand_dtype` (``AttentionCall.dtype``), the
    rule of every backend. The kernels compute in float32, so an input whose
    :func:`~vitattn.functional.compute_dtype` is wider (float64) is declined (autocast does not narrow
    float64 either), and so is an autocast dtype the kernels do not take.
    """
    for dtype in dtypes:
        if not dtype.is_floating_point or compute_dtype(dtype) != torch.float32:
            return None, f"dtype {dtype} is not one of float16, bfloat16, float32"
    if autocast is not None and autocast not in DTYPES:
        return None, f"autocast dtype {autocast} is not one of float16, bfloat16, float32"
    return operand_dtype(dtypes, autocast), None


def call_launch_dtype(call: AttentionCall) -> tuple[torch.dtype | None, str | None]:
    """:func:`launch_dtype` of the call's q, k, v under the autocast state of q's device."""
    return launch_dtype([call.q.dtype, call.k.dtype, call.v.dtype], autocast_dtype(call.q.device.type))


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
        dtype, reason = call_launch_dtype(call)
        if dtype is None:
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

    def path(self, call: AttentionCall) -> str:
        """The kernels that run ``call``: the normalizer's forward kernel, and the backward kernels when
        autograd records it."""
        bias = "no bias" if call.bias is None else "additive bias"
        if isinstance(call.bias, GaussianBias):
            bias = "Gaussian bias"
        mask = "" if call.mask is None else ", mask"
        passes = "forward + backward" if call.needs_grad else "forward"
        return f"fused {call.normalizer} kernels ({bias}{mask}), {passes}, custom op vitattn::attention_fwd"

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, None)``: q, k, v cast to the launch dtype (differentiable), the call's mask and bias
        as kernel operands, straight into the custom op ``torch.ops.vitattn.attention_fwd``
        (:mod:`vitattn.kernels.ops`). ``out`` is in the launch dtype (``call.dtype``)."""
        from . import ops

        dtype, reason = call_launch_dtype(call)
        if dtype is None:
            raise ValueError(f"backend='triton' cannot run this call: {reason}")
        q, k, v = (t.to(dtype) for t in (call.q, call.k, call.v))  # no-op where equal
        b, h = q.shape[:2]
        add = keep = den = alpha = None
        num_prefix, grid_w, clamp = 0, 1, 0.0
        if isinstance(call.bias, GaussianBias):
            gb = call.bias
            n_p = gb.sigma.shape[-2]
            den = gb.denominators().float().expand(b, h, n_p, 2)
            alpha = gb.alpha.float()[..., 0].expand(b, h, n_p)
            num_prefix, grid_w, clamp = gb.num_prefix_tokens, gb.grid_size[1], float(gb.clamp)
        elif call.bias is not None:
            add = call.bias
        if call.mask is not None:
            if call.mask.dtype == torch.bool:
                keep = call.mask[(None,) * (4 - call.mask.dim())]
            else:
                add = call.mask if add is None else add + call.mask
        if add is not None:
            add = add[(None,) * (4 - add.dim())]
            if add.dtype not in DTYPES:
                add = add.float()
        entmax = call.normalizer == "entmax15"
        grads = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, add, den, alpha)
        )
        out, _, _ = ops.attention_fwd(
            q, k, v, add, keep, den, alpha, float(call.scale), int(num_prefix), int(grid_w), clamp, entmax,
            tf32_allowed(), entmax and grads,
        )
        return out, None
