"""entmax-1.5 attention, forward + backward on the CPU: vitattn vs the `entmax` package vs softmax.

Usage: python benchmarks/bench_entmax_attention.py [--quick] [--out benchmarks/results/entmax_cpu.json]
Same as `vitattn bench entmax`; this script also saves the JSON next to the other results.
"""

from __future__ import annotations

import argparse

from vitattn.bench import run_suites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/entmax_cpu.json")
    args = parser.parse_args()
    run_suites(["entmax"], quick=args.quick, json_path=args.out)


if __name__ == "__main__":
    main()
