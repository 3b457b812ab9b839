"""entmax-1.5 attention, forward + backward on the CPU: vitattn vs the `entmax` package vs softmax.

Usage: python benchmarks/bench_entmax_attention.py [--quick] [--threads N] [--keep-heap] [--processes N]
       [--out benchmarks/results/entmax_cpu.json]
Same as `vitattn bench entmax`; this script also saves the JSON next to the other results.
"""

from vitattn.bench.harness import script_main

if __name__ == "__main__":
    script_main("entmax", "benchmarks/results/entmax_cpu.json")
