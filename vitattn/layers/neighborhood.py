"""Neighbourhood attention: each patch query attends to a ``k x k`` window of patch keys around it
(NATTEN's rule at the borders), class and register tokens stay global."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .adaptive import LayerNormalizer
from .grid import GridAttention

__all__ = ["NeighborhoodAttention"]


class NeighborhoodAttention(GridAttention):
    """:class:`~vitattn.layers.Attention` restricted to a neighbourhood window: a hard-local baseline.

    Each patch query keeps the ``window`` (int or (rows, columns), default 7) patch keys around it,
    shifted inward at the grid's borders so that every query keeps as many keys (every ``dilation``-th
    position with a dilation); prefix tokens attend to and are attended by every token
    (:class:`vitattn.functional.WindowMask`). No new parameters: the same state dict as
    :class:`~vitattn.layers.Attention` / timm's ``Attention``. Any normalizer (``"softmax"`` is
    NATTEN's). The token layout comes from ``grid_size`` / ``num_prefix_tokens`` or :meth:`set_grid`
    (a model built by :func:`vitattn.patch` keeps it in step with each input).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        window: int | Sequence[int] = 7,
        dilation: int | Sequence[int] = 1,
        grid_size: int | Sequence[int] | None = None,
        num_prefix_tokens: int = 1,
        normalizer: LayerNormalizer = "softmax",
        **kwargs: Any,
    ) -> None:
        kwargs.pop("initial_grid_size", None)  # a window is in patches: no reference grid
        super().__init__(
            dim,
            num_heads,
            grid_size=grid_size,
            num_prefix_tokens=num_prefix_tokens,
            window=window,
            dilation=dilation,
            normalizer=normalizer,
            **kwargs,
        )
