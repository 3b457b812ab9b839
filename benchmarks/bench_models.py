"""LocAtViT-Tiny vs timm ViT-Tiny: inference and training step at 224 px (batch 16) and 448 px (batch 2).

Usage: python benchmarks/bench_models.py [--quick] [--threads N] [--out benchmarks/results/models_cpu.json]
Same as `vitattn bench models`; this script also saves the JSON next to the other results.
"""

from __future__ import annotations

import argparse

import torch

import vitattn.bench.models  # noqa: F401  (registers the "models" suite)
from vitattn.bench import run_suites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default="benchmarks/results/models_cpu.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run_suites(["models"], quick=args.quick, json_path=args.out)


if __name__ == "__main__":
    main()
