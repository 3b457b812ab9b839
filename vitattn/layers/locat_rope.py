"""Rotary-embedding attention (timm's Eva family) on vitattn's pipeline, with or without GAug.

timm's RoPE ViTs (``Eva`` with ``attn_type="rope"``: EVA-02, the RoPE-Mixed ViTs, the SBB ``*_rope_*``
ViTs, the official ``locatvit_*_rope_mixed``) use ``timm.layers.AttentionRope`` or
``timm.models.eva.EvaAttention``. Both compute q, k, v, apply ``q_norm`` / ``k_norm``, rotate the patch
tokens of q and k (prefix tokens are left alone) and attend. The layers here do the same and then call
:func:`vitattn.functional.attention`, so a normalizer or a bias can be swapped in:

- :class:`RopeAttention`: any normalizer, no bias (``normalizer="softmax"`` gives timm's outputs);
- :class:`LocAtRopeAttention`: GAug, as the official ``LocAtRoPEViT``: σ and α are predicted from q
  after ``q_norm`` and *before* the rotation, and the Gaussian bias is added to the scores of the
  rotated q, k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import apply_rot_embed_cat
from torch import nn

from ..functional.normalize import Normalizer
from .attention import Attention, attend
from .convert import importable_classes
from .locat import GaussianAugment, LocAtAttention

__all__ = [
    "LocAtRopeAttention",
    "RopeAttention",
    "convert_rope_attention",
    "convertible_rope_attention",
    "rope_attention_classes",
]


def rope_attention_classes() -> tuple[type, ...]:
    """The timm rotary attention classes (and vitattn's) that :func:`convert_rope_attention` takes."""
    return importable_classes(
        RopeAttention, ("timm.layers", "AttentionRope"), ("timm.models.eva", "EvaAttention")
    )


def _rotate(t: torch.Tensor, rope: torch.Tensor, prefix: int, half: bool, dtype: torch.dtype) -> torch.Tensor:
    """``t: (B, H, N, d)`` with its patch tokens (after ``prefix``) rotated by timm's ``rope`` sin/cos."""
    return torch.cat([t[:, :, :prefix], apply_rot_embed_cat(t[:, :, prefix:], rope, half=half)], dim=2).to(
        dtype
    )


class _Rotary:
    """The rotary forward shared by :class:`RopeAttention` and :class:`LocAtRopeAttention`.

    Projections as in timm: a fused ``qkv`` (optionally with Eva's separate ``q_bias`` / ``k_bias``
    buffer / ``v_bias``), or ``q_proj`` / ``k_proj`` / ``v_proj`` (with ``num_kv_heads`` <= heads:
    grouped-query attention, k and v repeated after the rotation).
    """

    num_heads: int
    head_dim: int
    attn_dim: int
    scale: float
    normalizer: str | float
    num_prefix_tokens: int

    def _init_rotary(
        self, dim: int, qkv_fused: bool, qkv_bias: bool, rotate_half: bool, num_kv_heads: int | None, dd: dict
    ) -> None:
        self.rotate_half = bool(rotate_half)
        self.num_kv_heads = int(num_kv_heads or self.num_heads)
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        self.num_kv_groups = self.num_heads // self.num_kv_heads
        self.qkv_bias_separate = False
        self.q_bias = self.k_bias = self.v_bias = None  # Eva's split biases, set by convert_rope_attention
        if qkv_fused:
            if self.num_kv_groups > 1:
                raise ValueError(
                    "a fused qkv projection does not support grouped-query attention (num_kv_heads)"
                )
            self.q_proj = self.k_proj = self.v_proj = None
        else:
            kv_dim = self.head_dim * self.num_kv_heads
            self.qkv = None  # type: ignore[assignment]
            self.q_proj = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd)
            self.k_proj = nn.Linear(dim, kv_dim, bias=qkv_bias, **dd)
            self.v_proj = nn.Linear(dim, kv_dim, bias=qkv_bias, **dd)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        h, d = self.num_heads, self.head_dim
        if self.qkv is not None:  # type: ignore[attr-defined]
            if self.q_bias is None:
                qkv = self.qkv(x)  # type: ignore[attr-defined]
            else:  # Eva: q and v biases, a zero k bias
                bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))  # type: ignore[arg-type]
                if self.qkv_bias_separate:
                    qkv = self.qkv(x) + bias  # type: ignore[attr-defined]
                else:
                    qkv = F.linear(x, self.qkv.weight, bias)  # type: ignore[attr-defined]
            q, k, v = qkv.reshape(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
            return q, k, v
        hk = self.num_kv_heads
        q = self.q_proj(x).reshape(b, n, h, d).transpose(1, 2)  # type: ignore[misc]
        k = self.k_proj(x).reshape(b, n, hk, d).transpose(1, 2)  # type: ignore[misc]
        v = self.v_proj(x).reshape(b, n, hk, d).transpose(1, 2)  # type: ignore[misc]
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """``x: (B, N, C)`` and timm's ``rope`` sin/cos for the patch tokens -> ``(B, N, dim_out)``."""
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None  # type: ignore[attr-defined]
        q, k, v = self._project(x)
        q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[attr-defined]
        bias = self.attention_bias(q)  # type: ignore[attr-defined]  # GAug reads q before the rotation
        if rope is not None:
            p, half = self.num_prefix_tokens, self.rotate_half
            q, k = _rotate(q, rope, p, half, v.dtype), _rotate(k, rope, p, half, v.dtype)
        if self.num_kv_groups > 1:
            k = k.repeat_interleave(self.num_kv_groups, dim=1)
            v = v.repeat_interleave(self.num_kv_groups, dim=1)
        dropout_p = self.attn_drop.p if self.training else 0.0  # type: ignore[attr-defined]
        backend = getattr(self, "backend", "auto")  # a layer's own backend, where Attention has one
        named = () if backend == "auto" else (backend,)
        out = attend(q, k, v, attn_mask, is_causal, bias, self.normalizer, self.scale, dropout_p, *named)
        out = self.norm(out.transpose(1, 2).reshape(b, n, self.attn_dim))  # type: ignore[attr-defined]
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))  # type: ignore[attr-defined]


