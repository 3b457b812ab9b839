"""Training-free dense nearest-neighbour retrieval (in the style of the Hummingbird evaluation).

Memory bank: every train patch with at least one labelled pixel, its feature L2-normalised, and its
label distribution (the fraction of each class among the patch's non-ignored pixels). A test patch's
class scores are the label distributions of its ``k`` most cosine-similar bank patches, weighted by
``softmax(similarity / temperature)``; the ``(K, gh, gw)`` scores of an image are upsampled
bilinearly to the mask and the argmax is the prediction. Exact search (no approximate index).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .extract import DenseFeatures
from .metrics import ConfusionMeter, SegmentationScores
from .progress import Progress

__all__ = ["KNN_DEFAULTS", "knn_probe", "patch_label_distributions"]

KNN_DEFAULTS = dict(k=10, temperature=0.02, bank_size=200_000)

#: similarity entries computed at once: (query chunk) x (bank chunk)
_CHUNK_ELEMENTS = 2**24


def patch_label_distributions(
    masks: torch.Tensor, grid: tuple[int, int], num_classes: int, ignore_index: int
) -> torch.Tensor:
    """``(B, H, W)`` masks -> ``(B, gh, gw, K)`` class fractions among each patch's labelled pixels.

    A pixel ``(y, x)`` belongs to patch ``(y * gh // H, x * gw // W)`` (the area downsampling when
    ``H`` and ``W`` are multiples of the grid). Patches with no labelled pixel get all zeros.
    """
    b, h, w = masks.shape
    gh, gw = grid
    rows = torch.arange(h, device=masks.device) * gh // h
    cols = torch.arange(w, device=masks.device) * gw // w
    patch = (rows[:, None] * gw + cols[None, :]).expand(b, h, w)
    image = torch.arange(b, device=masks.device)[:, None, None].expand(b, h, w)
    labels = masks.long()
    keep = labels != ignore_index
    flat = ((image * gh * gw + patch) * num_classes + labels)[keep]
    counts = torch.bincount(flat, minlength=b * gh * gw * num_classes).reshape(b, gh, gw, num_classes)
    counts = counts.float()
    return counts / counts.sum(-1, keepdim=True).clamp_min(1.0)


def _flat_patches(features: torch.Tensor) -> torch.Tensor:
    """``(B, C, gh, gw)`` -> ``(B * gh * gw, C)`` L2-normalised, float32."""
    return F.normalize(features.float().permute(0, 2, 3, 1).reshape(-1, features.shape[1]), dim=1)


def _topk_similar(queries: torch.Tensor, bank: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine top-``k`` of each query against the bank, in chunks: ``(Q, k)`` similarities and indices."""
    q_chunk = max(1, min(queries.shape[0], 1024))
    b_chunk = max(k, _CHUNK_ELEMENTS // q_chunk)
    sims, ids = [], []
    for qs in range(0, queries.shape[0], q_chunk):
        q = queries[qs : qs + q_chunk]
        best_s = q.new_full((q.shape[0], 0), float("-inf"))
        best_i = torch.empty((q.shape[0], 0), dtype=torch.long, device=q.device)
        for bs in range(0, bank.shape[0], b_chunk):
            s = q @ bank[bs : bs + b_chunk].T
            top = s.topk(min(k, s.shape[1]), dim=1)
            cand_s = torch.cat([best_s, top.values], 1)
            cand_i = torch.cat([best_i, top.indices + bs], 1)
            keep = cand_s.topk(min(k, cand_s.shape[1]), dim=1)
            best_s, best_i = keep.values, cand_i.gather(1, keep.indices)
        sims.append(best_s)
        ids.append(best_i)
    return torch.cat(sims), torch.cat(ids)


def knn_probe(
    train: DenseFeatures,
    test: DenseFeatures,
    layer: int,
    *,
    k: int = 10,
    temperature: float = 0.02,
    bank_size: int = 200_000,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> SegmentationScores:
    """Score dense nearest-neighbour retrieval from ``train`` to ``test`` at block ``layer``.

    ``bank_size``: at most this many train patches (a random subset drawn with ``seed`` when there are
    more). ``k``: neighbours per test patch; ``temperature``: of the softmax over their cosine
    similarities. Similarities are computed in chunks of about 16 M entries, so memory is bounded.
    """
    if k < 1 or temperature <= 0 or bank_size < 1:
        raise ValueError(
            f"knn probe needs k >= 1, temperature > 0, bank_size >= 1; got k={k}, "
            f"temperature={temperature}, bank_size={bank_size}"
        )
    dev = torch.device(device or "cpu")
    kk, ignore = train.num_classes, train.ignore_index
    grid = train.grid
    feats, dists = [], []
    for s in range(0, len(train), batch_size):
        f = train.features[layer][s : s + batch_size]
        d = patch_label_distributions(train.masks[s : s + batch_size], grid, kk, ignore).reshape(-1, kk)
        keep = d.sum(1) > 0
        feats.append(_flat_patches(f)[keep])
        dists.append(d[keep])
    bank, labels = torch.cat(feats), torch.cat(dists)
    if bank.shape[0] == 0:
        raise ValueError("the train masks hold no labelled pixel: the knn memory bank is empty")
    if bank.shape[0] > bank_size:
        pick = torch.randperm(bank.shape[0], generator=torch.Generator().manual_seed(seed))[:bank_size]
        bank, labels = bank[pick], labels[pick]
    bank, labels = bank.to(dev), labels.to(dev)
    meter = ConfusionMeter(kk, ignore)
    batches = range(0, len(test), batch_size)
    with Progress(len(batches), f"knn probe, block {layer}", progress) as bar:
        for s in batches:
            f = test.features[layer][s : s + batch_size].to(dev)
            y = test.masks[s : s + batch_size].to(dev).long()
            b, _, gh, gw = f.shape
            sim, ids = _topk_similar(_flat_patches(f), bank, k)
            w = torch.softmax(sim / temperature, dim=1)
            scores = (w[:, :, None] * labels[ids]).sum(1)  # (b * gh * gw, K)
            scores = scores.reshape(b, gh, gw, kk).permute(0, 3, 1, 2)
            up = F.interpolate(scores, size=y.shape[-2:], mode="bilinear", align_corners=False)
            meter.update(up.argmax(1), y)
            bar.update()
    return meter.scores()
