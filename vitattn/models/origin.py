"""Which library a model's class comes from, read from class module names (so nothing is imported)."""

from __future__ import annotations

from torch import nn

__all__ = ["is_transformers_model"]


def is_transformers_model(obj: object) -> bool:
    """Whether ``obj`` is a module of a class defined in ``transformers`` (or a subclass of one).

    Reads class module names only, so it never imports transformers (``import vitattn`` must not).
    :func:`vitattn.adapter.layout_of` asks it once per model to choose the model's layout.
    """
    return isinstance(obj, nn.Module) and any(
        cls.__module__.split(".", 1)[0] == "transformers" for cls in type(obj).__mro__
    )