class RopeAttention(_Rotary, Attention):
    """:class:`Attention` with timm's rotary embedding: a drop-in for ``AttentionRope`` / ``EvaAttention``.

    Takes :class:`Attention`'s arguments plus ``num_prefix_tokens`` (tokens the rotation skips),
    ``rotate_half`` (timm's half layout), ``qkv_fused`` and ``num_kv_heads``; ``forward(x, rope,
    attn_mask, is_causal)`` as timm's. Same submodule and state-dict names as those classes.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        num_prefix_tokens: int = 1,
        rotate_half: bool = False,
        qkv_fused: bool = True,
        qkv_bias: bool = True,
        num_kv_heads: int | None = None,
        normalizer: Normalizer = "softmax",
        **kwargs: Any,
    ) -> None:
        Attention.__init__(self, dim, num_heads, qkv_bias=qkv_bias, normalizer=normalizer, **kwargs)
        self.num_prefix_tokens = int(num_prefix_tokens)
        dd = {"device": self.proj.weight.device, "dtype": self.proj.weight.dtype}
        self._init_rotary(dim, qkv_fused, qkv_bias, rotate_half, num_kv_heads, dd)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_prefix_tokens={self.num_prefix_tokens}"


class LocAtRopeAttention(_Rotary, LocAtAttention):
    """:class:`LocAtAttention` with timm's rotary embedding (the official ``LocAtRoPEViT`` attention).

    GAug's σ, α come from q after ``q_norm`` and before the rotation; the bias is added to the scores
    of the rotated q, k. ``num_prefix_tokens`` is both the tokens the rotation skips and GAug's prefix.
    Arguments: :class:`LocAtAttention`'s plus ``rotate_half``, ``qkv_fused``, ``num_kv_heads``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        grid_size: int | Sequence[int] | None = None,
        num_prefix_tokens: int = 1,
        initial_grid_size: int | Sequence[int] | None = None,
        rotate_half: bool = False,
        qkv_fused: bool = True,
        qkv_bias: bool = True,
        num_kv_heads: int | None = None,
        normalizer: Normalizer = "softmax",
        **kwargs: Any,
    ) -> None:
        LocAtAttention.__init__(
            self,
            dim,
            num_heads,
            grid_size=grid_size,
            num_prefix_tokens=num_prefix_tokens,
            initial_grid_size=initial_grid_size,
            normalizer=normalizer,
            qkv_bias=qkv_bias,
            **kwargs,
        )
        dd = {"device": self.proj.weight.device, "dtype": self.proj.weight.dtype}
        self._init_rotary(dim, qkv_fused, qkv_bias, rotate_half, num_kv_heads, dd)


