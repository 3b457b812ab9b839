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

from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from timm.layers import apply_rot_embed_cat
from torch import nn

from ..functional._checks import check_count
from ._args import check_flag
from .attention import Attention, run_attention
from .convert_steps import finish_conversion, importable_classes, new_like
from .locat import GaugInit, LocAtAttention

__all__ = [
    "LocAtRopeAttention",
    "RopeAttention",
    "convert_rope_attention",
    "convertible_rope_attention",
    "rope_attention_classes",
]

R = TypeVar("R", bound="RopeAttention | LocAtRopeAttention")


def rope_attention_classes() -> tuple[type, ...]:
    """The timm rotary attention classes (and vitattn's two) that :func:`convert_rope_attention` takes."""
    timm_classes = importable_classes(
        RopeAttention, ("timm.layers", "AttentionRope"), ("timm.models.eva", "EvaAttention")
    )
    return (LocAtRopeAttention, *timm_classes)


def _rotate(t: torch.Tensor, rope: torch.Tensor, prefix: int, half: bool, dtype: torch.dtype) -> torch.Tensor:
    """``t: (B, H, N, d)`` with its patch tokens (after ``prefix``) rotated by timm's ``rope`` sin/cos."""
    return torch.cat([t[:, :, :prefix], apply_rot_embed_cat(t[:, :, prefix:], rope, half=half)], dim=2).to(
        dtype
    )


class _Rotary(Attention):
    """The rotary projections and forward shared by :class:`RopeAttention` and :class:`LocAtRopeAttention`.

    Projections as in timm: a fused ``qkv`` (optionally with Eva's separate ``q_bias`` / ``k_bias``
    buffer / ``v_bias``), or ``q_proj`` / ``k_proj`` / ``v_proj`` (with ``num_kv_heads`` <= heads:
    grouped-query attention, k and v repeated after the rotation). Takes the arguments of the next
    class in the MRO (:class:`Attention` or :class:`LocAtAttention`), with ``qkv_bias=True`` by
    default as timm's rotary layers, plus ``rotate_half``, ``qkv_fused`` and ``num_kv_heads``.
    """

    num_prefix_tokens: int

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        rotate_half: bool = False,
        qkv_fused: bool = True,
        qkv_bias: bool = True,
        num_kv_heads: int | None = None,
        **kwargs: Any,
    ) -> None:
        check_flag("rotate_half", rotate_half)
        check_flag("qkv_fused", qkv_fused)
        kv_heads = None if num_kv_heads is None else check_count("num_kv_heads", num_kv_heads, minimum=1)
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, **kwargs)
        self.rotate_half = rotate_half
        self.num_kv_heads = kv_heads or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        self.num_kv_groups = self.num_heads // self.num_kv_heads
        self.qkv_bias_separate = False
        # Eva's split biases, set by convert_rope_attention
        self.q_bias: torch.Tensor | None = None
        self.k_bias: torch.Tensor | None = None
        self.v_bias: torch.Tensor | None = None
        self.q_proj: nn.Linear | None = None
        self.k_proj: nn.Linear | None = None
        self.v_proj: nn.Linear | None = None
        if qkv_fused:
            if self.num_kv_groups > 1:
                raise ValueError(
                    "a fused qkv projection does not support grouped-query attention (num_kv_heads)"
                )
        else:
            dd = {"device": self.proj.weight.device, "dtype": self.proj.weight.dtype}
            kv_dim = self.head_dim * self.num_kv_heads
            self.qkv = None  # type: ignore[assignment]  # timm's layout: q_proj / k_proj / v_proj instead
            self.q_proj = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd)
            self.k_proj = nn.Linear(dim, kv_dim, bias=qkv_bias, **dd)
            self.v_proj = nn.Linear(dim, kv_dim, bias=qkv_bias, **dd)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ``x: (B, N, C)``: ``(B, H, N, d)``, k and v ``(B, num_kv_heads, N, d)``."""
        b, n, _ = x.shape
        h, d = self.num_heads, self.head_dim
        if self.q_proj is None or self.k_proj is None or self.v_proj is None:
            if self.q_bias is None or self.k_bias is None or self.v_bias is None:
                qkv = self.qkv(x)
            else:  # Eva: q and v biases, a zero k bias
                bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
                if self.qkv_bias_separate:
                    qkv = self.qkv(x) + bias
                else:
                    qkv = F.linear(x, self.qkv.weight, bias)
            q, k, v = qkv.reshape(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
            return q, k, v
        hk = self.num_kv_heads
        q = self.q_proj(x).reshape(b, n, h, d).transpose(1, 2)
        k = self.k_proj(x).reshape(b, n, hk, d).transpose(1, 2)
        v = self.v_proj(x).reshape(b, n, hk, d).transpose(1, 2)
        return q, k, v

    def forward(  # type: ignore[override]  # timm's rotary signature: rope before attn_mask
        self,
        x: torch.Tensor,
        rope: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """``x: (B, N, C)`` and timm's ``rope`` sin/cos for the patch tokens -> ``(B, N, dim_out)``."""
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self._project(x)
        q, k = self.q_norm(q), self.k_norm(k)
        bias = self.attention_bias(q)  # GAug reads q before the rotation
        if rope is not None:
            p, half = self.num_prefix_tokens, self.rotate_half
            q, k = _rotate(q, rope, p, half, v.dtype), _rotate(k, rope, p, half, v.dtype)
        if self.num_kv_groups > 1:
            k = k.repeat_interleave(self.num_kv_groups, dim=1)
            v = v.repeat_interleave(self.num_kv_groups, dim=1)
        out = run_attention(self, q, k, v, attn_mask, is_causal, bias)
        return self.project_out(out, gate)


