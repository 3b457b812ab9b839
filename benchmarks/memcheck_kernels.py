"""Small driver for ``compute-sanitizer --tool memcheck``: a few small cases per kernel, forward + backward.

Usage: PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 3 \
           python benchmarks/memcheck_kernels.py [--out memcheck.json] [--dry-run]

Each normalizer (softmax, entmax-1.5) runs on tiny ragged shapes (N = 37 = 1 + 6x6, head dim 24 padded
to 32, and one head dim 128 case) in bf16 through ``attention(..., backend="triton")``: no bias, the
in-kernel Gaussian bias, a broadcast additive mask (its gradient uses atomics), a boolean mask with a
dead row plus the Gaussian bias, and a key-padding mask with a bias tensor; alpha-entmax (one alpha per
head) with the Gaussian bias and with an additive mask; the Gaussian bias in a 3 x 3 window (the list
kernels) for softmax and entmax-1.5. Together they launch every kernel (forward, the backward's row
term, dK/dV, dQ) with every kind of bias operand. With
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` each tensor is its own ``cudaMalloc``, so the sanitizer sees an
access past any tensor's end. Autotuning is whatever the environment asks (``gpu_check.sh`` sets
``VITATTN_TRITON_TILES=first``: one config per kernel). The JSON is rewritten after every case (a
killed run keeps the cases it finished); ``--dry-run`` runs three cases at N = 17 on the CPU
(``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from vitattn.functional import GaussianBias, WindowMask, attention

# (normalizer, kind, head dim); "alpha": alpha-entmax with one alpha per head; "gaussian_window": the
# Gaussian bias in a 3 x 3 neighbourhood window (the list kernels)
CASES = [
    *(
        (normalizer, kind, d)
        for normalizer in ("softmax", "entmax15")
        for kind, d in (
            ("none", 24),
            ("gaussian", 24),
            ("add", 24),
            ("gaussian_keep", 128),
            ("padding_bias", 24),
        )
    ),
    ("alpha", "gaussian", 24),
    ("alpha", "add", 24),
    ("softmax", "gaussian_window", 24),
    ("entmax15", "gaussian_window", 128),
]
DRY_CASES = [("softmax", "gaussian_keep", 24), ("entmax15", "add", 24), ("alpha", "gaussian_window", 24)]


def run_case(
    normalizer: str,
    kind: str,
    d: int,
    dev: str,
    dt: torch.dtype,
    n: int = 37,
    b: int = 2,
    h: int = 3,
    check_finite: bool = True,
) -> None:
    """Forward + backward of one case, q, k, v ``(B, H, N, D)`` with ``N - 1`` a square (a class token
    and a square patch grid); raises if a gradient is not finite (unless ``check_finite`` is false: the
    warm step's compile-only launches leave outputs unwritten)."""
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    leaves = [q, k, v]
    mask: torch.Tensor | WindowMask | None = None
    bias: torch.Tensor | GaussianBias | None = None
    if kind.startswith("gaussian"):
        sigma = torch.rand(1, h, n - 1, 2, device=dev, requires_grad=True)
        alpha = torch.rand(1, h, n - 1, 1, device=dev, requires_grad=True)
        side = math.isqrt(n - 1)
        bias = GaussianBias(sigma, alpha, (side, side), num_prefix_tokens=1)
        leaves += [sigma, alpha]
    if kind == "gaussian_keep":
        mask = torch.rand(b, 1, n, n, device=dev) < 0.5
        mask[0, 0, 3] = False  # a dead row
    if kind == "add":
        mask = torch.randn(1, h, n, n, device=dev, dtype=dt).requires_grad_()  # broadcast: atomics
        leaves.append(mask)
    if kind == "padding_bias":
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool, device=dev)
        mask[1, ..., -9:] = False
        bias = torch.randn(b, 1, 1, n, device=dev, dtype=dt)
    if kind == "gaussian_window":
        side = math.isqrt(n - 1)
        mask = WindowMask((side, side), 3, num_prefix_tokens=1)
    norm: str | torch.Tensor = normalizer
    if normalizer == "alpha":
        norm = (1.2 + 0.6 * torch.rand(h, device=dev)).requires_grad_()
        leaves.append(norm)
    out = attention(q, k, v, normalizer=norm, mask=mask, bias=bias, backend="triton")
    grads = torch.autograd.grad(out.float().square().sum(), leaves)
    if dev == "cuda":
        torch.cuda.synchronize()
    if check_finite and not all(torch.isfinite(g).all() for g in grads):
        raise FloatingPointError(f"{normalizer} {kind} d={d}: non-finite gradient")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", help="JSON file of the cases run (rewritten after each)")
    parser.add_argument("--dry-run", action="store_true", help="two cases on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("memcheck_kernels: no CUDA device (use --dry-run on the CPU)")
        return 1
    dev, dt = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    start = time.time()
    done: list[dict[str, object]] = []
    failed = 0
    for normalizer, kind, d in DRY_CASES if args.dry_run else CASES:
        t0 = time.time()
        entry: dict[str, object] = {"normalizer": normalizer, "kind": kind, "head_dim": d}
        try:
            if args.dry_run:
                run_case(normalizer, kind, d, dev, dt, n=17, b=1, h=1)
            else:
                run_case(normalizer, kind, d, dev, dt)
            entry["ok"] = True
        except Exception as exc:  # noqa: BLE001  (one failing case is reported, the others still run)
            entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
            failed += 1
        entry["seconds"] = round(time.time() - t0, 2)
        done.append(entry)
        print(
            f"{'ok' if entry['ok'] else 'FAIL'} {normalizer:<9} {kind:<13} d={d:<4} {entry['seconds']}s "
            f"{entry.get('error', '')}",
            flush=True,
        )
        if args.out:
            payload = {
                "cases": done,
                "device": dev,
                "dtype": str(dt).removeprefix("torch."),
                "seconds": round(time.time() - start, 1),
            }
            Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"memcheck_kernels: {len(done)} cases, {failed} failed, {time.time() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
