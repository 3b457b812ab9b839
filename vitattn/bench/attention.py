"""Suite ``entmax``: entmax-1.5 attention, forward + backward, ours vs the `entmax` package vs softmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..functional import attention
from .harness import Goal, SuiteResult, register_suite, timed_rounds

SHAPES = [(8, 6, 197, 64), (2, 6, 785, 64)]
OURS, PACKAGE, SOFTMAX = "vitattn entmax15", "entmax pkg entmax15", "softmax (materialized)"
GOAL_OVER_SOFTMAX = 1.25  # ours / materialized softmax attention, at every shape (issue 15)
GOAL_OVER_PACKAGE = 4.5  # the entmax package / ours, at the first shape
ROUNDS, MIN_RUN_TIME = 5, 0.2  # interleaved rounds; seconds per implementation and round


def _fwd_bwd(forward, q, k, v, grad):
    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        forward(q, k, v).backward(grad)

    return step


def _materialized(normalize):
    def forward(q, k, v):
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return normalize(scores) @ v

    return forward


@register_suite(
    "entmax",
    "entmax-1.5 attention fwd+bwd: vitattn vs the entmax package vs softmax (CPU, float32)",
    multiprocess=True,
)
def entmax_suite(quick: bool = False) -> SuiteResult:
    try:
        from entmax import entmax15 as package_entmax15
    except ImportError as err:
        raise ImportError(
            "vitattn bench entmax: this suite times the `entmax` package, which is not installed; "
            "pip install 'vitattn[bench]'"
        ) from err

    rows = []
    for shape in SHAPES:
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape)
        impls = {
            OURS: _fwd_bwd(lambda q, k, v: attention(q, k, v, normalizer="entmax15"), q, k, v, grad),
            PACKAGE: _fwd_bwd(_materialized(lambda s: package_entmax15(s, dim=-1)), q, k, v, grad),
            SOFTMAX: _fwd_bwd(_materialized(lambda s: s.softmax(-1)), q, k, v, grad),
            "softmax SDPA": _fwd_bwd(F.scaled_dot_product_attention, q, k, v, grad),
        }
        case = "(" + ", ".join(map(str, shape)) + ")"
        rows += timed_rounds(case, impls, rounds=ROUNDS, min_run_time=MIN_RUN_TIME, quick=quick)
    result = SuiteResult(
        name="entmax",
        title="entmax-1.5 attention, forward+backward, float32, (B, H, N, D), ratio = ms / vitattn entmax15",
        reference=OURS,
        rows=rows,
    )
    for i, shape in enumerate(SHAPES):
        case = "(" + ", ".join(map(str, shape)) + ")"
        result.goals.append(Goal(case, OURS, SOFTMAX, GOAL_OVER_SOFTMAX))
        if i == 0:
            result.goals.append(Goal(case, PACKAGE, OURS, GOAL_OVER_PACKAGE, at_least=True))
    return result
