"""Peak memory of an attention-distillation training step: vitattn (recompute) vs naive (maps kept).

ViT-S/16 teacher and student (timm's vit_small_patch16_224), default layers (all but the last 6),
CPU float32: 224 px batch 8, and 448 px batch 2 (not with --quick). Each variant runs in its own
subprocess; see vitattn/bench/transfer.py for how the memory is measured.

Usage: python benchmarks/bench_transfer_memory.py [--quick] [--threads N]
       [--out benchmarks/results/transfer_memory_cpu.json]
Same as `vitattn bench transfer`; this script also saves the JSON next to the other results.
"""

from vitattn.bench.harness import script_main

if __name__ == "__main__":
    script_main("transfer", "benchmarks/results/transfer_memory_cpu.json")
