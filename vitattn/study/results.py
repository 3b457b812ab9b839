"""``results.json``: its schema, validation, the CSV and the summary table.

Schema (``schema_version`` 1; extra keys may be added, none removed)::

    {"schema_version": 1, "status": "running" | "complete",
     "config": {...StudyConfig.to_dict()...},
     "runs": [{"name": str, "protocol": str,
               "components": {"autoaugment": bool, "cutmix": bool, "label_smoothing": bool},
               "attention": str, "prr": bool, "seed": int, "epochs": int,
               "test_acc": float,              # top-1 accuracy in [0, 1]
               "layers": [{"layer": int, "mad": [per head], "entropy": [per head]}, ...],
               "first_layers": [int, ...], "min_mad_first": float,   # min head MAD over those blocks
               "mean_entropy": [per layer], "mean_mad": [per layer],
               "sparsity": [per layer],           # mean over heads of the fraction of exact zeros
               "mean_sparsity": float,            # over layers and heads (0 for softmax)
               "alpha": [[per head], ...],        # only for --attention adaptive: learned alpha per layer
               "probe": null | {                  # dense probe (datasets with masks: scenes)
                   "linear_miou": float, "knn_miou": float,          # in [0, 1]
                   "linear_pixel_acc": float, "knn_pixel_acc": float,
                   "alignment": float | null,     # mean cosine of patch tokens to the class token
                   "layer": int},                 # the probed block (non-negative)
               "num_images": int, "seconds": float, "resumed_from_epoch": int, "world_size": int,
               "amp": "bf16" | "fp16" | "none", "grid_size": [gh, gw],
               "throughput": {"train_images_per_s": float, "eval_images_per_s": float,  # last epoch
                              "peak_memory_mb": float,           # over the epochs (and ranks)
                              "memory": "cuda_allocated" | "cpu_rss"},
               "history": [{"epoch", "train_loss", "lr", "seconds", "train_images_per_s", "test_acc",
                            "eval_seconds", "eval_images_per_s", "peak_memory_mb"}],
               "checkpoint": str}, ...]}

MAD is normalized by the grid diagonal and entropy by log(patches): both in [0, 1]. ``sparsity``,
``mean_sparsity``, ``probe``, ``alpha``, ``amp``, ``grid_size``, ``throughput`` and the history's
throughput keys were added in schema version 1 without a version change (files without them still
load; ``probe`` is null where a run has no probe). Images per second count all ranks together; the
CPU's peak memory is the process's peak RSS (a high-water mark since the process started).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypedDict

from ..analysis import LocalityReport
from .protocols import COMPONENTS
from .train import RunResult

__all__ = [
    "SCHEMA_VERSION",
    "load_results",
    "report_of",
    "run_record",
    "summary_rows",
    "summary_table",
    "validate_results",
    "write_csv",
    "write_results",
]

SCHEMA_VERSION = 1


class _LayerRecord(TypedDict):
    """One ``runs[i]["layers"]`` entry: a block's per-head MAD and entropy."""

    layer: int
    mad: list[float]
    entropy: list[float]


def _mean(values: Iterable[float | None]) -> float:
    ok = [v for v in values if v is not None and not math.isnan(v)]
    return sum(ok) / len(ok) if ok else math.nan


def _throughput(history: list[dict[str, Any]], memory: str) -> dict[str, Any]:
    """The run's ``throughput``: the last epoch's images/s, the peak memory over its epochs."""
    if not history or "train_images_per_s" not in history[-1]:
        return {}
    return {
        "train_images_per_s": history[-1]["train_images_per_s"],
        "eval_images_per_s": history[-1]["eval_images_per_s"],
        "peak_memory_mb": max(h.get("peak_memory_mb", 0.0) for h in history),
        "memory": memory,
    }


def _grid(grid: tuple[int, int] | None) -> list[int] | None:
    return None if grid is None else [int(g) for g in grid]