def convertible_rope_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a timm rotary attention (``AttentionRope``, ``EvaAttention``) or vitattn's."""
    has_proj = isinstance(getattr(module, "qkv", None), nn.Linear) or isinstance(
        getattr(module, "q_proj", None), nn.Linear
    )
    return (
        isinstance(module, rope_attention_classes())
        and has_proj
        and isinstance(getattr(module, "proj", None), nn.Linear)
    )


def _move_tensor(new: nn.Module, old: nn.Module, name: str) -> None:
    """``old.<name>`` (a parameter, a buffer with its persistence, or None) moved onto ``new``."""
    value = getattr(old, name, None)
    if hasattr(new, name):
        delattr(new, name)
    if isinstance(value, nn.Parameter) or value is None:
        setattr(new, name, value)
    else:
        new.register_buffer(name, value, persistent=name not in old._non_persistent_buffers_set)


def convert_rope_attention(
    old: nn.Module, cls: type[RopeAttention] | type[LocAtRopeAttention], **kwargs: Any
):
    """A ``cls`` layer computing with ``old``'s weights (the same parameters move into it).

    ``old`` is timm's ``AttentionRope`` or ``EvaAttention`` or a vitattn rotary layer; its projections
    (``qkv`` and Eva's ``q_bias`` / ``k_bias`` / ``v_bias``, or ``q_proj`` / ``k_proj`` / ``v_proj``),
    ``q_norm``, ``k_norm``, ``norm``, ``gate`` and ``proj`` are kept; GAug heads are kept from a LocAt
    layer, otherwise created fresh. ``kwargs`` go to ``cls``. Raises ``TypeError`` for other modules.
    """
    if not convertible_rope_attention(old):
        raise TypeError(
            f"cannot convert {type(old).__module__}.{type(old).__name__}: expected timm's AttentionRope or "
            "EvaAttention (or a vitattn rotary layer)"
        )
    num_heads = int(old.num_heads)  # type: ignore[arg-type]
    head_dim = int(old.head_dim)  # type: ignore[arg-type]
    proj: nn.Linear = old.proj  # type: ignore[assignment]
    first = old.qkv if old.qkv is not None else old.q_proj  # type: ignore[union-attr]
    attn_drop = getattr(old, "attn_drop", None)
    proj_drop = getattr(old, "proj_drop", None)
    kwargs.setdefault("num_prefix_tokens", int(getattr(old, "num_prefix_tokens", 1)))
    kwargs.setdefault("rotate_half", bool(getattr(old, "rotate_half", False)))
    if getattr(old, "backend", "auto") != "auto":  # a vitattn layer's named backend carries over
        kwargs.setdefault("backend", old.backend)
    new = cls(
        first.in_features,
        num_heads,
        attn_head_dim=head_dim,
        dim_out=proj.out_features,
        attn_drop=attn_drop.p if isinstance(attn_drop, nn.Dropout) else 0.0,
        proj_drop=proj_drop.p if isinstance(proj_drop, nn.Dropout) else 0.0,
        device="meta",  # placeholders, replaced just below
        **kwargs,
    )
    for name in ("qkv", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "proj", "gate"):
        setattr(new, name, getattr(old, name, None))
    new.norm = getattr(old, "norm", None) or nn.Identity()
    for name in ("q_bias", "k_bias", "v_bias"):
        _move_tensor(new, old, name)
    new.qkv_bias_separate = bool(getattr(old, "qkv_bias_separate", False))
    new.num_kv_heads = int(getattr(old, "num_kv_heads", num_heads))
    new.num_kv_groups = num_heads // new.num_kv_heads
    gaug = getattr(new, "gaug", None)
    if gaug is not None:
        old_gaug = getattr(old, "gaug", None)
        new.gaug = (
            old_gaug
            if isinstance(old_gaug, GaussianAugment)
            else GaussianAugment(head_dim, device=first.weight.device, dtype=first.weight.dtype)
        )
    if first.weight.device.type != "meta" and any(t.is_meta for t in (*new.parameters(), *new.buffers())):
        raise TypeError(f"convert_rope_attention cannot create the extra parameters of {cls.__name__}")
    new.train(old.training)
    return new
