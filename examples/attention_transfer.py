"""Attention transfer on scikit-learn's 8x8 digits: a teacher ViT, then students with copy and distill.

One pixel per patch (64 patches + a class token), a small ViT (depth 4, dim 64, 4 heads). The teacher
is trained first; then three students start from the same random init and train for the same number
of epochs: from scratch, with the teacher's attention copied (AttentionCopy, all blocks), and with
attention distillation (AttentionDistill; depth 4 <= 6, so all blocks, weight 3). Prints a table of
test accuracies. Seeds are fixed; under 3 minutes on 2 CPU cores (2 min 43 s measured with
--threads 1 while another job held the second core).

Run: python examples/attention_transfer.py [--teacher-epochs 40] [--student-epochs 15] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vitattn.analysis import digits_images
from vitattn.transfer import AttentionCopy, AttentionDistill, TransferOutput

LR = 5e-3  # peak learning rate (one-cycle schedule), the best of 1e-3 / 5e-3 / 1e-2 for the teacher
ARCH = dict(
    img_size=8, patch_size=1, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0
)


def digits_split(test_fraction: float = 0.25, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(x_train, y_train, x_test, y_test)``: images ``(N, 1, 8, 8)`` scaled to [-1, 1], a fixed split."""
    images, labels = digits_images(size=(8, 8), channels=1)
    images = images * 2.0 - 1.0
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return images[train], labels[train], images[test], labels[test]


def new_vit(seed: int) -> VisionTransformer:
    torch.manual_seed(seed)
    return VisionTransformer(**ARCH)


def logits_and_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Task cross-entropy, plus the attention loss when the model is an AttentionDistill in training."""
    out = model(x)
    if isinstance(out, TransferOutput):
        logits, extra = out.logits, out.attn_loss
    else:
        logits, extra = out, None
    loss = F.cross_entropy(logits, y)
    return logits, loss if extra is None else loss + extra


def train(model: nn.Module, data: tuple[torch.Tensor, ...], epochs: int, seed: int, batch: int = 64) -> None:
    """AdamW (peak lr ``LR``, weight decay 0.05), one-cycle schedule; fixed batch order per seed."""
    x, y = data[0], data[1]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.05)
    steps = epochs * ((len(y) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch):
            _, loss = logits_and_loss(model, x[idx], y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()


@torch.no_grad()
def accuracy(model: nn.Module, data: tuple[torch.Tensor, ...]) -> float:
    model.eval()
    out = model(data[2])
    logits = out.logits if isinstance(out, TransferOutput) else out
    return float((logits.argmax(-1) == data[3]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-epochs", type=int, default=40)
    parser.add_argument("--student-epochs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = digits_split()
    print(f"digits: {len(data[1])} train / {len(data[3])} test images, 8x8, one pixel per patch")
    rows = []

    t0 = time.perf_counter()
    teacher = new_vit(seed=1)
    train(teacher, data, args.teacher_epochs, seed=1)
    rows.append(("teacher", args.teacher_epochs, accuracy(teacher, data), time.perf_counter() - t0))

    students = {
        "student from scratch": lambda s: s,
        "student + attention copy": lambda s: AttentionCopy(teacher, s),
        "student + attention distill": lambda s: AttentionDistill(teacher, s),
    }
    for name, wrap in students.items():
        t0 = time.perf_counter()
        model = wrap(new_vit(seed=2))  # the same init for every student
        train(model, data, args.student_epochs, seed=2)
        rows.append((name, args.student_epochs, accuracy(model, data), time.perf_counter() - t0))

    print(f"\n{'model':<30} {'epochs':>6} {'test acc':>9} {'train s':>8}")
    for name, epochs, acc, seconds in rows:
        print(f"{name:<30} {epochs:>6} {acc:>9.2%} {seconds:>8.1f}")
    print("\ncopy uses the teacher's attention at test time too; distill's student runs alone.")


if __name__ == "__main__":
    main()
