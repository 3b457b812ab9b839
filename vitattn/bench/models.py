"""Suites ``models`` (LocAtViT-Tiny vs timm ViT-Tiny, inference and train step, 224 and 448 px, CPU float32)
and ``compiled`` (the same inference under ``torch.compile``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import timm
import torch
from torch import nn

from ..models import LocAtViT
from .harness import Goal, SuiteResult, register_suite, timed_rounds

REFERENCE = "timm vit_tiny"
CASES = [(224, 16), (448, 2)]  # (image size, batch)
# issue 15: within these ratios to timm ViT-Tiny in every one of several fresh processes
# per case: interleaved rounds, and each implementation's seconds per round (Timer.blocked_autorange)
ROUNDS, MIN_RUN_TIME = 5, 0.5
GOALS = {("inference", 224): 1.05, ("train", 224): 1.10, ("inference", 448): 1.10, ("train", 448): 1.15}
TINY: dict[str, Any] = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)


def _step(model: nn.Module, x: torch.Tensor, train: bool) -> Callable[[], None]:
    """One inference forward, or one training step (forward + backward, no optimizer)."""
    if train:

        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(x).logsumexp(-1).mean().backward()

    else:

        def step() -> None:
            with torch.inference_mode():
                model(x)

    return step


def _models(size: int) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        REFERENCE: timm.create_model("vit_tiny_patch16_224", img_size=size),
        "locatvit_tiny": LocAtViT(img_size=size, **TINY),
        "locatvit_tiny prr=False": LocAtViT(img_size=size, prr=False, **TINY),
    }


@register_suite(
    "models",
    "LocAtViT-Tiny vs timm ViT-Tiny: inference and train step at 224 px (b16) and 448 px (b2), CPU float32",
    multiprocess=True,
)
def models_suite(quick: bool = False) -> SuiteResult:
    rows = []
    for size, batch in CASES:
        models = _models(size)
        x = torch.randn(batch, 3, size, size)
        for mode in ("inference", "train"):
            train = mode == "train"
            impls = {name: _step(m.train(train), x, train) for name, m in models.items()}
            case = f"{mode} {size}px b{batch}"
            rows += timed_rounds(case, impls, rounds=ROUNDS, min_run_time=MIN_RUN_TIME, quick=quick)
    result = SuiteResult(
        name="models",
        title=f"LocAtViT-Tiny vs timm ViT-Tiny, float32, CPU, ratio = ms / {REFERENCE}",
        reference=REFERENCE,
        rows=rows,
    )
    for (mode, size), goal in GOALS.items():
        row = next(r for r in rows if r.impl == "locatvit_tiny" and r.case.startswith(f"{mode} {size}px"))
        result.goals.append(Goal(row.case, "locatvit_tiny", REFERENCE, goal))
    return result


COMPILED_REFERENCE = "timm vit_tiny compiled"


@register_suite(
    "compiled",
    "LocAtViT-Tiny vs timm ViT-Tiny under torch.compile (inductor): inference at 224 px (b16) and 448 px "
    "(b2), CPU float32",
    multiprocess=True,
)
def compiled_suite(quick: bool = False) -> SuiteResult:
    """Both models compiled with inductor's default mode (its C++ CPU backend needs a compiler), next
    to both eager; each model is compiled once per size, before the timed rounds."""
    rows = []
    for size, batch in CASES:
        eager = _models(size)
        impls = {}
        x = torch.randn(batch, 3, size, size)
        for name in (REFERENCE, "locatvit_tiny"):
            model = eager[name].eval()
            impls[name] = _step(model, x, train=False)
            compiled = cast(nn.Module, torch.compile(model))  # an OptimizedModule wrapping it
            impls[f"{name} compiled"] = _step(compiled, x, train=False)
        case = f"inference {size}px b{batch}"
        rows += timed_rounds(case, impls, rounds=ROUNDS, min_run_time=MIN_RUN_TIME, quick=quick)
    return SuiteResult(
        name="compiled",
        title=f"torch.compile (inductor), inference, float32, CPU, ratio = ms / {COMPILED_REFERENCE}",
        reference=COMPILED_REFERENCE,
        rows=rows,
    )
