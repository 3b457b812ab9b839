"""LocAt attention: self-attention with the Gaussian locality bias of GAug (LocAtViT)."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import nn

from ..functional import GaussianBias, compute_dtype
from ..functional._checks import check_count
from .grid import GridAttention

__all__ = [
    "GaugInit",
    "GaussianAugment",
    "LocAtAttention",
    "check_gaug_init",
    "gaussian_bias_from_queries",
]

#: How fresh GAug heads start: ``"paper"`` (LocAtViT's init, α ≈ ln 2) or ``"identity"`` (the paper's
#: heads behind a zero per-head gate, so a pretrained model keeps its function at patch time and GAug
#: still learns at the learning rate).
GaugInit = Literal["paper", "identity"]


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

    ``init="identity"`` (which needs ``num_heads``) adds ``gate: (num_heads,)``, a per-head factor on
    the amplitude, ``α_h = gate_h · softplus(log_alpha(q))``, started at 0: the bias is exactly zero,
    so a pretrained model keeps its function, and the gate's gradient (the bias' effect at the paper's
    amplitude) is not small, so a first step moves it by about the learning rate (a ReZero /
    LayerScale-style start). The gate is signed: α may become negative (a repulsive bias). Without
    it (``init="paper"``, the official layout) the module has the official state-dict keys only; a
    state dict that carries a gate gives the module one when it loads (:meth:`init_weights`).
    """

    def __init__(
        self,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        init: GaugInit = "paper",
        *,
        num_heads: int | None = None,
    ) -> None:
        super().__init__()
        init = check_gaug_init(init)
        head_dim = check_count("head_dim", head_dim, minimum=1)
        self.log_var = nn.Linear(head_dim, 2, device=device, dtype=dtype)
        self.log_alpha = nn.Linear(head_dim, 1, device=device, dtype=dtype)
        self.gate: nn.Parameter | None = None
        if init == "identity":
            if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
                raise ValueError(
                    f"GaussianAugment(init='identity') needs num_heads, an int >= 1 (one gate per head), "
                    f"got num_heads={num_heads!r}"
                )
            self.gate = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
        self.init_weights(init)

    @property
    def start(self) -> GaugInit:
        """``"identity"`` when the module has a gate, else ``"paper"``."""
        return "paper" if self.gate is None else "identity"

    def init_weights(self, init: GaugInit | None = None) -> None:
        """Initialise every parameter: ``log_var`` and ``log_alpha`` as timm's ViT linears (truncated
        normal, std 0.02, zero bias: σ ≈ 1 and α ≈ ln 2 before the gate), and the gate, if the module
        has one, to 0 for ``"identity"`` (the bias is zero) or 1 for ``"paper"`` (the paper's start).
        ``init=None`` (e.g. from a model's own weight init) restarts the module as it was built
        (:attr:`start`). ``"identity"`` on a module without a gate is a ``ValueError``: the gate's
        head count is not known here (build it with ``init="identity", num_heads=H``)."""
        init = self.start if init is None else check_gaug_init(init)
        if init == "identity" and self.gate is None:
            raise ValueError(
                "init_weights('identity') needs the per-head gate, which this GaussianAugment was built "
                "without: build it with GaussianAugment(head_dim, init='identity', num_heads=H)"
            )
        for layer in (self.log_var, self.log_alpha):
            nn.init.trunc_normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)
        if self.gate is not None:
            nn.init.constant_(self.gate, 0.0 if init == "identity" else 1.0)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """A state dict with a ``gate`` (saved from an identity start) gives a gate-less module one first,
        so it loads, strict included, into a model built the paper's way and computes what was saved."""
        saved = state_dict.get(f"{prefix}gate")
        if self.gate is None and isinstance(saved, torch.Tensor) and saved.dim() == 1:
            ref = self.log_alpha.weight
            self.gate = nn.Parameter(torch.ones(saved.shape, device=ref.device, dtype=ref.dtype))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return "" if self.gate is None else f"gate=({self.gate.shape[0]},)"

    def forward(
        self,
        q_sp: torch.Tensor,
        grid_size: tuple[int, int],
        num_prefix_tokens: int,
        initial_grid_size: tuple[int, int],
    ) -> GaussianBias:
        """Spatial queries ``q_sp: (B, H, gh*gw, d)`` (after q_norm, unscaled) -> the bias description.

        σ = c · sigmoid(log_var(q) − ln(c − 1)) with c = max(initial grid)² (no shift when c ≤ 2), and
        α = softplus(log_alpha(q)) (times ``gate_h`` when gated); all in float32 with autocast off.
        """
        return gaussian_bias_from_queries(
            q_sp,
            torch.cat([self.log_var.weight, self.log_alpha.weight]),
            torch.cat([self.log_var.bias, self.log_alpha.bias]),
            grid_size,
            num_prefix_tokens,
            initial_grid_size,
            self.gate,
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
    gate: torch.Tensor | None = None,
) -> GaussianBias:
    """GAug's σ, α from spatial queries ``q_sp: (B, H, Np, d)`` and the stacked heads
    ``weight: (3, d)``, ``bias: (3,)`` (``log_var`` rows, then ``log_alpha``), as a :class:`GaussianBias`;
    ``gate: (H,)`` (or None) multiplies each head's α (then α may be negative).

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
        if gate is not None:
            alpha = alpha * gate.to(work).view(-1, 1, 1)
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


class LocAtAttention(GridAttention):
    """:class:`Attention` whose scores get GAug's Gaussian locality bias (LocAtViT).

    Takes every :class:`Attention` argument (so ``normalizer="entmax15"`` gives Gaussian-biased
    entmax) plus the token layout of :class:`~vitattn.layers.grid.GridAttention`: ``grid_size``
    (patch rows, columns), ``num_prefix_tokens`` (class + register tokens before the patches) and
    ``initial_grid_size`` (the grid the model was built for, which fixes c, eps and the clamp), and
    optionally a neighbourhood ``window`` (with ``dilation``): the Gaussian bias inside a hard window.
    A model sets the layout with :meth:`set_grid`, and again whenever the input resolution changes.
    ``gaug_init`` starts the GAug heads (:class:`GaussianAugment`: ``"paper"`` or ``"identity"``).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        gaug_init: GaugInit = "paper",
        **kwargs: Any,  # GridAttention's: the token layout, window, normalizer, ...
    ) -> None:
        gaug_init = check_gaug_init(gaug_init)
        super().__init__(dim, num_heads, **kwargs)
        weight = self.qkv.weight
        self.gaug = GaussianAugment(
            self.head_dim, weight.device, weight.dtype, init=gaug_init, num_heads=self.num_heads
        )

    def attention_bias(self, q: torch.Tensor) -> GaussianBias:
        """GAug bias from ``q: (B, H, N, d)``, ``N = num_prefix_tokens + gh * gw``."""
        grid = self.require_grid()
        if self.initial_grid_size is None:
            raise RuntimeError("LocAtAttention has no initial grid: call set_grid(grid_size)")
        p = self.num_prefix_tokens
        q = _check_tokens(q, grid, p)
        return self.gaug(q[:, :, p:], grid, p, self.initial_grid_size)
