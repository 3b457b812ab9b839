"""Suite ``train``: one training step of LocAtViT-Tiny, ViT-Tiny with entmax-1.5 and timm's ViT-Tiny.

A step is what a trainer does per batch: forward, cross-entropy, backward, AdamW step. On the CPU
in float32 (224 px, batch 16; ``--quick``: batch 8); on CUDA, when there is one, under bf16 autocast
(batch 64), where vitattn's attention takes the fused Triton kernels. The three models run side by
side in one process; ``vitattn bench train --processes N`` gives min / median / max of the ratios over
fresh processes.
"""

from __future__ import annotations

from collections.abc import Callable

import timm
import torch
from torch import nn

from ..models import LocAtViT
from ..patch import patch
from .harness import SuiteResult, register_suite, timed_rounds

REFERENCE = "timm vit_tiny"
TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
SIZE = 224
ROUNDS, MIN_RUN_TIME = 5, 1.5  # interleaved rounds; seconds per model and round


def models() -> dict[str, nn.Module]:
    """The three ViT-Tiny models (224 px, 1000 classes), seeded."""
    torch.manual_seed(0)
    return {
        REFERENCE: timm.create_model("vit_tiny_patch16_224"),
        "locatvit_tiny": LocAtViT(img_size=SIZE, **TINY),  # type: ignore[arg-type]
        "vit_tiny entmax15": patch(timm.create_model("vit_tiny_patch16_224"), "entmax15"),
    }


def training_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None
) -> Callable[[], None]:
    """One step of AdamW (lr 1e-4) on ``(x, y)``; forward and loss under autocast when ``dtype`` is set."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device = x.device.type

    def step() -> None:
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()

    return step


@register_suite(
    "train",
    "one training step (forward, loss, backward, AdamW) of LocAtViT-Tiny, ViT-Tiny with entmax-1.5 and timm "
    "ViT-Tiny, 224 px: CPU float32 b16, or CUDA bf16 autocast b64",
    multiprocess=True,
)
def train_suite(quick: bool = False) -> SuiteResult:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch = 64 if cuda else (8 if quick else 16)
    dtype = torch.bfloat16 if cuda else None
    x = torch.randn(batch, 3, SIZE, SIZE, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    steps = {name: training_step(m.to(device).train(), x, y, dtype) for name, m in models().items()}
    precision = "bf16 autocast" if cuda else "float32"
    case = f"train step {SIZE}px b{batch} {device.type} {precision}"
    rows = timed_rounds(case, steps, rounds=ROUNDS, min_run_time=MIN_RUN_TIME, quick=quick)
    return SuiteResult(
        name="train",
        title=f"One training step, {device.type} {precision}, ratio = ms / {REFERENCE}",
        reference=REFERENCE,
        rows=rows,
        notes=[
            "a step: forward, cross-entropy, backward and AdamW's update; the three models take turns "
            "in every round (vitattn.bench.harness.timed_rounds)"
        ],
    )
