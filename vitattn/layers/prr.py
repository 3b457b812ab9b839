"""PRR: parameter-free patch representation refinement before a ViT's head."""

from __future__ import annotations

import torch
from timm.layers import register_notrace_function
from timm.models.vision_transformer import global_pool_nlc
from torch import nn

from ..functional import prr
from ._args import check_flag, check_heads

__all__ = ["PRR", "PRRPool", "PRRPoolNHWC", "prr_nhwc"]

_POOLS = (None, "token", "avg")


def _checked(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` unchanged, or a ``ValueError`` unless it is ``(B, N, dim)``."""
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"PRR expects x of shape (B, N, {dim}), got {tuple(x.shape)}")
    return x


# FX leaves (timm's registry for its feature extraction, torch.fx.wrap for plain tracers): the check
# branches on the shape, and the functional call checks and dispatches on shapes too
register_notrace_function(_checked)
register_notrace_function(prr)
torch.fx.wrap("_checked")
torch.fx.wrap("prr")


class PRR(nn.Module):
    """Parameter-free multi-head self-attention with q = k = v = x, over all tokens, no residual.

    Numerically the same as ``timm.layers.AttentionPoolPrr`` (timm >= 1.0.2x) with the same options:
    optional ``pre_norm`` / ``post_norm`` (``norm_layer``, LayerNorm by default) and ``pool``:
    ``None`` keeps ``(B, N, C)``, ``"token"`` takes token 0, ``"avg"`` averages all tokens, giving ``(B, C)``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        pool: str | None = None,
        pre_norm: bool = False,
        post_norm: bool = False,
        norm_layer: type[nn.Module] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if pool not in _POOLS:
            raise ValueError(f"pool must be one of {_POOLS}, got {pool!r}")
        dim, num_heads, _ = check_heads(dim, num_heads, head_dim_name=None)
        check_flag("pre_norm", pre_norm)
        check_flag("post_norm", post_norm)
        norm_layer = norm_layer or nn.LayerNorm
        dd = {"device": device, "dtype": dtype}
        self.dim = dim
        self.num_heads = num_heads
        self.pool = pool
        self.pre_norm = norm_layer(dim, **dd) if pre_norm else nn.Identity()
        self.post_norm = norm_layer(dim, **dd) if post_norm else nn.Identity()

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, pool={self.pool!r}"

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """``x: (B, N, C)`` -> ``(B, N, C)``, or ``(B, C)`` when pooling.

        ``rows=R`` refines only the first ``R`` tokens (all tokens stay keys): ``(B, R, C)``; for a
        model that then pools the class token, ``rows=1`` gives the same result at ``1/N`` the cost.
        """
        x = self.pre_norm(_checked(x, self.dim))
        if self.pool == "token":
            return self.post_norm(prr(x, self.num_heads, rows=1))[:, 0]
        x = self.post_norm(prr(x, self.num_heads, rows=rows))
        if self.pool == "avg":
            return x.mean(1)
        return x


def prr_nhwc(prr: PRR, x: torch.Tensor) -> torch.Tensor:
    """PRR over all positions of an NHWC map ``x: (B, H, W, C)`` (flattened to ``(B, H*W, C)``)."""
    return prr(x.flatten(1, 2)).reshape(x.shape)


class PRRPool(nn.Module):
    """PRR over all tokens, then a ViT's own pooling (:func:`vitattn.patch` installs it as a timm
    ViT's ``attn_pool``): ``pool_type``, ``num_prefix_tokens`` and ``include_prefix`` as timm's
    ``global_pool_nlc``."""

    def __init__(self, prr: PRR, pool_type: str, num_prefix_tokens: int, include_prefix: bool) -> None:
        super().__init__()
        self.prr = prr
        self.pool_type = pool_type
        self.num_prefix_tokens = num_prefix_tokens
        self.include_prefix = include_prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (B, N, C)`` -> pooled ``(B, C)`` (or ``(B, N, C)`` with ``pool_type=''``)."""
        return global_pool_nlc(self.prr(x), self.pool_type, self.num_prefix_tokens, self.include_prefix)


class PRRPoolNHWC(nn.Module):
    """PRR over all positions of an NHWC map, then the head's own ``pool`` (:func:`vitattn.patch`
    installs it as a Swin head's ``global_pool``)."""

    def __init__(self, prr: PRR, pool: nn.Module) -> None:
        super().__init__()
        self.prr = prr
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (B, H, W, C)`` -> the pool's output on PRR-refined positions."""
        return self.pool(prr_nhwc(self.prr, x))
