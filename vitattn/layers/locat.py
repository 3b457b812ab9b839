"""LocAt attention: self-attention with the Gaussian locality bias of GAug (LocAtViT)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import nn

from ..functional import GaussianBias, compute_dtype
from ..functional._checks import grid_pair  # re-exported: its home was here
from ..functional.normalize import Normalizer
from .attention import Attention

__all__ = [
    "IDENTITY_ALPHA",
    "GaugInit",
    "GaussianAugment",
    "LocAtAttention",
    "check_gaug_init",
    "gaussian_bias_from_queries",
    "grid_pair",
]

#: How fresh GAug heads start: ``"paper"`` (LocAtViT's init, α ≈ ln 2) or ``"identity"`` (α =
#: :data:`IDENTITY_ALPHA` for every query, so a pretrained model keeps its function at patch time).
GaugInit = Literal["paper", "identity"]

#: The amplitude α of the ``"identity"`` start. The bias a query adds to its scores lies in [0, α], so
#: each attention row moves by a factor within [e^-α, e^α] and a block's output by about α times the
#: spread of its values; the gradient reaching ``log_alpha`` is sigmoid(b) ≈ α times the gradient of α
#: itself, non-zero and far above float32's floor. docs/huggingface.md gives the measured numbers.
IDENTITY_ALPHA = 1e-5


def check_gaug_init(gaug_init: object) -> GaugInit:
    """``gaug_init`` checked to be ``"paper"`` or ``"identity"`` (a ``ValueError`` naming it otherwise)."""
    choices = get_args(GaugInit)
    if gaug_init not in choices:
        raise ValueError(f"gaug_init must be one of {list(choices)}, got {gaug_init!r}")
    return gaug_init  # type: ignore[return-value]


class GaussianAugment(nn.Module):
    """GAug's heads: per spatial query, two variances (row, column) and one amplitude.

    ``log_var = Linear(head_dim, 2)`` and ``log_alpha = Linear(head_dim, 1)`` are shared across heads
    (the official parameter names). The bias itself is :class:`vitattn.functional.GaussianBias`.
    ``init`` picks the start (:meth:`init_weights`).
    """

    def __init__(
        self,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        init: GaugInit = "paper",
    ) -> None:
        super().__init__()
        self.log_var = nn.Linear(head_dim, 2, device=device, dtype=dtype)
        self.log_alpha = nn.Linear(head_dim, 1, device=device, dtype=dtype)
        self.init_weights(init)

    def init_weights(self, init: GaugInit = "paper") -> None:
        """``"paper"``: timm's ViT init for linears, truncated normal (std 0.02) and zero bias, so
        σ ≈ 1 and α ≈ ln 2. ``"identity"``: the same σ heads, and ``log_alpha`` with zero weight and
        bias softplus⁻¹(:data:`IDENTITY_ALPHA`), so α = ``IDENTITY_ALPHA`` for every query: the bias
        is at most that, and the scores (so the model's outputs) barely move."""
        init = check_gaug_init(init)
        for layer in (self.log_var, self.log_alpha):
            nn.init.trunc_normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)
        if init == "identity":
            nn.init.zeros_(self.log_alpha.weight)
            nn.init.constant_(self.log_alpha.bias, math.log(math.expm1(IDENTITY_ALPHA)))

    def forward(
        self,
        q_sp: torch.Tensor,
        grid_size: tuple[int, int],
        num_prefix_tokens: int,
        initial_grid_size: tuple[int, int],
    ) -> GaussianBias:
        """Spatial queries ``q_sp: (B, H, gh*gw, d)`` (after q_norm, unscaled) -> the bias description.

        σ = c · sigmoid(log_var(q) − ln(c − 1)) with c = max(initial grid)² (no shift when c ≤ 2), and
        α = softplus(log_alpha(q)); both in float32 with autocast off.
        """
        return gaussian_bias_from_queries(
            q_sp,
            torch.cat([self.log_var.weight, self.log_alpha.weight]),
            torch.cat([self.log_var.bias, self.log_alpha.bias]),
            grid_size,
            num_prefix_tokens,
            initial_grid_size,
        )


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast disabled on ``device_type``; nothing to disable where autocast does not exist (meta)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


