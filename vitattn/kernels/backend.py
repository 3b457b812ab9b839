"""The ``"triton"`` attention backend: what the fused kernels support, and the call into them.

Importing this module does not import triton; :meth:`TritonBackend.run` does, on first use. The
environment helpers (interpreter flag, TF32, dot mode, launch dtype) live in :mod:`vitattn.kernels.env`,
shared with :mod:`vitattn.kernels.ops`, which does not import this module.
"""

from __future__ import annotations

import importlib.util

import torch

from ..functional.dispatch import AttentionCall, autocast_dtype
from ..functional.entmax_alpha import _check_alpha
from ..functional.gaussian import GaussianBias
from .env import DTYPES, float32_reason, interpret_requested, interpreter_mismatch, launch_dtype, tf32_allowed

MAX_HEAD_DIM = 128
MAX_BATCH_HEADS = 65535  # the launch grid's second axis
# the kernels' float32 grid coordinates of a Gaussian bias are exact below it (_tiles.coords_jump)
MAX_GAUSSIAN_TOKENS = 1 << 21
# backend="auto" leaves a plain softmax call (no bias, no mask, no window) with fewer scores than this
# (B * H * Nq * Nk) to SDPA: there the Triton path is bound by its host work. Measured on one H200
# (docs/kernels.md, "Host time per call"): at ViT-B/16's size (B 32, H 12, N 197: 2^23.8 scores) SDPA
# flash's fwd+bwd took 0.25-0.28 ms against the Triton path's 1.76-2.15 ms; at B 4, H 12, N 4096 (2^29.6) the
# Triton kernels beat SDPA flash (0.75-1.01x its time), and at N 16384 (2^31.6: 0.68-0.69x). The
# Triton path's host time there, about 1.7 ms per fwd+bwd, is its kernels' time at about 2^29 scores.
PLAIN_SOFTMAX_MIN_SCORES = 1 << 29
NORMALIZERS = ("softmax", "entmax15")


