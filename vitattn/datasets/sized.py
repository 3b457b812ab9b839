"""The length of a map-style dataset, checked (torch's ``Dataset`` declares no ``__len__``)."""

from __future__ import annotations

from collections.abc import Sized

__all__ = ["dataset_length"]


def dataset_length(dataset: object, name: str = "dataset") -> int:
    """``len(dataset)``; a ``TypeError`` naming ``name`` when the dataset has no ``__len__``
    (an iterable-style dataset, or a generator, where a map-style dataset is needed)."""
    if not isinstance(dataset, Sized):
        raise TypeError(f"{name} must be a map-style dataset with __len__, got {type(dataset).__name__}")
    return len(dataset)