@register_notrace_function
def gaussian_bias_from_queries(
    q_sp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    grid_size: tuple[int, int],
    num_prefix_tokens: int,
    initial_grid_size: tuple[int, int],
) -> GaussianBias:
    """GAug's σ, α from spatial queries ``q_sp: (B, H, Np, d)`` and the stacked heads
    ``weight: (3, d)``, ``bias: (3,)`` (``log_var`` rows, then ``log_alpha``), as a :class:`GaussianBias`.

    A leaf for ``torch.fx``: it returns a dataclass, and autocast is switched by device type.
    """
    sigma_max = float(max(initial_grid_size) ** 2)  # GAug's c: the largest σ
    shift = math.log(sigma_max - 1.0) if sigma_max > 2.0 else 0.0
    work = compute_dtype(q_sp)
    with _autocast_off(q_sp.device.type):
        # both heads in one matmul: q_sp is a strided view, so this reads (and copies) it once
        out = F.linear(q_sp.to(work), weight.to(work), bias.to(work))  # (B, H, Np, 3)
        sigma = torch.sigmoid(out[..., :2] - shift) * sigma_max
        alpha = -F.logsigmoid(-out[..., 2:])  # softplus, in the CPU's faster kernel (within 1 ulp)
    return GaussianBias(sigma, alpha, grid_size, num_prefix_tokens, initial_grid_size)


torch.fx.wrap("gaussian_bias_from_queries")


def _check_tokens(q: torch.Tensor, grid_size: tuple[int, int], num_prefix_tokens: int) -> torch.Tensor:
    """``q`` unchanged, or a ``ValueError`` when its token count does not fit the grid (an FX leaf)."""
    p = num_prefix_tokens
    gh, gw = grid_size
    if q.shape[2] != p + gh * gw:
        raise ValueError(
            f"LocAtAttention got N = {q.shape[2]} tokens (q of shape {tuple(q.shape)}), but its "
            f"grid_size {grid_size} with num_prefix_tokens={p} needs "
            f"N = {p} + {gh}*{gw} = {p + gh * gw}"
        )
    return q


register_notrace_function(_check_tokens)
torch.fx.wrap("_check_tokens")


class LocAtAttention(Attention):
    """:class:`Attention` whose scores get GAug's Gaussian locality bias (LocAtViT).

    Takes every :class:`Attention` argument (so ``normalizer="entmax15"`` gives Gaussian-biased
    entmax) plus the token layout: ``grid_size`` (patch rows, columns), ``num_prefix_tokens``
    (class + register tokens before the patches) and ``initial_grid_size`` (the grid the model was
    built for, which fixes c, eps and the clamp). A model sets them with :meth:`set_grid`, and
    again whenever the input resolution changes.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        grid_size: int | Sequence[int] | None = None,
        num_prefix_tokens: int = 1,
        initial_grid_size: int | Sequence[int] | None = None,
        normalizer: Normalizer = "softmax",
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, normalizer=normalizer, **kwargs)
        self.gaug = GaussianAugment(self.head_dim, device=self.qkv.weight.device, dtype=self.qkv.weight.dtype)
        self.grid_size: tuple[int, int] | None = None
        self.initial_grid_size: tuple[int, int] | None = None
        self.num_prefix_tokens = int(num_prefix_tokens)
        if grid_size is not None:
            self.set_grid(grid_size, num_prefix_tokens, initial_grid_size)

    def set_grid(
        self,
        grid_size: int | Sequence[int],
        num_prefix_tokens: int | None = None,
        initial_grid_size: int | Sequence[int] | None = None,
    ) -> None:
        """Set the current patch grid (and optionally the prefix count and the initial grid).

        The initial grid defaults to the first grid ever set and then stays fixed.
        """
        self.grid_size = grid_pair("grid_size", grid_size)
        if num_prefix_tokens is not None:
            if int(num_prefix_tokens) < 0:
                raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
            self.num_prefix_tokens = int(num_prefix_tokens)
        if initial_grid_size is not None:
            self.initial_grid_size = grid_pair("initial_grid_size", initial_grid_size)
        elif self.initial_grid_size is None:
            self.initial_grid_size = self.grid_size

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, grid_size={self.grid_size}, "
            f"num_prefix_tokens={self.num_prefix_tokens}, initial_grid_size={self.initial_grid_size}"
        )

    def attention_bias(self, q: torch.Tensor) -> GaussianBias:
        """GAug bias from ``q: (B, H, N, d)``, ``N = num_prefix_tokens + gh * gw``."""
        if self.grid_size is None or self.initial_grid_size is None:
            raise RuntimeError(
                "LocAtAttention has no patch grid: call set_grid(grid_size, num_prefix_tokens) or build it "
                "through vitattn.models.LocAtViT / vitattn.patch"
            )
        p = self.num_prefix_tokens
        q = _check_tokens(q, self.grid_size, p)
        return self.gaug(q[:, :, p:], self.grid_size, p, self.initial_grid_size)
