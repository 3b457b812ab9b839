"""LocAtViT-Tiny vs timm ViT-Tiny under torch.compile (inductor, CPU): inference at 224 px (b16), 448 px (b2).

Usage: python benchmarks/bench_compiled.py [--quick] [--threads N] [--keep-heap] [--processes N]
       [--out benchmarks/results/compiled_cpu.json]
Same as `vitattn bench compiled` (needs a C++ compiler for inductor); this script also saves the JSON.
"""

from vitattn.bench.harness import script_main

if __name__ == "__main__":
    script_main("compiled", "benchmarks/results/compiled_cpu.json")