def run_record(result: RunResult, first_layers: list[int], epochs: int, root: Path) -> dict[str, Any]:
    """The ``runs[i]`` entry of ``results.json`` for a finished run."""
    rep = result.report
    if rep is None:
        raise ValueError(f"run {result.spec.name!r} has no locality report (records come from rank 0)")
    layers: list[_LayerRecord] = [
        {"layer": int(i), "mad": [float(v) for v in m], "entropy": [float(v) for v in e]}
        for i, m, e in zip(rep.layers, rep.mad, rep.entropy, strict=True)
    ]
    first = [v for row in layers if row["layer"] in first_layers for v in row["mad"] if not math.isnan(v)]
    spec = result.spec
    run = {
        "name": spec.name,
        "protocol": spec.protocol.name,
        "components": spec.protocol.components(),
        "attention": spec.attention,
        "prr": spec.prr,
        "seed": spec.seed,
        "epochs": epochs,
        "test_acc": float(result.test_acc),
        "layers": layers,
        "first_layers": list(first_layers),
        "min_mad_first": min(first) if first else math.nan,
        "mean_mad": [_mean(row["mad"]) for row in layers],
        "mean_entropy": [_mean(row["entropy"]) for row in layers],
        "sparsity": [_mean(row) for row in rep.sparsity],
        "mean_sparsity": rep.mean_sparsity,
        "probe": result.probe,
        "num_images": rep.num_images,
        "seconds": result.seconds,
        "resumed_from_epoch": result.resumed_from_epoch,
        "world_size": result.world_size,
        "amp": result.amp,
        "grid_size": _grid(result.grid_size or rep.grid_size),
        "throughput": _throughput(result.history, result.memory),
        "history": result.history,
        "checkpoint": os.path.relpath(result.checkpoint, root),
    }
    if rep.alpha:  # the model learns its alpha-entmax alphas (--attention adaptive)
        run["alpha"] = rep.alpha
    return run


def validate_results(data: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first place where ``data`` breaks the schema."""

    def need(cond: bool, where: str, what: str) -> None:
        if not cond:
            raise ValueError(f"results.json: {where}: {what}")

    need(isinstance(data, dict), "top level", "must be an object")
    need(isinstance(data.get("config"), dict), "config", "must be an object")
    need(isinstance(data.get("runs"), list), "runs", "must be a list")
    for i, run in enumerate(data["runs"]):
        w = f"runs[{i}]"
        need(isinstance(run, dict), w, "must be an object")
        need(isinstance(run.get("protocol"), str), w, "protocol must be a string")
        comp = run.get("components")
        need(
            isinstance(comp, dict) and set(comp) == set(COMPONENTS),
            w,
            f"components must have keys {COMPONENTS}",
        )
        need(all(isinstance(v, bool) for v in comp.values()), w, "components must be booleans")
        need(isinstance(run.get("attention"), str), w, "attention must be a string")
        need(isinstance(run.get("seed"), int) and not isinstance(run["seed"], bool), w, "seed must be an int")
        acc = run.get("test_acc")
        need(
            isinstance(acc, float) and 0.0 <= acc <= 1.0,
            w,
            f"test_acc must be a float in [0, 1], got {acc!r}",
        )
        layers = run.get("layers")
        need(isinstance(layers, list) and len(layers) > 0, w, "layers must be a non-empty list")
        for j, layer in enumerate(layers):
            lw = f"{w}.layers[{j}]"
            need(isinstance(layer.get("layer"), int), lw, "layer must be an int")
            mad, ent = layer.get("mad"), layer.get("entropy")
            need(
                isinstance(mad, list) and isinstance(ent, list) and len(mad) == len(ent) > 0,
                lw,
                "mad and entropy must be equal-length non-empty lists (one value per head)",
            )
            for v in mad + ent:
                need(
                    v is None or (isinstance(v, float) and -1e-6 <= v <= 1 + 1e-6),
                    lw,
                    f"normalized MAD / entropy must lie in [0, 1], got {v!r}",
                )

        probe = run.get("probe")
        need(probe is None or isinstance(probe, dict), w, "probe must be null or an object")
        if isinstance(probe, dict):
            for key in ("linear_miou", "knn_miou"):
                v = probe.get(key)
                need(
                    isinstance(v, float) and 0.0 <= v <= 1.0,
                    f"{w}.probe",
                    f"{key} must be a float in [0, 1], got {v!r}",
                )
            layer = probe.get("layer")
            need(
                isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0,
                f"{w}.probe",
                f"layer must be a non-negative int, got {layer!r}",
            )


def _clean(obj: Any) -> Any:
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def write_results(path: Path, config: dict[str, Any], runs: list[dict[str, Any]], status: str) -> None:
    """Write ``results.json`` atomically (NaN written as null)."""
    data = _clean({"schema_version": SCHEMA_VERSION, "status": status, "config": config, "runs": runs})
    validate_results(data)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def load_results(path: str | Path) -> dict[str, Any]:
    """Read and validate a ``results.json`` (a file, or a study folder holding one); a file that is not
    JSON or breaks the schema is a ``ValueError`` naming it."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not a readable results.json ({err})") from err
    try:
        validate_results(data)
    except ValueError as err:
        raise ValueError(f"{str(path)!r}: {err}") from err
    return data


