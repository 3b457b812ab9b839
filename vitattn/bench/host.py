"""Suite ``host``: the host time of one call of the Triton path, with the kernel launches stubbed out.

At small sequences (ViT-B/16's 197 tokens) and even at 4096 tokens with a batch of 4, the device runs
showed vitattn's calls bound by the work on the host: the Python between ``attention(...)`` and the
kernel launches (docs/kernels.md, "Host time"). This suite measures that work on the CPU, no GPU
needed: under ``TRITON_INTERPRET=1`` every kernel is replaced by a launcher that does nothing, so one
call runs the dispatcher, the eager autograd wrapper (or the custom ops), the launch descriptions and
autograd's plumbing, and nothing else. Not counted: Triton's own launcher and the CUDA calls of a
real device (the interpreter's branch of ``ops._launch`` does not look up a tuned tile).

The reference row is one ``F.scaled_dot_product_attention`` call on the same tiny CPU tensors (1 x 1 x
16 x 16): about the cost of dispatching one fused op. Each row also notes the Python function calls per
call (``python_calls``), counted with ``sys.setprofile``: a number that does not depend on the machine.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..functional import GaussianBias, attention
from .harness import SuiteResult, register_suite, timed_rounds

SHAPE = (1, 2, 256, 64)  # (B, H, N, D): 1 + 15 x 17 tokens (a class token and a 15 x 17 grid)
GRID = (15, 17)
DTYPE = torch.bfloat16  # what a GPU run takes (float32 reads torch's TF32 flags besides)
REFERENCE = "SDPA, one call (1x1x16x16)"
PATHS = {
    "softmax": ("softmax", False),
    "gaussian": ("softmax", True),
    "entmax15": ("entmax15", False),
}
MODES = ("fwd", "fwd+bwd")


class _NoLaunch:
    """A kernel whose launches do nothing (``kernel[grid](*args, **meta)``)."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **meta: None


@contextlib.contextmanager
def stubbed_kernels() -> Iterator[None]:
    """Inside the block every Triton kernel of vitattn launches nothing (``TRITON_INTERPRET=1`` must be
    set before triton is imported, so that the host path is the interpreter's, which needs no GPU)."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from ..kernels import ops

    if not ops.interpret_requested():
        raise RuntimeError(
            "vitattn bench host measures the interpreter's host path: run it as "
            "TRITON_INTERPRET=1 vitattn bench host (triton was imported without it)"
        )
    found = ops.kernels()
    saved = dict(found)
    found.update({name: _NoLaunch() for name in found})
    try:
        yield
    finally:
        found.clear()
        found.update(saved)


def call(path: str, mode: str, shape: tuple[int, int, int, int] = SHAPE) -> Callable[[], object]:
    """One call of ``path`` (see :data:`PATHS`) on the Triton backend, forward or forward + backward."""
    normalizer, gaussian = PATHS[path]
    gen = torch.Generator().manual_seed(0)
    b, h, n, d = shape
    q, k, v = (torch.randn(shape, generator=gen).to(DTYPE).requires_grad_(mode != "fwd") for _ in range(3))
    sigma = torch.full((b, h, n - 1, 2), 2.0, requires_grad=mode != "fwd")  # the grid's tokens
    alpha = torch.ones(b, h, n - 1, 1, requires_grad=mode != "fwd")
    leaves = [q, k, v, sigma, alpha] if gaussian else [q, k, v]
    grad = torch.randn(b, h, n, d, generator=gen).to(DTYPE)

    def forward() -> torch.Tensor:
        bias = GaussianBias(sigma, alpha, GRID, num_prefix_tokens=1) if gaussian else None
        return attention(q, k, v, normalizer=normalizer, bias=bias, backend="triton")

    if mode == "fwd":

        def run_fwd() -> object:
            with torch.no_grad():
                return forward()

        return run_fwd
    return lambda: torch.autograd.grad(forward(), leaves, grad)


def reference_call() -> Callable[[], object]:
    """The suites' reference: one SDPA call on tiny CPU tensors (:data:`REFERENCE`)."""
    q = torch.randn(1, 1, 16, 16)
    return lambda: F.scaled_dot_product_attention(q, q, q)


def python_calls(fn: Callable[[], object]) -> int:
    """Python function calls made by one ``fn()`` (after a first call that warms caches)."""
    fn()
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # the profiler sees the call of fn itself


@register_suite(
    "host", "host time of a Triton-path call, kernel launches stubbed (CPU, interpreter)", multiprocess=True
)
def host_suite(quick: bool = False) -> SuiteResult:
    rows = []
    notes = []
    with stubbed_kernels():
        for mode in MODES:
            impls: dict[str, Callable[[], object]] = {REFERENCE: reference_call()}
            impls.update({f"vitattn {path}": call(path, mode) for path in PATHS})
            case = f"host {mode} {'x'.join(map(str, SHAPE))}"
            rows += timed_rounds(case, impls, rounds=5, min_run_time=0.2, quick=quick)
            counts = {name: python_calls(fn) for name, fn in impls.items() if name != REFERENCE}
            for r in rows:
                if r.case == case and r.impl in counts:
                    r.extra["python_calls"] = counts[r.impl]
            notes.append(f"{case} Python calls per call: " + ", ".join(f"{n} {c}" for n, c in counts.items()))
    return SuiteResult(
        name="host",
        title="host time per call, kernel launches stubbed (CPU), ratio = ms / one SDPA call",
        reference=REFERENCE,
        rows=rows,
        notes=notes,
    )
