"""Segmentation scores: one confusion matrix over an evaluation set, IoU per class, mIoU.

Definition (DESIGN.md "Dense evaluation"): pixels whose target is ``ignore_index`` are dropped; the
``(K, K)`` confusion matrix counts target ``t`` (row) predicted as ``p`` (column) over *all* pixels
given; IoU of class ``k`` is ``TP / (TP + FP + FN)``; mIoU is the mean over the classes that occur in
the prediction or in the target (a class absent from both is left out, reported as None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ConfusionMeter", "SegmentationScores", "confusion_matrix", "miou", "scores_from_confusion"]


@dataclass(frozen=True)
class SegmentationScores:
    """``miou`` and ``pixel_acc`` in [0, 1]; ``per_class_iou[k]`` None for a class absent from both."""

    miou: float
    pixel_acc: float
    per_class_iou: list[float | None]


def _check_classes(num_classes: int) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
    return num_classes


def confusion_matrix(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int | None = 255
) -> torch.Tensor:
    """``(K, K)`` int64 counts, rows = target class, columns = predicted class.

    ``pred`` and ``target``: integer tensors of the same shape (any, e.g. ``(B, H, W)``). Target
    pixels equal to ``ignore_index`` are dropped (whatever their prediction); every other target must
    lie in ``[0, K)``, and so must the prediction at the kept pixels (``ValueError`` naming which).
    """
    k = _check_classes(num_classes)
    pred, target = torch.as_tensor(pred), torch.as_tensor(target)
    if pred.shape != target.shape:
        raise ValueError(f"pred has shape {tuple(pred.shape)} but target has shape {tuple(target.shape)}")
    if pred.is_floating_point() or target.is_floating_point():
        raise ValueError(f"pred and target must be integer labels, got {pred.dtype} and {target.dtype}")
    target = target.reshape(-1).long()
    pred = pred.reshape(-1).long().to(target.device)
    if ignore_index is not None:
        keep = target != ignore_index
        target, pred = target[keep], pred[keep]
    if target.numel():
        bad = (target < 0) | (target >= k)
        if bool(bad.any()):
            raise ValueError(
                f"target holds label {int(target[bad][0])} outside [0, num_classes={k}) "
                f"that is not ignore_index={ignore_index}"
            )
        bad = (pred < 0) | (pred >= k)
        if bool(bad.any()):
            raise ValueError(f"pred holds label {int(pred[bad][0])} outside [0, num_classes={k})")
    return torch.bincount(target * k + pred, minlength=k * k).reshape(k, k).cpu()


def scores_from_confusion(cm: torch.Tensor) -> SegmentationScores:
    """mIoU, pixel accuracy and IoU per class of a ``(K, K)`` confusion matrix (rows = target)."""
    cm = torch.as_tensor(cm)
    if cm.ndim != 2 or cm.shape[0] != cm.shape[1] or cm.shape[0] < 1:
        raise ValueError(f"cm must be a square (K, K) matrix, got shape {tuple(cm.shape)}")
    cm = cm.double()
    tp = cm.diagonal()
    in_target, in_pred = cm.sum(1), cm.sum(0)
    union = in_target + in_pred - tp
    per_class: list[float | None] = [
        float(t / u) if u > 0 else None for t, u in zip(tp.tolist(), union.tolist(), strict=True)
    ]
    present = [v for v in per_class if v is not None]
    total = float(cm.sum())
    return SegmentationScores(
        miou=sum(present) / len(present) if present else float("nan"),
        pixel_acc=float(tp.sum()) / total if total > 0 else float("nan"),
        per_class_iou=per_class,
    )


def miou(pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int | None = 255) -> float:
    """Mean IoU of ``pred`` against ``target`` (same shape, integer labels): see the module docstring.

    NaN when every pixel is ignored.
    """
    return scores_from_confusion(confusion_matrix(pred, target, num_classes, ignore_index)).miou


class ConfusionMeter:
    """A confusion matrix accumulated batch by batch: ``update(pred, target)``, then ``scores()``."""

    def __init__(self, num_classes: int, ignore_index: int | None = 255) -> None:
        self.num_classes = _check_classes(num_classes)
        self.ignore_index = ignore_index
        self.matrix = torch.zeros(num_classes, num_classes, dtype=torch.int64)

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """Add the pixels of ``pred`` / ``target`` (same shape, e.g. ``(B, H, W)``)."""
        self.matrix += confusion_matrix(pred, target, self.num_classes, self.ignore_index)

    def scores(self) -> SegmentationScores:
        return scores_from_confusion(self.matrix)