class RopeAttention(_Rotary):
    """:class:`Attention` with timm's rotary embedding: a drop-in for ``AttentionRope`` / ``EvaAttention``.

    Takes :class:`Attention`'s arguments (``qkv_bias=True`` by default) plus ``num_prefix_tokens``
    (tokens the rotation skips), ``rotate_half`` (timm's half layout), ``qkv_fused`` and
    ``num_kv_heads``; ``forward(x, rope, attn_mask, is_causal)`` as timm's. Same submodule and
    state-dict names as those classes.
    """

    def __init__(self, dim: int, num_heads: int = 8, *, num_prefix_tokens: int = 1, **kwargs: Any) -> None:
        super().__init__(dim, num_heads, **kwargs)
        self.num_prefix_tokens = int(num_prefix_tokens)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_prefix_tokens={self.num_prefix_tokens}"


class LocAtRopeAttention(_Rotary, LocAtAttention):
    """:class:`LocAtAttention` with timm's rotary embedding (the official ``LocAtRoPEViT`` attention).

    GAug's σ, α come from q after ``q_norm`` and before the rotation; the bias is added to the scores
    of the rotated q, k. ``num_prefix_tokens`` is both the tokens the rotation skips and GAug's prefix.
    Arguments: :class:`LocAtAttention`'s (``qkv_bias=True`` by default) plus ``rotate_half``,
    ``qkv_fused``, ``num_kv_heads``.
    """


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
    old: nn.Module, cls: type[R], *, gaug_init: GaugInit = "paper", **kwargs: Any
) -> R:
    """A ``cls`` layer (:class:`RopeAttention` or :class:`LocAtRopeAttention`) computing with ``old``'s
    weights (the same parameters move into it).

    ``old`` is timm's ``AttentionRope`` or ``EvaAttention`` or a vitattn rotary layer; its projections
    (``qkv`` and Eva's ``q_bias`` / ``k_bias`` / ``v_bias``, or ``q_proj`` / ``k_proj`` / ``v_proj``),
    ``q_norm``, ``k_norm``, ``norm``, ``gate`` and ``proj`` are kept, as are its dropout rates and (a
    vitattn layer's) ``backend``; GAug heads are kept from a LocAt layer, otherwise created fresh and
    started as ``gaug_init`` says. ``kwargs`` go to ``cls``. Raises ``TypeError`` for other modules.
    """
    if not convertible_rope_attention(old):
        raise TypeError(
            f"cannot convert {type(old).__module__}.{type(old).__name__}: expected timm's AttentionRope or "
            "EvaAttention (or a vitattn rotary layer)"
        )
    proj: nn.Linear = old.proj  # type: ignore[assignment]
    first: nn.Linear = old.qkv if old.qkv is not None else old.q_proj  # type: ignore[assignment]
    kwargs.setdefault("num_prefix_tokens", int(getattr(old, "num_prefix_tokens", 1)))
    kwargs.setdefault("rotate_half", bool(getattr(old, "rotate_half", False)))
    head_dim = int(old.head_dim)  # type: ignore[arg-type]
    new = new_like(old, cls, first.in_features, attn_head_dim=head_dim, dim_out=proj.out_features, **kwargs)
    for name in ("qkv", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "proj", "gate"):
        setattr(new, name, getattr(old, name, None))
    new.norm = getattr(old, "norm", None) or nn.Identity()
    for name in ("q_bias", "k_bias", "v_bias"):
        _move_tensor(new, old, name)
    new.qkv_bias_separate = bool(getattr(old, "qkv_bias_separate", False))
    new.num_kv_heads = int(getattr(old, "num_kv_heads", new.num_heads))
    new.num_kv_groups = new.num_heads // new.num_kv_heads
    return finish_conversion(new, old, first.weight, "convert_rope_attention", gaug_init)
