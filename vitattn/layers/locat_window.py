"""Swin window attention on vitattn's pipeline, with or without GAug (the official ``LocAtSwin``).

timm's ``swin_transformer.WindowAttention`` attends within each window of ``window_size`` patches,
adding a learned relative-position bias and, in shifted blocks, the shift mask (0 / -100 between
patches that were not neighbours before the cyclic shift). The layers here compute the same q, k, v
and hand the relative-position bias plus the shift mask to :func:`vitattn.functional.attention` as
one additive float mask:

- :class:`WindowAttention`: any normalizer (``"softmax"`` gives timm's outputs);
- :class:`LocAtWindowAttention`: plus GAug's Gaussian bias per window: the grid is the window,
  there are no prefix tokens, and c, eps and the clamp come from the window size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from timm.models.swin_transformer import WindowAttention as TimmWindowAttention
from torch import nn

from ..functional import GaussianBias, grid_pair
from ..functional.dispatch import check_backend_name
from ..functional.normalize import Normalizer, resolve_normalizer
from ._args import check_flag, check_heads, check_rate
from .attention import run_attention
from .convert_steps import finish_conversion, new_like
from .locat import GaugInit, GaussianAugment, check_gaug_init

__all__ = [
    "LocAtWindowAttention",
    "WindowAttention",
    "convert_window_attention",
    "convertible_window_attention",
    "window_additive_mask",
]

W = TypeVar("W", bound="WindowAttention")


def window_additive_mask(rel_pos_bias: torch.Tensor, mask: torch.Tensor | None, batch: int) -> torch.Tensor:
    """The additive float mask of one window-attention call, broadcastable to ``(B_, H, N, N)``.

    ``rel_pos_bias: (1, H, N, N)``; ``mask``: timm's shift mask ``(nW, N, N)`` or None, for
    ``batch = B_ = images * nW`` windows ordered image-major (as ``window_partition`` makes them).
    """
    if mask is None:
        return rel_pos_bias
    nw, n = mask.shape[0], mask.shape[-1]
    total = rel_pos_bias[:, None] + mask.to(rel_pos_bias.dtype)[None, :, None]  # (1, nW, H, N, N)
    return total.expand(batch // nw, -1, -1, -1, -1).reshape(batch, rel_pos_bias.shape[1], n, n)


class WindowAttention(TimmWindowAttention):
    """timm's Swin ``WindowAttention`` computed by :func:`vitattn.functional.attention`.

    Same arguments, submodules and state-dict keys (``qkv``, ``proj``,
    ``relative_position_bias_table``), plus ``normalizer`` (``"softmax"``, ``"entmax15"``,
    ``"sparsemax"`` or a float alpha > 1) and ``backend`` (``"auto"``, which follows
    :func:`vitattn.set_default_backend`, or a name from :func:`vitattn.functional.available_backends`)
    as :class:`~vitattn.layers.Attention`. ``forward(x, mask)`` as timm's: ``x: (nW*B, N, C)``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int | None = None,
        window_size: int | Sequence[int] = 7,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        normalizer: Normalizer = "softmax",
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        dim, num_heads, head_dim = check_heads(dim, num_heads, head_dim)
        window_size = grid_pair("window_size", window_size)
        check_flag("qkv_bias", qkv_bias)
        attn_drop, proj_drop = check_rate("attn_drop", attn_drop), check_rate("proj_drop", proj_drop)
        super().__init__(
            dim,
            num_heads,
            head_dim=head_dim,
            window_size=window_size,
            qkv_bias=qkv_bias,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
            device=device,
            dtype=dtype,
        )
        self.head_dim = head_dim
        self.normalizer = resolve_normalizer(normalizer)
        self.backend = check_backend_name(backend)

    def extra_repr(self) -> str:
        out = (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, window_size={self.window_size}, "
            f"normalizer={self.normalizer!r}"
        )
        return out if self.backend == "auto" else f"{out}, backend={self.backend!r}"

    def attention_bias(self, q: torch.Tensor) -> GaussianBias | None:
        """Additive score bias from the queries ``q: (B_, H, N, d)`` of the windows; none here."""
        return None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x: (nW*B, N, C)``, ``mask``: timm's shift mask ``(nW, N, N)`` or None -> ``(nW*B, N, C)``."""
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.attention_bias(q)
        additive = window_additive_mask(self._get_rel_pos_bias(), mask, b)
        out = run_attention(self, q, k, v, additive, False, bias)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, -1)))


