"""Launch wrappers and the autograd Function of the fused attention kernels (this module imports triton).

Entry point: :func:`fused_attention`. Memory beyond the inputs and the output: the row statistic
(float32 ``(B, H, Nq)``), for entmax-1.5 with gradients ``OG`` (float32 ``(B, H, Nq, Dv)``), and in the
backward the row term ``delta`` (float32 ``(B, H, Nq)``); never anything ``Nq x Nk`` (the only
exception is the gradient of an additive mask, which has the mask's own shape).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch.autograd.function import once_differentiable

from . import configs
from .backend import dot_mode, tf32_allowed

_MODULES = ("_common", "softmax", "entmax15", "backward")
_KERNEL_ATTRS = {
    "fwd_softmax": ("softmax", "_fwd_softmax_kernel"),
    "fwd_entmax15": ("entmax15", "_fwd_entmax15_kernel"),
    "bwd_delta": ("backward", "_bwd_delta_kernel"),
    "bwd_dkdv": ("backward", "_bwd_dkdv_kernel"),
    "bwd_dq": ("backward", "_bwd_dq_kernel"),
}
_TUNED: dict[str, Any] = {}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernels() -> dict[str, Any]:
    """The raw kernels by name (``JITFunction`` objects, or interpreted ones under ``TRITON_INTERPRET=1``).

    ``@triton.jit`` reads the interpreter flag when a kernel is defined, so the kernel modules are
    re-imported if the flag changed since they were first imported.
    """
    from triton.runtime.interpreter import InterpretedFunction

    if interpreting() and not isinstance(triton.language.zeros, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported: set it before importing it")
    mods = {name: importlib.import_module(f"{__package__}.{name}") for name in _MODULES}
    probe = mods["softmax"]._fwd_softmax_kernel
    if isinstance(probe, InterpretedFunction) != interpreting():
        for name in _MODULES:
            mods[name] = importlib.reload(mods[name])
        _TUNED.clear()
    return {key: getattr(mods[mod], attr) for key, (mod, attr) in _KERNEL_ATTRS.items()}


def _tuned(name: str, fn: Any, block_d: int, masked: bool, fp32: bool = False) -> Any:
    """``fn`` wrapped in ``triton.autotune`` over the configs of ``name`` usable at ``block_d`` (with
    float32 operands if ``fp32``), cached.

    ``VITATTN_TRITON_TILES=first`` keeps only the first usable config (no autotuning: tests and memcheck
    runs that would otherwise compile and time every config).
    """
    first_only = os.environ.get("VITATTN_TRITON_TILES", "") == "first"
    key = f"{name}@{block_d}" + "".join(
        tag for tag, on in (("-masked", masked), ("-fp32", fp32), ("-first", first_only)) if on
    )
    if key not in _TUNED:
        tiles = configs.autotune_list(name, block_d, masked, fp32)
        if not tiles:
            raise RuntimeError(
                f"no tile config of {name} serves head dim {block_d} (masked={masked}, fp32={fp32})"
            )
        tiles = tiles[:1] if first_only else tiles
        flags = [p.name for p in fn.params if p.is_constexpr and not p.name.startswith("BLOCK")]
        _TUNED[key] = triton.autotune(
            configs=[
                triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps,
                              num_stages=c.num_stages)
                for c in tiles
            ],
            key=["n_q", "n_k", "head_d", "head_dv", *flags],
            reset_to_zero=["DADD"] if "DADD" in fn.arg_names else None,
        )(fn)
    return _TUNED[key]


def launch_device(tensors: Iterable[Any]) -> torch.device | None:
    """The device of the first CUDA tensor among ``tensors`` (``None`` if none is on CUDA)."""
    for t in tensors:
        dev = getattr(t, "device", None)
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return dev
    return None


def device_guard(tensors: Iterable[Any]) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(index)`` of the tensors' CUDA device (a no-op on CPU / in the interpreter).

    Triton launches on the *current* device and its current stream: without the guard a tensor on
    ``cuda:1`` while device 0 is current is read by a kernel running on device 0.
    """
    dev = launch_device(tensors)
    if dev is None:
        return contextlib.nullcontext()
    return torch.cuda.device(dev.index)


def _launch(name: str, grid: Callable[[int, int], tuple[int, ...]], args: Sequence[Any], **meta: Any) -> None:
    fn = kernels()[name]
    with device_guard(args):
        if interpreting():
            c = configs.INTERPRET
            fn[grid(c.block_m, c.block_n)](*args, BLOCK_M=c.block_m, BLOCK_N=c.block_n, **meta)
        else:
            block_d = max(meta["BLOCK_D"], meta["BLOCK_DV"])
            masked = bool(meta["HAS_ADD"] or meta["HAS_KEEP"])
            fp32 = bool(meta["F32_DOT"])  # on a GPU: float32 operands (TF32 or IEEE)
            _tuned(name, fn, block_d, masked, fp32)[lambda m: grid(m["BLOCK_M"], m["BLOCK_N"])](*args, **meta)


