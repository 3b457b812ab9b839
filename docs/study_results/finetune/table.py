"""Print docs/finetune.md's table from the studies written by commands.sh (mean ± std over seeds).

Usage: python docs/study_results/finetune/table.py OUT_DIR
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from vitattn.study import load_results

ARMS = [
    ("softmax", "softmax"),
    ("locat", "LocAt (identity start)"),
    ("entmax15", "entmax-1.5"),
    ("locat-prr", "LocAt + PRR (identity start)"),
    ("locat-lr100", "LocAt (identity start, GAug lr ×100)"),
    ("locat-prr-lr100", "LocAt + PRR (identity start, GAug lr ×100)"),
    ("locat-paper", "LocAt (paper start)"),
]


def cell(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    vals = [v * scale for v in values]
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.mean(vals):.{digits}f} ± {sd:.{digits}f}"


def alpha_at_bias(out: Path, folder: str, runs: list[dict]) -> str:
    """GAug's amplitude at the bias per block after fine-tuning: ``gate_h * softplus(b)`` with ``b`` the
    ``log_alpha`` bias (the amplitude of a query whose ``log_alpha`` weight term is 0) and ``gate_h``
    the identity start's per-head gate (1 without one), as ``mean [min, max]`` over heads and seeds;
    '·' for runs without GAug."""
    per_block: dict[str, list[float]] = {}
    for run in runs:
        path = out / folder / run["checkpoint"]
        if not path.exists():
            return "– (no checkpoints)"
        state = load_file(str(path))
        for key, value in state.items():
            if key.endswith("gaug.log_alpha.bias"):
                block = key.split(".attn")[0]
                gate = state.get(key.replace("log_alpha.bias", "gate"), torch.ones(1))
                alphas = gate.double() * float(torch.nn.functional.softplus(value))
                per_block.setdefault(block, []).extend(alphas.tolist())
    if not per_block:
        return "·"
    return "; ".join(
        f"{statistics.mean(v):.2g} [{min(v):.2g}, {max(v):.2g}]" for _, v in sorted(per_block.items())
    )


def main(out: Path) -> None:
    pre = load_results(out / "pretrain")["runs"][0]
    print(
        f"pretrained softmax (seed 0, {pre['epochs']} epochs): test acc {100 * pre['test_acc']:.1f} %, "
        f"linear mIoU {100 * pre['probe']['linear_miou']:.1f} %, k-NN mIoU {100 * pre['probe']['knn_miou']:.1f} %, "
        f"min MAD {pre['min_mad_first']:.3f}, patch–CLS cos {pre['probe']['alignment']:.3f}\n"
    )
    print(
        "| fine-tuned with | seeds | test acc % | linear mIoU % | k-NN mIoU % | min MAD (block 0) "
        "| patch–CLS cos | sparsity | α at the bias, per block: mean [min, max] |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for folder, label in ARMS:
        if not (out / folder / "results.json").exists() or not load_results(out / folder)["runs"]:
            continue
        runs = load_results(out / folder)["runs"]
        probes = [r["probe"] for r in runs]
        print(
            f"| {label} | {len(runs)} | {cell([r['test_acc'] for r in runs], 100)} "
            f"| {cell([p['linear_miou'] for p in probes], 100)} | {cell([p['knn_miou'] for p in probes], 100)} "
            f"| {cell([r['min_mad_first'] for r in runs], digits=3)} "
            f"| {cell([p['alignment'] for p in probes], digits=3)} "
            f"| {cell([r['mean_sparsity'] for r in runs], digits=2)} "
            f"| {alpha_at_bias(out, folder, runs)} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/finetune"))
