"""LocAtViT-Tiny vs timm ViT-Tiny: inference and training step at 224 px (batch 16) and 448 px (batch 2).

Usage: python benchmarks/bench_models.py [--quick] [--threads N] [--keep-heap] [--processes N]
       [--out benchmarks/results/models_cpu.json]
Same as `vitattn bench models`; this script also saves the JSON next to the other results.
`--processes 5` runs the suite in 5 fresh processes and reports min / median / max of each ratio.
"""

from vitattn.bench.harness import script_main

if __name__ == "__main__":
    script_main("models", "benchmarks/results/models_cpu.json")