def block_dim(d: int) -> int:
    """Head dims are padded (with masks) to a power of two >= 16: the smallest ``tl.dot`` operand."""
    return max(16, triton.next_power_of_2(d))


def _bcast_strides(t: torch.Tensor) -> list[int]:
    """Strides of a 4-D operand with 0 on its size-1 (broadcast) dims."""
    return [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride(), strict=True)]


@dataclass(frozen=True)
class _Problem:
    """Everything a launch needs besides q, k, v and the per-pass buffers (the autograd Function keeps
    the scalars in ``ctx`` and the tensors in ``save_for_backward``)."""

    add: torch.Tensor | None  # 4-D additive float mask (broadcast dims of size 1)
    keep: torch.Tensor | None  # 4-D uint8 keep-mask view
    den: torch.Tensor | None  # float32 (B, H, Np, 2) = r * sigma + eps, expanded
    alpha: torch.Tensor | None  # float32 (B, H, Np), expanded
    scale: float
    num_prefix: int
    grid_w: int
    clamp: float
    entmax: bool
    tf32: bool = False  # TF32 dots for float32 inputs on a GPU (fixed at the forward, reused by the backward)

    def operands(self, dummy: torch.Tensor) -> list[Any]:
        """``ADD, KEEP, DEN, ALPHA`` pointers (a dummy where absent)."""
        return [dummy if t is None else t for t in (self.add, self.keep, self.den, self.alpha)]

    def strides(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[int]:
        out = [*q.stride(), *k.stride(), *v.stride()]
        out += _bcast_strides(self.add) if self.add is not None else [0] * 4
        out += _bcast_strides(self.keep) if self.keep is not None else [0] * 4
        out += list(self.den.stride()) if self.den is not None else [0] * 4
        out += list(self.alpha.stride()) if self.alpha is not None else [0] * 3
        return out

    def scalars(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[Any]:
        return [q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], self.scale, self.num_prefix,
                self.grid_w, self.clamp]

    def flags(self, q: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
        return dict(
            GAUSS=self.den is not None, HAS_ADD=self.add is not None, HAS_KEEP=self.keep is not None,
            F32_DOT=dot_mode(q.dtype, q.device.type, self.tf32, interpreting()),
            BLOCK_D=block_dim(q.shape[3]), BLOCK_DV=block_dim(v.shape[3]),
        )


def _forward(q, k, v, prob: _Problem, store_og: bool):
    b, h, n_q, _ = q.shape
    dv = v.shape[3]
    dummy = q.new_empty(1, dtype=torch.float32)
    out = torch.empty(b, h, n_q, dv, device=q.device, dtype=v.dtype)
    stat = torch.empty(b, h, n_q, device=q.device, dtype=torch.float32)
    og = torch.empty(b, h, n_q, dv, device=q.device, dtype=torch.float32) if store_og else None
    head = [q, k, v, out, stat, *prob.operands(dummy)]
    meta = prob.flags(q, v)
    if prob.entmax:
        head.append(dummy if og is None else og)
        meta["STORE_OG"] = store_og
    args = [*head, *prob.strides(q, k, v), *prob.scalars(q, k, v)]
    name = "fwd_entmax15" if prob.entmax else "fwd_softmax"
    _launch(name, lambda bm, bn: (triton.cdiv(n_q, bm), b * h), args, **meta)
    return out, stat, og


def _backward(ctx, grad_out: torch.Tensor):
    q, k, v, o_or_og, stat, add, keep, den, alpha = ctx.saved_tensors
    prob = dataclasses.replace(ctx.problem, add=add, keep=keep, den=den, alpha=alpha)
    b, h, n_q, d = q.shape
    n_k, dv = k.shape[2], v.shape[3]
    do = grad_out.contiguous()
    dummy = q.new_empty(1, dtype=torch.float32)

    delta = torch.empty(b, h, n_q, device=q.device, dtype=torch.float32)
    rows = configs.INTERPRET_DELTA_ROWS if interpreting() else configs.DELTA_ROWS
    with device_guard([o_or_og]):
        kernels()["bwd_delta"][(triton.cdiv(b * h * n_q, rows),)](
            o_or_og, do, delta, b * h * n_q, dv, BLOCK_M=rows, BLOCK_DV=block_dim(dv)
        )

    dq = torch.empty(b, h, n_q, d, device=q.device, dtype=q.dtype)
    dk = torch.empty(b, h, n_k, d, device=q.device, dtype=k.dtype)
    dvv = torch.empty(b, h, n_k, dv, device=q.device, dtype=v.dtype)
    add_grad, dadd, g_strides = 0, None, [0] * 4
    if add is not None and ctx.needs_input_grad[3]:
        dadd = torch.zeros(add.shape, device=q.device, dtype=torch.float32)
        g_strides = _bcast_strides(dadd)
        broadcast = [s for s, t in zip(add.shape, (b, h, n_q, n_k), strict=True) if s == 1 and t > 1]
        add_grad = 2 if broadcast else 1
    gauss_grad = den is not None and (ctx.needs_input_grad[4] or ctx.needs_input_grad[5])
    dden = dalpha = None
    if gauss_grad:
        dden = torch.empty(den.shape, device=q.device, dtype=torch.float32)
        dalpha = torch.empty(alpha.shape, device=q.device, dtype=torch.float32)

    meta = prob.flags(q, v)
    meta["ENTMAX"] = prob.entmax
    common = [*prob.strides(q, k, v)]
    scalars = prob.scalars(q, k, v)
    _launch(
        "bwd_dkdv", lambda bm, bn: (triton.cdiv(n_k, bn), b * h),
        [q, k, v, do, stat, delta, dk, dvv, *prob.operands(dummy), *common, *scalars], **meta,
    )
    _launch(
        "bwd_dq", lambda bm, bn: (triton.cdiv(n_q, bm), b * h),
        [q, k, v, do, stat, delta, dq, dummy if dadd is None else dadd, dummy if dden is None else dden,
         dummy if dalpha is None else dalpha, *prob.operands(dummy), *common, *g_strides, *scalars],
        ADD_GRAD=add_grad, GAUSS_GRAD=gauss_grad, **meta,
    )
    grad_add = None if dadd is None else dadd.to(add.dtype)
    return dq, dk, dvv, grad_add, dden, dalpha


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, add, den, alpha, keep, scalars):  # type: ignore[override]
        prob = dataclasses.replace(scalars, add=add, keep=keep, den=den, alpha=alpha)
        needs_grad = any(ctx.needs_input_grad[:6])
        out, stat, og = _forward(q, k, v, prob, store_og=prob.entmax and needs_grad)
        ctx.problem = scalars
        ctx.save_for_backward(q, k, v, og if prob.entmax else out, stat, add, keep, den, alpha)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        return (*_backward(ctx, grad_out), None, None)


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    entmax: bool,
    scale: float,
    add: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    sigma_den: torch.Tensor | None = None,
    alpha: torch.Tensor | None = None,
    num_prefix: int = 0,
    grid_w: int = 1,
    clamp: float = 0.0,
    tf32: bool | None = None,
) -> torch.Tensor:
    """``normalize(q kᵀ * scale + gaussian + add, masked by keep) v`` with the fused kernels.

    Args:
        q, k, v: ``(B, H, Nq, D)``, ``(B, H, Nk, D)``, ``(B, H, Nk, Dv)``, one of float16 / bfloat16 /
            float32, any strides.
        entmax: entmax-1.5 instead of softmax.
        add: additive float mask broadcastable to ``(B, H, Nq, Nk)`` (gets a gradient if it requires one).
        keep: boolean keep-mask broadcastable to ``(B, H, Nq, Nk)`` (``True`` = attend).
        sigma_den: ``(B', H', Np, 2)`` Gaussian denominators ``r * sigma + eps`` (broadcastable in B, H).
        alpha: ``(B', H', Np, 1)`` Gaussian amplitudes.
        num_prefix, grid_w, clamp: prefix tokens, grid columns and the lower clamp of the Gaussian bias.
        tf32: TF32 dots for float32 inputs on a GPU (``None``: :func:`~vitattn.kernels.backend.tf32_allowed`);
            float32 in the interpreter is always IEEE.

    Returns:
        ``(B, H, Nq, Dv)`` in v's dtype; rows with every key masked are 0.
    """
    b, h = q.shape[:2]
    add4 = None if add is None else add[(None,) * (4 - add.dim())]
    keep4 = None if keep is None else keep[(None,) * (4 - keep.dim())].view(torch.uint8)
    den = alp = None
    if sigma_den is not None:
        assert alpha is not None
        n_p = sigma_den.shape[-2]
        den = sigma_den.float().expand(b, h, n_p, 2)
        alp = alpha.float()[..., 0].expand(b, h, n_p)
    scalars = _Problem(
        None, None, None, None, float(scale), int(num_prefix), int(grid_w), float(clamp), bool(entmax),
        tf32=tf32_allowed() if tf32 is None else bool(tf32),
    )
    return _FusedAttention.apply(q, k, v, add4, den, alp, keep4, scalars)