class LocAtWindowAttention(WindowAttention):
    """:class:`WindowAttention` with GAug's Gaussian bias in every window (official ``LocAtSwin``).

    The bias grid is the window (``window_size`` rows x columns), with no prefix tokens; c, eps and
    the clamp come from ``initial_window_size`` (default: the window the layer is built with). If
    the window is later resized (timm's ``set_window_size``), σ is rescaled by
    ``min(window) / min(initial window)`` as GAug does for a new resolution (the official release
    has no window resizing). ``gaug_init`` starts the GAug heads (:class:`~vitattn.layers.GaussianAugment`).
    """

    def __init__(
        self,
        *args: Any,
        initial_window_size: int | Sequence[int] | None = None,
        gaug_init: GaugInit = "paper",
        **kwargs: Any,
    ) -> None:
        gaug_init = check_gaug_init(gaug_init)
        initial = initial_window_size
        initial = None if initial is None else grid_pair("initial_window_size", initial)
        super().__init__(*args, **kwargs)
        weight = self.qkv.weight
        self.gaug = GaussianAugment(
            self.head_dim, weight.device, weight.dtype, init=gaug_init, num_heads=self.num_heads
        )
        self.initial_window_size = initial or grid_pair("initial_window_size", self.window_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, initial_window_size={self.initial_window_size}"

    def attention_bias(self, q: torch.Tensor) -> GaussianBias:
        """GAug bias of every window from its queries ``q: (B_, H, N, d)``, ``N = window area``."""
        return self.gaug(q, tuple(self.window_size), 0, self.initial_window_size)


def convertible_window_attention(module: nn.Module) -> bool:
    """Whether ``module`` is timm's Swin ``WindowAttention`` (or vitattn's) with qkv / proj linears."""
    return (
        isinstance(module, TimmWindowAttention)
        and isinstance(getattr(module, "qkv", None), nn.Linear)
        and isinstance(getattr(module, "proj", None), nn.Linear)
        and isinstance(getattr(module, "relative_position_bias_table", None), nn.Parameter)
    )


def convert_window_attention(
    old: nn.Module, cls: type[W], *, gaug_init: GaugInit = "paper", **kwargs: Any
) -> W:
    """A ``cls`` layer computing with ``old``'s weights (``qkv``, ``proj``, the relative-position table
    and index move into it), dropout rates and (a vitattn layer's) ``backend``; GAug heads and the
    initial window are kept from a LocAt layer, else created fresh (started as ``gaug_init`` says).
    ``kwargs`` go to ``cls``. Raises
    ``TypeError`` for any other module."""
    if not convertible_window_attention(old):
        raise TypeError(
            f"cannot convert {type(old).__module__}.{type(old).__name__}: "
            "expected timm's Swin WindowAttention"
        )
    qkv: nn.Linear = old.qkv  # type: ignore[assignment]
    if issubclass(cls, LocAtWindowAttention):
        kwargs.setdefault("initial_window_size", getattr(old, "initial_window_size", None))
    new = new_like(
        old,
        cls,
        qkv.in_features,
        head_dim=qkv.out_features // (3 * int(old.num_heads)),  # type: ignore[arg-type]
        window_size=tuple(old.window_size),  # type: ignore[arg-type]
        qkv_bias=qkv.bias is not None,
        **kwargs,
    )
    new.qkv, new.proj = qkv, old.proj  # type: ignore[assignment]
    new.relative_position_bias_table = old.relative_position_bias_table  # type: ignore[assignment]
    new.relative_position_index = old.relative_position_index
    new.dim = old.dim  # type: ignore[assignment]
    return finish_conversion(new, old, qkv.weight, "convert_window_attention", gaug_init)
