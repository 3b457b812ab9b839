"""Small driver for ``compute-sanitizer --tool memcheck``: every kernel, every variant, every config.

Usage: compute-sanitizer --tool memcheck --error-exitcode 3 python benchmarks/memcheck_kernels.py

Runs forward + backward of each normalizer x bias case on tiny ragged shapes (N = 37 = 1 + 6x6, head
dim 24 padded to 32, plus one head dim 128 case) in bf16. Case ``i`` pins config ``i mod len`` of every
kernel's autotune list, so across the cases every config of every kernel runs under the sanitizer
without autotuning. Prints one line per case; any sanitizer report makes the run fail.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from vitattn.functional import GaussianBias, attention
from vitattn.kernels import configs, ops

CASES = ("none", "gaussian", "gaussian_keep", "add", "add_full", "keep", "key_padding", "bias_and_mask")


def run_case(
    normalizer: str, kind: str, d: int = 24, n: int = 37, b: int = 2, h: int = 3, dev: str = "cuda"
) -> None:
    dt = torch.bfloat16
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    leaves = [q, k, v]
    mask = bias = None
    if kind.startswith("gaussian"):
        sigma = torch.rand(1, h, n - 1, 2, device=dev, requires_grad=True)
        alpha = torch.rand(1, h, n - 1, 1, device=dev, requires_grad=True)
        bias = GaussianBias(sigma, alpha, (6, 6), num_prefix_tokens=1)
        leaves += [sigma, alpha]
    if kind in ("keep", "gaussian_keep"):
        mask = torch.rand(b, 1, n, n, device=dev) < 0.5
        mask[0, 0, 3] = False  # a dead row
    if kind == "key_padding":
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool, device=dev)
        mask[1, ..., -9:] = False
    if kind in ("add", "bias_and_mask"):
        mask = torch.randn(1, h, n, n, device=dev, dtype=dt).requires_grad_()  # broadcast: atomics
        leaves.append(mask)
    if kind == "add_full":
        mask = torch.randn(b, h, n, n, device=dev, dtype=dt).requires_grad_()  # full: plain stores
        leaves.append(mask)
    if kind == "bias_and_mask":
        bias = torch.randn(b, 1, 1, n, device=dev, dtype=dt)
    out = attention(q, k, v, normalizer=normalizer, mask=mask, bias=bias, backend="triton")
    grads = torch.autograd.grad(out.float().square().sum(), leaves)
    if dev == "cuda":
        torch.cuda.synchronize()
    assert all(torch.isfinite(g).all() for g in grads), "non-finite gradient"


def pin_configs(index: int, head_dim: int, masked: bool) -> None:
    """Make every kernel's autotune list one config: number ``index`` (modulo) of those usable here."""
    block_d = ops.block_dim(head_dim)
    for name, tiles in ORIGINAL.items():
        usable = [c for c in tiles if block_d <= c.head_dim_limit(masked)]
        configs.AUTOTUNE[name] = (usable[index % len(usable)],)
    ops._TUNED.clear()


ORIGINAL = dict(configs.AUTOTUNE)


def main() -> int:
    if not torch.cuda.is_available():
        print("memcheck_kernels: no CUDA device, nothing to check")
        return 0
    os.environ.pop("VITATTN_TRITON_TILES", None)
    torch.manual_seed(0)
    start = time.time()
    i = 0
    for normalizer in ("softmax", "entmax15"):
        for kind, d in [(kind, 24) for kind in CASES] + [("gaussian_keep", 128), ("none", 128)]:
            pin_configs(i, d, masked=kind not in ("none", "gaussian"))
            run_case(normalizer, kind, d=d)
            tiles = ", ".join(f"{name} {configs.AUTOTUNE[name][0]}" for name in ORIGINAL)
            print(f"ok {normalizer:<9} {kind:<14} d={d:<4} {tiles}", flush=True)
            i += 1
    print(f"memcheck_kernels: {i} cases in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