def report_of(run: dict[str, Any], config: dict[str, Any]) -> LocalityReport:
    """A run's locality as a :class:`~vitattn.analysis.LocalityReport` (for the analysis plots)."""
    nan = math.nan
    return LocalityReport(
        layers=[row["layer"] for row in run["layers"]],
        mad=[[nan if v is None else v for v in row["mad"]] for row in run["layers"]],
        entropy=[[nan if v is None else v for v in row["entropy"]] for row in run["layers"]],
        grid_size=tuple(run.get("grid_size") or config["grid_size"]),
        num_prefix_tokens=1,
        num_images=int(run.get("num_images", 0)),
        model=run.get("name", run["protocol"]),
    )


def write_csv(path: Path, runs: list[dict[str, Any]]) -> None:
    """One row per run: protocol, components, attention, seed, accuracy, min MAD of the first layers,
    then mean MAD and mean entropy (over heads) of every layer."""
    depth = max((len(r["layers"]) for r in runs), default=0)
    head = [
        "name",
        "protocol",
        *COMPONENTS,
        "attention",
        "prr",
        "seed",
        "epochs",
        "test_acc",
        "min_mad_first",
        "mean_sparsity",
        "linear_miou",
        "knn_miou",
        "probe_layer",
        "train_images_per_s",
        "eval_images_per_s",
        "peak_memory_mb",
    ]
    head += [f"mad_l{i}" for i in range(depth)] + [f"entropy_l{i}" for i in range(depth)]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(head)
    for r in runs:
        row = [r["name"], r["protocol"], *(int(r["components"][c]) for c in COMPONENTS), r["attention"]]
        row += [int(r.get("prr", False)), r["seed"], r.get("epochs"), f"{r['test_acc']:.4f}"]
        probe = r.get("probe") or {}
        row += [_num(r.get("min_mad_first")), _num(r.get("mean_sparsity"))]
        row += [_num(probe.get("linear_miou")), _num(probe.get("knn_miou")), probe.get("layer", "")]
        speed = r.get("throughput") or {}
        row += [_num(speed.get(k), 1) for k in ("train_images_per_s", "eval_images_per_s", "peak_memory_mb")]
        row += [_num(v) for v in r.get("mean_mad", [])] + [_num(v) for v in r.get("mean_entropy", [])]
        writer.writerow(row)
    path.write_text(buf.getvalue())


