"""Peak memory of an attention-distillation training step: vitattn (recompute) vs naive (maps kept).

ViT-S/16 teacher and student (timm's vit_small_patch16_224), default layers (all but the last 6),
CPU float32: 224 px batch 8, and 448 px batch 2 (not with --quick). Each variant runs in its own
subprocess; see vitattn/bench/transfer.py for how the memory is measured.

Usage: python benchmarks/bench_transfer_memory.py [--quick] [--threads N]
       [--out benchmarks/results/transfer_memory_cpu.json]
Same as `vitattn bench transfer`; this script also saves the JSON next to the other results.
"""

from __future__ import annotations

import argparse

import torch

import vitattn.bench.transfer  # noqa: F401  (registers the "transfer" suite)
from vitattn.bench import run_suites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="224 px only, one timed step")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default="benchmarks/results/transfer_memory_cpu.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run_suites(["transfer"], quick=args.quick, json_path=args.out)


if __name__ == "__main__":
    main()
