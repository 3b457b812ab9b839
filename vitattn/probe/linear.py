"""The linear probe: BatchNorm2d + 1×1 conv on frozen patch features, logits upsampled to the mask.

The LocAtViT segmentation protocol (mmseg linear head) in miniature. Defaults (:data:`LINEAR_DEFAULTS`):
AdamW at lr 1e-2 and weight decay 1e-4, 64 images per step, 20 epochs over the precomputed features but
at least 200 steps (an explicit ``epochs`` is taken as it is), cosine decay to 0 without warmup.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .extract import DenseFeatures
from .metrics import ConfusionMeter, SegmentationScores
from .progress import Progress

__all__ = ["LINEAR_DEFAULTS", "LinearHead", "linear_probe"]

#: epochs over the precomputed train features, AdamW lr / weight decay, images per step
LINEAR_DEFAULTS: dict[str, float | int] = dict(
    epochs=20, lr=1e-2, weight_decay=1e-4, batch_size=64, min_steps=200
)


class LinearHead(nn.Module):
    """``(B, C, gh, gw)`` features -> ``(B, K, gh, gw)`` logits: ``Conv2d(C, K, 1)(BatchNorm2d(C)(x))``."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.bn(x))


def _upsampled(logits: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)


def linear_probe(
    train: DenseFeatures,
    test: DenseFeatures,
    layer: int,
    *,
    epochs: int | None = None,
    lr: float = 1e-2,
    weight_decay: float = 1e-4,
    batch_size: int = 64,
    min_steps: int | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> SegmentationScores:
    """Train a :class:`LinearHead` on ``train.features[layer]`` and score it on ``test``.

    Loss: cross-entropy of the logits upsampled bilinearly (``align_corners=False``) to the mask size,
    ``ignore_index`` pixels left out. AdamW(``lr``, ``weight_decay``), cosine decay to 0 over
    ``max(epochs * ceil(N / batch_size), min_steps)`` steps, rounded up to whole epochs. By default
    (``epochs=None``) that is 20 epochs but at least ``min_steps=200`` steps, so that a small train set
    still converges; an explicit ``epochs`` runs exactly that many epochs unless ``min_steps`` is
    given. Deterministic for ``seed`` (head init and the order of the images; the global RNG is left
    untouched). Test: argmax of the upsampled logits, one confusion matrix over the test set.
    """
    if epochs is None:
        epochs = int(LINEAR_DEFAULTS["epochs"])
        min_steps = int(LINEAR_DEFAULTS["min_steps"]) if min_steps is None else min_steps
    elif min_steps is None:
        min_steps = 0
    if epochs < 1 or lr <= 0 or batch_size < 1 or min_steps < 0 or weight_decay < 0:
        raise ValueError(
            f"linear probe needs epochs >= 1, lr > 0, batch_size >= 1, min_steps >= 0, weight_decay >= 0; "
            f"got epochs={epochs}, lr={lr}, batch_size={batch_size}, min_steps={min_steps}, "
            f"weight_decay={weight_decay}"
        )
    dev = torch.device(device or "cpu")
    x_train, y_train = train.features[layer], train.masks
    k, ignore = train.num_classes, train.ignore_index
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = LinearHead(x_train.shape[1], k)
    head.to(dev)
    n = x_train.shape[0]
    per_epoch = math.ceil(n / batch_size)
    rounds = max(epochs, math.ceil(min_steps / per_epoch))
    total = rounds * per_epoch
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    gen = torch.Generator().manual_seed(seed)
    head.train()
    with Progress(total, f"linear probe, block {layer}", progress) as bar:
        for _ in range(rounds):
            order = torch.randperm(n, generator=gen)
            for s in range(0, n, batch_size):
                ids = order[s : s + batch_size]
                y = y_train[ids].to(dev).long()
                if y.shape[0] < 2 and n >= 2:  # BatchNorm needs more than one value per channel
                    ids = order[max(0, s - 1) : s + batch_size]
                    y = y_train[ids].to(dev).long()
                x = x_train[ids].to(dev, torch.float32)
                if bool((y != ignore).any()):
                    loss = F.cross_entropy(_upsampled(head(x), y.shape[-2:]), y, ignore_index=ignore)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                sched.step()
                bar.update()
    head.eval()
    meter = ConfusionMeter(k, ignore)
    with torch.no_grad():
        for s in range(0, len(test), batch_size):
            x = test.features[layer][s : s + batch_size].to(dev, torch.float32)
            y = test.masks[s : s + batch_size].to(dev).long()
            meter.update(_upsampled(head(x), y.shape[-2:]).argmax(1), y)
    return meter.scores()
