"""Quickstart: sparse (entmax-1.5) and Gaussian-biased attention with vitattn's functional API.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import torch

from vitattn.functional import GaussianBias, attention, entmax15


def main() -> None:
    torch.manual_seed(0)
    # entmax-1.5 gives exact zeros where softmax gives small positive weights.
    scores = torch.tensor([[2.0, 1.5, 0.2, -1.0]])
    print("softmax   ", torch.softmax(scores, -1).numpy().round(3))
    print("entmax15  ", entmax15(scores).numpy().round(3))

    # Attention over a ViT-like token set: 1 class token + a 4 x 4 patch grid, 2 heads of dim 8.
    b, h, grid, d = 1, 2, (4, 4), 8
    n = 1 + grid[0] * grid[1]
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))

    out, probs = attention(q, k, v, normalizer="entmax15", return_weights=True)
    print(f"entmax15 attention: out {tuple(out.shape)}, {float((probs == 0).float().mean()):.0%} exact zeros")

    # GAug: each patch query prefers nearby keys, through a Gaussian bias with its own variances
    # (row, column) and amplitude; the class token's row and column get no bias.
    sigma = torch.full((b, h, n - 1, 2), 0.5)  # small variances: strongly local
    alpha = torch.full((b, h, n - 1, 1), 4.0)
    bias = GaussianBias(sigma, alpha, grid_size=grid, num_prefix_tokens=1)
    _, local = attention(q, k, v, bias=bias, return_weights=True)
    _, plain = attention(q, k, v, return_weights=True)
    centre = 1 + 1 * grid[1] + 1  # the patch at row 1, column 1
    print("weight on its 3x3 neighbourhood, plain vs Gaussian-biased:")
    neighbours = [1 + r * grid[1] + c for r in range(3) for c in range(3)]
    print(
        f"  plain {float(plain[0, 0, centre, neighbours].sum()):.2f}   "
        f"biased {float(local[0, 0, centre, neighbours].sum()):.2f}"
    )


if __name__ == "__main__":
    main()
