"""The environment the kernels run in, read without importing triton: the interpreter flag, TF32, the
dot mode of float32 operands and the one launch dtype.

:mod:`vitattn.kernels.backend` (the dispatcher's side) and :mod:`vitattn.kernels.ops` (the launch side)
both import from here, and neither imports the other's module for these helpers.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence

import torch

from ..functional.dispatch import operand_dtype
from ..functional.dtypes import compute_dtype

__all__ = [
    "DOT_IEEE",
    "DOT_NATIVE",
    "DOT_TF32",
    "DTYPES",
    "FLOAT32_REASON",
    "TF32_ENV",
    "dot_mode",
    "float32_reason",
    "interpret_requested",
    "interpreter_mismatch",
    "launch_dtype",
    "tf32_allowed",
]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TF32_ENV = "VITATTN_TRITON_TF32"
FLOAT32_REASON = (
    "float32 inputs go to SDPA/torch unless VITATTN_TRITON_TF32=1 or torch.backends.cuda.matmul.allow_tf32 "
    "is set"
)
_TRUE = ("1", "true", "on", "yes", "y")

# ``F32_DOT`` of the kernels (a constexpr): how ``_common._dot`` multiplies.
DOT_NATIVE, DOT_IEEE, DOT_TF32 = 0, 1, 2


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
        try:
            return bool(getattr(matmul, "allow_tf32", False))
        except RuntimeError:  # torch refuses the legacy flag once both APIs were used: the new one said no
            return False


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


def float32_reason(device_type: str, dtype: torch.dtype, explicit: bool, tf32: bool) -> str | None:
    """Why ``backend="auto"`` leaves float32 CUDA inputs to the other backends, or ``None``.

    The kernels' float32 path is IEEE float32 dots (slow, no tensor cores) unless TF32 is allowed;
    ``backend="auto"`` takes float32 on CUDA only with TF32 allowed. A named ``backend="triton"`` (and
    the CPU interpreter) still runs it, in IEEE float32 unless TF32 is allowed.
    """
    if device_type == "cuda" and dtype == torch.float32 and not explicit and not tf32:
        return FLOAT32_REASON
    return None


def dot_mode(dtype: torch.dtype, device_type: str, tf32: bool, interpreting: bool) -> int:
    """``DOT_TF32`` for float32 on a GPU with TF32 allowed, ``DOT_IEEE`` for other float32 (and for
    bfloat16 in the interpreter, whose numpy dot has no bfloat16), else ``DOT_NATIVE`` (fp16 / bf16
    tensor-core dots). The interpreter always runs float32 exactly (IEEE)."""
    if dtype == torch.float32:
        return DOT_TF32 if tf32 and device_type == "cuda" and not interpreting else DOT_IEEE
    if dtype == torch.bfloat16 and interpreting:
        return DOT_IEEE
    return DOT_NATIVE