def _num(v: float | None, digits: int = 4) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _mean_std(name: str, values: list[float]) -> dict[str, float]:
    """``{name_mean, name_std}`` over seeds (NaN mean when there are none, std 0 for one)."""
    return {
        f"{name}_mean": statistics.fmean(values) if values else math.nan,
        f"{name}_std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def _pm(mean: float, std: float, seeds: int, digits: int = 1) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if seeds > 1 else "")


def summary_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs grouped by (protocol, attention, prr), in first-seen order, with over-seed statistics:
    accuracy mean / std, min MAD of the first layers mean / min / max, mean sparsity, linear and
    k-NN probe mIoU and patch–class-token alignment mean / std (NaN without a probe), mean entropy
    per layer."""
    groups: dict[tuple[str, str, bool], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["protocol"], r["attention"], bool(r.get("prr", False))), []).append(r)
    rows = []
    for (protocol, attention, prr), rs in groups.items():
        accs = [100 * r["test_acc"] for r in rs]
        mads = [r["min_mad_first"] for r in rs if r.get("min_mad_first") is not None]
        depth = min(len(r["mean_entropy"]) for r in rs)
        sparsity = [r["mean_sparsity"] for r in rs if r.get("mean_sparsity") is not None]
        probes = [r["probe"] for r in rs if r.get("probe")]
        rows.append(
            dict(
                protocol=protocol,
                components=rs[0]["components"],
                attention=attention + ("+prr" if prr else ""),
                seeds=len(rs),
                acc_mean=statistics.fmean(accs),
                acc_std=statistics.stdev(accs) if len(accs) > 1 else 0.0,
                min_mad_mean=statistics.fmean(mads) if mads else math.nan,
                min_mad_lo=min(mads) if mads else math.nan,
                min_mad_hi=max(mads) if mads else math.nan,
                entropy=[_mean(r["mean_entropy"][i] for r in rs) for i in range(depth)],
                sparsity=statistics.fmean(sparsity) if sparsity else math.nan,
                **_mean_std("linear_miou", [100 * p["linear_miou"] for p in probes]),
                **_mean_std("knn_miou", [100 * p["knn_miou"] for p in probes]),
                **_mean_std("alignment", [p["alignment"] for p in probes if p.get("alignment") is not None]),
                first_layers=rs[0].get("first_layers", []),
            )
        )
    return rows


def summary_table(runs: list[dict[str, Any]]) -> str:
    """A Markdown table of :func:`summary_rows` (prints well in a terminal, pastes into docs)."""
    rows = summary_rows(runs)
    if not rows:
        return "(no finished runs)"
    first = rows[0]["first_layers"]
    first_txt = f"blocks {first[0]}–{first[-1]}" if len(first) > 1 else f"block {first[0]}"
    depth = max(len(r["entropy"]) for r in rows)
    head = [
        "protocol",
        "AA",
        "CM",
        "LS",
        "attention",
        "seeds",
        "test acc %",
        f"min MAD ({first_txt})",
        "sparsity",
        "linear mIoU %",
        "k-NN mIoU %",
        "patch–CLS cos",
        f"mean entropy per layer (0–{depth - 1})",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        c = r["components"]
        acc = _pm(r["acc_mean"], r["acc_std"], r["seeds"])
        dense = [
            _pm(r["linear_miou_mean"], r["linear_miou_std"], r["seeds"]),
            _pm(r["knn_miou_mean"], r["knn_miou_std"], r["seeds"]),
            _pm(r["alignment_mean"], r["alignment_std"], r["seeds"], digits=3),
        ]
        sparsity = "–" if math.isnan(r["sparsity"]) else f"{r['sparsity']:.2f}"
        mad = _num(r["min_mad_mean"], 3)
        if r["seeds"] > 1:
            mad += f" [{_num(r['min_mad_lo'], 3)}–{_num(r['min_mad_hi'], 3)}]"
        ent = " ".join(_num(v, 2) for v in r["entropy"])
        marks = ["✓" if c[k] else "·" for k in COMPONENTS]
        cells = [r["protocol"], *marks, r["attention"], str(r["seeds"]), acc, mad, sparsity, *dense, ent]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
