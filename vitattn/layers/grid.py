"""Attention layers that know the model's patch grid: the token layout (grid, prefix tokens) and an
optional neighbourhood window on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..functional import WindowMask, grid_pair
from ..functional._checks import check_count
from .attention import Attention

__all__ = ["GridAttention"]


class GridAttention(Attention):
    """:class:`Attention` on ``N = num_prefix_tokens + gh * gw`` tokens of a patch grid, with an optional
    neighbourhood window (each patch query sees a ``window`` of patch keys, see
    :class:`vitattn.functional.WindowMask`; prefix tokens stay global).

    Takes every :class:`Attention` argument plus the token layout: ``grid_size`` (patch rows, columns),
    ``num_prefix_tokens`` (class + register tokens before the patches) and ``initial_grid_size`` (the
    grid the model was built for), and ``window`` / ``dilation`` (int or (rows, columns); ``window=None``:
    no window). A model sets the layout with :meth:`set_grid`, and again whenever the input resolution
    changes (the window stays in patches).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        grid_size: int | Sequence[int] | None = None,
        num_prefix_tokens: int = 1,
        initial_grid_size: int | Sequence[int] | None = None,
        window: int | Sequence[int] | None = None,
        dilation: int | Sequence[int] = 1,
        **kwargs: Any,
    ) -> None:
        win = None if window is None else grid_pair("window", window)
        dil = grid_pair("dilation", dilation)
        prefix = check_count("num_prefix_tokens", num_prefix_tokens)
        super().__init__(dim, num_heads, **kwargs)
        self.window = win
        self.dilation = dil
        self.grid_size: tuple[int, int] | None = None
        self.initial_grid_size: tuple[int, int] | None = None
        self.num_prefix_tokens = prefix
        self._window_mask: WindowMask | None = None
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
        grid = grid_pair("grid_size", grid_size)
        prefix = None if num_prefix_tokens is None else check_count("num_prefix_tokens", num_prefix_tokens)
        initial = None if initial_grid_size is None else grid_pair("initial_grid_size", initial_grid_size)
        self.grid_size = grid
        if prefix is not None:
            self.num_prefix_tokens = prefix
        if initial is not None:
            self.initial_grid_size = initial
        elif self.initial_grid_size is None:
            self.initial_grid_size = self.grid_size
        self._window_mask = None
        if self.window is not None:
            self._window_mask = WindowMask(self.grid_size, self.window, self.num_prefix_tokens, self.dilation)

    def extra_repr(self) -> str:
        out = (
            f"{super().extra_repr()}, grid_size={self.grid_size}, "
            f"num_prefix_tokens={self.num_prefix_tokens}, initial_grid_size={self.initial_grid_size}"
        )
        if self.window is not None:
            out += f", window={self.window}"
            if self.dilation != (1, 1):
                out += f", dilation={self.dilation}"
        return out

    def require_grid(self) -> tuple[int, int]:
        """The current grid, or a ``RuntimeError`` saying how to set one."""
        if self.grid_size is None:
            raise RuntimeError(
                f"{type(self).__name__} has no patch grid: call set_grid(grid_size, num_prefix_tokens) or "
                "build it through vitattn.models.LocAtViT / vitattn.patch"
            )
        return self.grid_size

    def attention_window(self) -> WindowMask | None:
        """The :class:`WindowMask` of the current grid (``None`` without a window)."""
        if self.window is None:
            return None
        self.require_grid()
        return self._window_mask