def call_launch_dtype(call: AttentionCall) -> tuple[torch.dtype | None, str | None]:
    """:func:`~vitattn.kernels.env.launch_dtype` of the call's q, k, v under the autocast state of q's
    device."""
    return launch_dtype([call.q.dtype, call.k.dtype, call.v.dtype], autocast_dtype(call.q.device.type))


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
    """Fused flash-style kernels: softmax / entmax-1.5 / alpha-entmax with a tensor of alphas x no bias /
    Gaussian / additive / boolean mask."""

    name = "triton"
    features = frozenset({"alpha_tensor", "window"})

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
        reason = float32_reason(q.device.type, dtype, explicit, _tf32(dtype))
        if reason is not None:
            return reason
        d, dv = q.shape[-1], call.v.shape[-1]
        if max(d, dv) > MAX_HEAD_DIM:
            return f"head dim D={d}, Dv={dv} exceeds {MAX_HEAD_DIM}"
        if call.return_weights:
            return "return_weights=True (the kernels never materialize the (B, H, Nq, Nk) weights)"
        if call.dropout_p > 0.0:
            return f"dropout_p={call.dropout_p} > 0 (the kernels have no dropout)"
        if isinstance(call.normalizer, torch.Tensor):
            if call.normalizer.device != q.device:
                return f"normalizer (alpha) is on {call.normalizer.device} but q is on {q.device}"
        elif call.normalizer not in NORMALIZERS:
            return f"normalizer {call.normalizer!r} is not softmax or entmax15 (nor a tensor of alphas)"
        n_q, n_k = q.shape[2], call.k.shape[2]
        gauss_n = call.bias.num_tokens if isinstance(call.bias, GaussianBias) else None
        if gauss_n is not None and not n_q == n_k == call.v.shape[2] == gauss_n:
            return f"q/k/v must share N = {gauss_n} with a GaussianBias, got Nq={n_q}, Nk={n_k}"
        if gauss_n is not None and gauss_n >= MAX_GAUSSIAN_TOKENS:
            return (
                f"a GaussianBias over N = {gauss_n} tokens (the kernels' float32 grid coordinates are exact "
                f"below {MAX_GAUSSIAN_TOKENS} tokens)"
            )
        win = call.window
        if win is not None and isinstance(call.bias, GaussianBias):
            gb = call.bias
            if (gb.grid_size, gb.num_prefix_tokens) != (win.grid_size, win.num_prefix_tokens):
                return (
                    f"the WindowMask's layout (grid {win.grid_size}, {win.num_prefix_tokens} prefix tokens) "
                    f"is not the GaussianBias' (grid {gb.grid_size}, {gb.num_prefix_tokens} prefix tokens)"
                )
        if q.shape[0] * q.shape[1] > MAX_BATCH_HEADS:
            return f"B * H = {q.shape[0] * q.shape[1]} exceeds {MAX_BATCH_HEADS}"
        if min(q.shape[0], q.shape[1], n_q, n_k, d, dv) == 0:
            return "an empty dimension"
        if not explicit:
            return _small_plain_softmax(call)
        return None

    def path(self, call: AttentionCall) -> str:
        """The kernels that run ``call``: the normalizer's forward kernel, and the backward kernels when
        autograd records it."""
        bias = "no bias" if call.bias is None else "additive bias"
        if isinstance(call.bias, GaussianBias):
            bias = "Gaussian bias"
        mask = "" if call.mask is None else ", mask"
        mask += "" if call.window is None else ", window"
        passes = "forward + backward" if call.needs_grad else "forward"
        name = "alpha-entmax" if isinstance(call.normalizer, torch.Tensor) else call.normalizer
        op = "vitattn::attention_fwd (the custom op when compiled, its body in eager)"
        return f"fused {name} kernels ({bias}{mask}), {passes}, {op}"

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
        window: list[int] = []
        if call.window is not None:
            window = call.window.to_ints()
            num_prefix, grid_w = call.window.num_prefix_tokens, call.window.grid_size[1]
        if call.mask is not None:
            if call.mask.dtype == torch.bool:
                keep = call.mask[(None,) * (4 - call.mask.dim())]
            else:
                add = call.mask if add is None else add + call.mask
        if add is not None:
            add = add[(None,) * (4 - add.dim())]
            if add.dtype not in DTYPES:
                add = add.float()
        ent = None
        if isinstance(call.normalizer, torch.Tensor):
            ent = _alphas(call, q.shape[2])
        entmax = call.normalizer == "entmax15" if ent is None else False
        grads = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, add, den, alpha, ent)
        )
        out, *_ = ops.attention_call(
            q,
            k,
            v,
            add,
            keep,
            den,
            alpha,
            ent,
            float(call.scale),
            int(num_prefix),
            int(grid_w),
            clamp,
            entmax,
            _tf32(dtype),
            (entmax or ent is not None) and grads,
            window,
        )
        return out, None


def _small_plain_softmax(call: AttentionCall) -> str | None:
    """Why ``backend="auto"`` leaves a plain softmax call below :data:`PLAIN_SOFTMAX_MIN_SCORES` scores
    to SDPA, or ``None``."""
    plain = isinstance(call.normalizer, str) and call.normalizer == "softmax"
    if not plain or call.bias is not None or call.mask is not None or call.window is not None:
        return None
    b, h, n_q, _ = call.q.shape
    scores = b * h * n_q * call.k.shape[2]  # no int(): symbolic sizes under torch.compile stay symbolic
    if scores >= PLAIN_SOFTMAX_MIN_SCORES:
        return None
    return (
        f"plain softmax over B*H*Nq*Nk = {scores} < 2^29 scores: SDPA's fused kernels are faster at this "
        "size, where the Triton path is bound by its host work (backend='triton' still runs it)"
    )


def _tf32(dtype: torch.dtype) -> bool:
    """Whether float32 dots may use TF32 (:func:`~vitattn.kernels.env.tf32_allowed`); read for float32
    launches only, the only ones it changes (torch's flags take a warnings filter to read: ~10 us)."""
    return dtype == torch.float32 and tf32_allowed()


def _alphas(call: AttentionCall, n_q: int) -> torch.Tensor:
    """The call's tensor of alphas as the kernels' float32 ``(B, H, Nq)`` operand (an expanded view,
    differentiable), its values checked (> 1, finite) outside ``torch.compile`` as
    :func:`~vitattn.functional.entmax` checks them."""
    alpha = call.normalizer
    assert isinstance(alpha, torch.Tensor)
    b, h = call.q.shape[:2]
    scores = alpha.new_empty(()).expand(b, h, n_q, call.k.shape[2])  # shape only: no memory
    _check_alpha(alpha, scores, -1, call.compiling)
    return alpha.float()[..., 0].expand(b, h, n_q)
