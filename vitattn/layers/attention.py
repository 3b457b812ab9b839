"""Multi-head self-attention, a drop-in for timm's ``Attention`` with a choice of normalizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, cast, overload

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function, use_fused_attn
from torch import nn

from ..functional import GaussianBias, WindowMask, attention
from ..functional._checks import check_count
from ..functional.dispatch import check_backend_name
from ..functional.normalize import AttentionNormalizer
from ._args import check_flag, check_heads, check_rate
from .adaptive import AdaptiveAlpha, LayerNormalizer, normalizer_alphas, resolve_layer_normalizer
from .call_options import layer_call_options, layer_mask, resolve_attn_mask
from .explicit import explicit_attention

__all__ = ["Attention", "EntmaxAttention", "attend", "project_qkv", "resolve_attn_mask", "run_attention"]


class TimmStyleAttention(Protocol):
    """The attributes timm's ``Attention`` and the vitattn layers share (what the helpers here read).

    ``nn.Module`` types its attributes as ``Tensor | Module``; a module passed as ``nn.Module`` is
    read through this view (``cast``) where these attributes are needed. ``gate`` and ``norm`` are
    left out: older timm versions lack them (read them with ``getattr(module, name, None)``).
    """

    num_heads: int
    head_dim: int
    scale: float
    qkv: nn.Linear
    q_norm: nn.Module
    k_norm: nn.Module
    proj: nn.Module
    proj_drop: nn.Module


@overload
def project_qkv(
    module: nn.Module, x: torch.Tensor, *, need_qk: Literal[True] = ...
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def project_qkv(
    module: nn.Module, x: torch.Tensor, *, need_qk: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]: ...


def project_qkv(
    module: nn.Module, x: torch.Tensor, *, need_qk: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """q, k, v ``(B, H, N, d)`` of a timm-style attention module on its input ``x: (B, N, C)``.

    ``module`` has ``qkv`` (one fused linear), ``num_heads``, ``head_dim``, ``q_norm`` and ``k_norm``:
    timm's ``Attention`` or any vitattn layer. q and k come after ``q_norm`` / ``k_norm``, unscaled.
    ``need_qk=False`` computes only the v third of the projection and returns ``(None, None, v)``.
    """
    attn = cast(TimmStyleAttention, module)
    b, n, _ = x.shape
    heads, dim = int(attn.num_heads), int(attn.head_dim)
    if not need_qk:
        weight, bias = attn.qkv.weight, attn.qkv.bias
        width = heads * dim
        v = F.linear(x, weight[2 * width :], None if bias is None else bias[2 * width :])
        return None, None, v.reshape(b, n, heads, dim).transpose(1, 2)
    q, k, v = attn.qkv(x).reshape(b, n, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
    return attn.q_norm(q), attn.k_norm(k), v


@register_notrace_function
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    normalizer: AttentionNormalizer,
    scale: float,
    dropout_p: float,
    backend: str = "auto",
    window: WindowMask | None = None,
) -> torch.Tensor:
    """The layers' attention call: timm's mask semantics, then :func:`vitattn.functional.attention`.

    ``window`` (a neighbourhood layer's :class:`WindowMask`) is the call's mask; with an
    ``attn_mask`` (or ``is_causal``) too, both are folded into one dense mask that keeps what both keep
    (:func:`~vitattn.layers.call_options.layer_mask`).

    One leaf for FX: ``torch.fx`` (timm's feature extraction, torchvision's) records it as a single
    call, since the argument checks and backend dispatch inside branch on shapes and flags. On the
    meta device the result is shape-only (``(B, H, Nq, Dv)``, no values): the normalizers' searches
    for a threshold read values, which meta tensors do not have.
    """
    if q.device.type == "meta":
        return q.new_empty(*q.shape[:-1], v.shape[-1], dtype=v.dtype)
    return attention(
        q,
        k,
        v,
        normalizer=normalizer,
        scale=scale,
        mask=layer_mask(q.shape[2], attn_mask, is_causal, q.device, window),
        bias=bias,
        dropout_p=dropout_p,
        backend=backend,
    )


torch.fx.wrap("attend")  # also a leaf for plain torch.fx / torchvision tracers without timm's registry


def run_attention(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
) -> torch.Tensor:
    """A vitattn layer's attention ``(B, H, Nq, Dv)`` from its q, k, v, mask and bias.

    ``module`` has a normalizer and window (:func:`~vitattn.layers.call_options.layer_call_options`),
    ``scale``, ``backend``, ``attn_drop`` and ``fused_attn``. With
    ``fused_attn`` (timm's default) this is :func:`attend`, one call that fuses what the backend can;
    without it, the explicit path of :mod:`vitattn.layers.explicit`: the weights pass through
    ``attn_drop`` before ``@ v``, where timm's ``AttentionExtract`` finds them.
    """
    if getattr(module, "fused_attn", True):
        dropout_p = module.attn_drop.p if module.training else 0.0  # type: ignore[union-attr]
        normalizer, window = layer_call_options(module)
        scale, backend = float(module.scale), str(module.backend)  # type: ignore[arg-type]
        return attend(q, k, v, attn_mask, is_causal, bias, normalizer, scale, dropout_p, backend, window)
    return explicit_attention(module, q, k, v, attn_mask, is_causal, bias)


class Attention(nn.Module):
    """Multi-head self-attention ``proj(normalize(q kᵀ / √d + bias) v)`` on ``(B, N, C)`` tokens.

    Same constructor arguments, submodules and state-dict keys (``qkv``, ``q_norm``, ``k_norm``,
    ``norm``, ``gate``, ``proj``) as ``timm.layers.Attention``, plus ``normalizer`` (``"softmax"``,
    ``"entmax15"``, ``"sparsemax"``, a float alpha > 1, or ``"adaptive"``: alpha-entmax with one
    learnable alpha per head, :class:`~vitattn.layers.adaptive.AdaptiveAlpha` in ``adaptive_alpha``,
    starting at 1.5) and ``backend`` (``"auto"`` or a name from
    :func:`vitattn.functional.available_backends`). The attention itself is
    :func:`vitattn.functional.attention`; a layer with ``backend="auto"`` follows the global default
    (:func:`vitattn.set_default_backend`, else the ``VITATTN_BACKEND`` environment variable, else the
    automatic choice), a named backend always wins.

    ``fused_attn`` (a plain attribute, as timm's) is timm's :func:`~timm.layers.use_fused_attn` when the
    layer is built: ``False`` takes the explicit path that ``timm.utils.AttentionExtract`` reads
    (:mod:`vitattn.layers.explicit`).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        attn_head_dim: int | None = None,
        dim_out: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        gated: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: Callable[..., nn.Module] | None = None,
        normalizer: LayerNormalizer = "softmax",
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        kwargs.pop("depth", None)  # timm passes the block index to some attention layers
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unexpected arguments {sorted(kwargs)}")
        dim, num_heads, attn_head_dim = check_heads(dim, num_heads, attn_head_dim, "attn_head_dim")
        dim_out = None if dim_out is None else check_count("dim_out", dim_out, minimum=1)
        for flag, value in (
            ("qkv_bias", qkv_bias),
            ("qk_norm", qk_norm),
            ("scale_norm", scale_norm),
            ("proj_bias", proj_bias),
            ("gated", gated),
        ):
            check_flag(flag, value)
        attn_drop, proj_drop = check_rate("attn_drop", attn_drop), check_rate("proj_drop", proj_drop)
        dd: dict[str, Any] = {"device": device, "dtype": dtype}
        make_norm: Callable[..., nn.Module] = nn.LayerNorm if norm_layer is None else norm_layer
        self.num_heads = num_heads
        self.head_dim = attn_head_dim
        self.attn_dim = num_heads * attn_head_dim
        self.scale = attn_head_dim**-0.5
        self.normalizer = resolve_layer_normalizer(normalizer)
        self.backend = check_backend_name(backend)
        self.fused_attn = use_fused_attn()
        self.adaptive_alpha = AdaptiveAlpha(num_heads, **dd) if self.normalizer == "adaptive" else None

        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = make_norm(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = make_norm(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = make_norm(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def extra_repr(self) -> str:
        out = f"num_heads={self.num_heads}, head_dim={self.head_dim}, normalizer={self.normalizer!r}"
        return out if self.backend == "auto" else f"{out}, backend={self.backend!r}"

    def attention_normalizer(self) -> AttentionNormalizer:
        """The normalizer this layer's attention calls take: ``self.normalizer``, or for ``"adaptive"``
        the current alphas as a ``(1, H, 1, 1)`` tensor (differentiable in the layer's parameter)."""
        if self.adaptive_alpha is not None:
            return self.adaptive_alpha.normalizer()
        assert self.normalizer != "adaptive"
        return self.normalizer

    def head_alphas(self) -> list[float]:
        """The alpha-entmax alpha of each head: learned for ``"adaptive"``; softmax 1, entmax-1.5 1.5,
        sparsemax 2, a float alpha itself."""
        if self.adaptive_alpha is not None:
            return [float(a) for a in self.adaptive_alpha().detach().double()]
        return normalizer_alphas(self.normalizer, self.num_heads)

    def attention_bias(self, q: torch.Tensor) -> torch.Tensor | GaussianBias | None:
        """Additive score bias from the normalized queries ``q: (B, H, N, d)``; none here."""
        return None

    def attention_window(self) -> WindowMask | None:
        """The neighbourhood window of the layer's calls; none here."""
        return None

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """``x: (B, N, C)`` -> ``(B, N, dim_out)``; ``attn_mask`` as in timm (bool keep-mask or additive)."""
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = project_qkv(self, x)
        bias = self.attention_bias(q)
        out = run_attention(self, q, k, v, attn_mask, is_causal, bias)
        return self.project_out(out, gate)

    def project_out(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention's ``out: (B, H, N, d)`` -> ``(B, N, dim_out)``: heads side by side, ``norm``,
        times the sigmoid ``gate: (B, N, H*d)`` when the layer is gated, then ``proj`` and its dropout."""
        b, _, n, _ = out.shape
        out = self.norm(out.transpose(1, 2).reshape(b, n, self.attn_dim))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))


class EntmaxAttention(Attention):
    """:class:`Attention` with entmax-1.5 in place of softmax (sparse attention, no new parameters)."""

    def __init__(
        self, dim: int, num_heads: int = 8, *, normalizer: LayerNormalizer = "entmax15", **kwargs: Any
    ) -> None:
        super().__init__(dim, num_heads, normalizer=normalizer, **kwargs)
