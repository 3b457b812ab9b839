"""Run a whole study into an output folder, resuming whatever an earlier call left unfinished.

Folder layout::

    OUT/results.json                 config + finished runs (schema: vitattn.study.results)
    OUT/results.csv                  one row per run
    OUT/summary.md                   the summary table
    OUT/locality_plane.png, mad_per_layer.png, min_mad_vs_acc.png
    OUT/checkpoints/<run>/model.safetensors        weights of a finished run
    OUT/checkpoints/<run>/state.json + state-eNNNN.safetensors   training state of an unfinished run
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..adapter import layout_of
from ..functional.window import window_starts
from .config import ConfigError, StudyConfig, config_diff
from .distributed import DistEnv, barrier, init_distributed, shutdown_distributed
from .results import load_results, run_record, summary_table, write_csv, write_results
from .train import RunResult, RunSpec, train_run
from .words import plural

__all__ = [
    "StudyConfigMismatch",
    "StudyOutcome",
    "check_inputs",
    "default_out_dir",
    "describe_study",
    "prepare_config",
    "run_specs",
    "run_study",
    "window_covers_grid",
]


class StudyConfigMismatch(ValueError):
    """The output folder holds a study with another configuration."""


@dataclass
class StudyOutcome:
    """``status``: ``complete`` or ``interrupted``; ``data``: the results.json content; ``out``: folder."""

    status: str
    data: dict[str, Any]
    out: Path
    table: str


def default_out_dir(config: StudyConfig) -> Path:
    """``runs/study-<dataset>-<preset>-<hash of the config>``: the same command reuses (and resumes)
    the same folder, another configuration gets another."""
    return Path("runs") / f"study-{config.dataset}-{config.preset}-{config.digest()}"


def run_specs(config: StudyConfig) -> list[RunSpec]:
    """Every run of the study, seed by seed (a partial study covers all protocols for the first seeds)."""
    return [
        RunSpec(protocol, attention, seed, config.prr)
        for seed in config.seeds
        for attention in config.attentions
        for protocol in config.protocol_list
    ]


def window_covers_grid(grid: tuple[int, int], window: int, dilation: int) -> bool:
    """Whether a ``window x window`` neighbourhood (``dilation``) holds every patch of ``grid`` for every
    query: the window attention is then plain softmax attention."""
    return all(all(count == size for _, count in window_starts(size, window, dilation)) for size in grid)


def describe_study(config: StudyConfig, n_runs: int, env: DistEnv) -> list[str]:
    """The study's opening lines: what runs on what (and a note when a window covers the whole grid)."""
    import dataclasses

    from .amp import resolve_amp
    from .model import build_model, count_parameters

    with torch.device("meta"):  # the architecture only: no weights read, nothing downloaded
        bare = dataclasses.replace(config, pretrained=False, checkpoint=None, gaug_init=config.gaug_init)
        model = build_model(bare, config.attentions[0])
    params = count_parameters(model)
    grid = layout_of(model).grid() or config.spec.grid_size
    size = config.input_size
    ddp = f", DDP over {env.world_size} ranks" if env.distributed else ""
    if config.model is None:
        what = f"ViT depth {config.depth}, dim {config.dim}, {config.heads} heads"
    else:
        what = f"{config.model} ({plural(config.model_depth, 'block')})"
    if config.pretrained:
        what += ", timm's pretrained weights"
    elif config.checkpoint is not None:
        what += f", from {config.checkpoint}"
    if config.from_weights and "locat" in config.attentions:
        what += f", GAug start {config.gaug_init}"
    if "window" in config.attentions:
        dilated = f", dilation {config.dilation}" if config.dilation > 1 else ""
        what += f", window {config.window_size}x{config.window_size}{dilated}"
    amp = resolve_amp(config.amp, env.device)
    lines = [
        f"vitattn study: {config.dataset} ({size} px, {grid[0]}x{grid[1]} patch grid), "
        f"preset {config.preset}: {plural(len(config.protocols), 'protocol')} x "
        f"{plural(len(config.attentions), 'attention')} x {plural(len(config.seeds), 'seed')} = "
        f"{plural(n_runs, 'run')} of {plural(config.epochs, 'epoch')}; {what} "
        f"({params / 1e6:.2f} M parameters with {config.attentions[0]} attention); device {env.device}, "
        f"amp {amp}"
        f"{', torch.compile' if config.compile else ''}{ddp}"
    ]
    if "window" in config.attentions and window_covers_grid(grid, config.window_size, config.dilation):
        lines.append(
            f"note: the {config.window_size}x{config.window_size} window covers the whole "
            f"{grid[0]}x{grid[1]} patch grid, so the window attention is plain softmax attention here; "
            f"give a smaller --window (at most {min(grid) - 1}) for a local one"
        )
    return lines


def _run_line(record: dict[str, Any]) -> str:
    """One line of a finished run: accuracy, minimum MAD, sparsity, probe mIoU, time."""
    first = record["first_layers"]
    parts = [
        f"test acc {100 * record['test_acc']:.2f} %",
        f"min MAD (blocks {first[0]}-{first[-1]}) {record['min_mad_first']:.4f}",
        f"sparsity {record['mean_sparsity']:.2f}",
    ]
    probe = record.get("probe")
    if probe:
        parts.append(
            f"probe (block {probe['layer']}) mIoU linear {100 * probe['linear_miou']:.1f} % / "
            f"k-NN {100 * probe['knn_miou']:.1f} %"
        )
    speed = record.get("throughput") or {}
    if speed:
        mem = "peak CUDA memory" if speed["memory"] == "cuda_allocated" else "peak RSS"
        parts.append(
            f"{speed['train_images_per_s']:.0f} / {speed['eval_images_per_s']:.0f} img/s train / test, "
            f"{mem} {speed['peak_memory_mb']:.0f} MiB"
        )
    return ", ".join(parts + [f"{record['seconds']:.0f} s"])


def _clear(out: Path) -> None:
    for name in ("results.json", "results.csv", "summary.md"):
        (out / name).unlink(missing_ok=True)
    for png in out.glob("*.png"):
        png.unlink()
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


def _previous_runs(config: StudyConfig, out: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The finished runs an earlier call left in ``out`` and that study's status (``running``,
    ``complete``; None when there is none).

    Raises :class:`StudyConfigMismatch` when ``out`` holds a study of another configuration.
    """
    results_path = out / "results.json"
    if not results_path.is_file():
        return [], None
    old = load_results(results_path)
    diff = config_diff(old["config"], config.to_dict())
    if diff:
        raise StudyConfigMismatch(
            f"{str(out)!r} holds a study with another configuration ({'; '.join(diff)}); "
            "choose another --out, pass --overwrite, or --resume to continue that study"
        )
    return old["runs"], str(old.get("status"))


def check_inputs(config: StudyConfig, env: DistEnv, specs: list[RunSpec]) -> None:
    """Check what a study can check before it writes anything, for the runs ``specs``: the device, the
    batch over the ranks, the dataset's files, and each run's starting checkpoint (it exists, is
    readable, and fits the model of each attention: shapes only, the models built on the meta device).

    A local file of timm's pretrained weights (``pretrained_cfg_overlay={"file": ...}``) must exist;
    the Hugging Face Hub cache is left to timm.

    Raises :class:`ConfigError`, ``DatasetMissingError``, ``FileNotFoundError`` or
    :class:`~.backbone.CheckpointMismatch`, each naming what is wrong.
    """
    import dataclasses

    from .backbone import fit_weights, read_weights
    from .builtin_datasets import check_dataset
    from .model import build_backbone

    if env.device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(env.device)!r}: CUDA is not available here", "device")
    batch = config.global_batch_size
    if batch % env.world_size:
        raise ConfigError(f"batch_size {batch} is not divisible by the {env.world_size} ranks", "batch_size")
    mixed = any(spec.protocol.cutmix for spec in specs)
    if config.dataset == "imagefolder" and mixed and (batch // env.world_size) % 2:
        raise ConfigError(f"batch_size {batch}: timm's Mixup needs an even batch on every rank", "batch_size")
    check_dataset(config.dataset, config.data_dir, config.download)
    overlay = config.model_args.get("pretrained_cfg_overlay") if config.pretrained else None
    local = overlay.get("file") if isinstance(overlay, dict) else None
    if local is not None and not Path(local).is_file():  # timm's pretrained weights from a local file
        raise FileNotFoundError(f"--pretrained: the weights file {str(local)!r} does not exist")
    if config.checkpoint is None:
        return
    bare = dataclasses.replace(config, pretrained=False, checkpoint=None, gaug_init=config.gaug_init)
    for seed in dict.fromkeys(s.seed for s in specs):
        path = config.checkpoint_path(seed)
        state = read_weights(path)
        for attention in dict.fromkeys(s.attention for s in specs if s.seed == seed):
            with torch.device("meta"):
                model, new_keys = build_backbone(dataclasses.replace(bare, checkpoint=path), attention)
            fit_weights(model, state, new_keys, path)


def _record_run(
    result: RunResult, config: StudyConfig, out: Path, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """Append the finished run to ``results.json`` and the CSV; drop its training state (rank 0)."""
    record = run_record(result, config.first_layer_indices, config.epochs, out)
    runs.append(record)
    write_results(out / "results.json", config.to_dict(), runs, "running")
    write_csv(out / "results.csv", runs)
    folder = out / "checkpoints" / result.spec.name
    for stale in [folder / "state.json", *folder.glob("state-e*.safetensors")]:
        stale.unlink(missing_ok=True)
    return record


def _finish_study(
    config: StudyConfig, out: Path, runs: list[dict[str, Any]], seconds: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """Mark the study complete, write the summary and the plots, print the table (rank 0)."""
    from .plots import write_plots

    results_path = out / "results.json"
    table = summary_table(runs)
    last = len(config.first_layer_indices) - 1
    first = "block 0" if last == 0 else f"blocks 0..{last}"
    write_results(results_path, config.to_dict(), runs, "complete")
    write_csv(out / "results.csv", runs)
    (out / "summary.md").write_text(table + "\n")
    write_plots(out, load_results(results_path))
    say(f"\n{table}\n")
    say(
        f"MAD: mean attention distance / grid diagonal; min over the heads of {first}; sparsity: "
        "fraction of exact zeros in the attention maps; mIoU: linear and k-NN segmentation probes of the "
        "frozen features (–: no masks); entropy: mean over heads / log(patches). "
        f"{seconds:.0f} s. Results, CSV, plots and checkpoints in {out}"
    )
    return load_results(results_path)


def prepare_config(config: StudyConfig, log: Callable[[str], None] = print) -> StudyConfig:
    """``config`` with what only the data can tell filled in, checked before any training: an
    image folder's layout and images (:func:`~.imagefolder.inspect_imagefolder`) and its classes."""
    if config.dataset != "imagefolder":
        return config
    import dataclasses

    from .imagefolder import DataFolderError, inspect_imagefolder

    summary = inspect_imagefolder(Path(config.data_dir), config.check_images)
    if config.num_classes is not None and config.num_classes != summary.num_classes:
        raise DataFolderError(
            f"{config.data_dir!r} holds {summary.num_classes} classes, the study was set up for "
            f"{config.num_classes}"
        )
    log(
        f"vitattn study: {config.data_dir}: {summary.num_classes} classes, {summary.counts['train']} "
        f"training and {summary.counts['val']} validation images"
    )
    return dataclasses.replace(config, num_classes=summary.num_classes)


def _out_folder(config: StudyConfig, out: str | Path | None) -> Path:
    """The study's output folder (default :func:`default_out_dir`); refused when it is a file."""
    folder = Path(out) if out is not None else default_out_dir(config)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"out {str(folder)!r} is a file, not a folder", "out")
    return folder


def run_study(
    config: StudyConfig,
    out: str | Path | None = None,
    *,
    overwrite: bool = False,
    stop_after_epochs: int | None = None,
    log: Callable[[str], None] = print,
) -> StudyOutcome:
    """Run (or resume, or finish) the study described by ``config`` into ``out``.

    When ``out`` holds an unfinished study of the same configuration (runtime keys such as
    ``data_dir`` or ``threads`` may differ), finished runs are kept and the interrupted run
    continues from its last epoch checkpoint. A finished study is reported, not rerun.

    Args:
        out: output folder (default :func:`default_out_dir`).
        overwrite: delete an earlier study in ``out`` first.
        stop_after_epochs: stop the current run after this many epochs, leaving it resumable (for
            tests of resumption).
        log: where progress lines go (rank 0 only).

    Raises:
        StudyConfigMismatch: ``out`` holds a study with another configuration.
        DatasetMissingError: the dataset is not under ``config.data_dir`` (an image folder that does
            not have the ImageNet layout: its subclass ``DataFolderError``).
        CheckpointMismatch: a checkpoint that does not fit the model.
    """
    env = init_distributed(config.device)
    if config.threads:
        torch.set_num_threads(int(config.threads))
    say: Callable[[str], None] = log if env.is_main else (lambda _: None)
    try:
        config = prepare_config(config, say)
        out = _out_folder(config, out)
        runs, status = ([], None) if overwrite else _previous_runs(config, out)
        if status == "complete":
            table = summary_table(runs)
            say(f"vitattn study: {str(out)!r} already holds this complete study\n{table}")
            return StudyOutcome("complete", load_results(out / "results.json"), out, table)
        specs = run_specs(config)
        done = {r["name"] for r in runs}
        check_inputs(config, env, [spec for spec in specs if spec.name not in done])
        # every input is checked: from here on the study writes
        if status is not None:
            finished = plural(len(runs), "run")
            say(f"vitattn study: resuming the study in {str(out)!r} ({finished} already finished)")
        if overwrite and env.is_main:
            _clear(out)
        barrier(env)
        cfg_dict = config.to_dict()
        for line in describe_study(config, len(specs), env):
            say(line)
        say(f"output: {out}")
        if env.is_main:
            out.mkdir(parents=True, exist_ok=True)
            write_results(out / "results.json", cfg_dict, runs, "running")
        t0 = time.perf_counter()
        for k, spec in enumerate(specs):
            if spec.name in done:
                continue
            say(f"[{k + 1}/{len(specs)}] {spec.name}")
            folder = out / "checkpoints" / spec.name
            result = train_run(config, spec, folder, env, stop_after_epochs=stop_after_epochs, log=say)
            if result is None:
                say(f"stopped after epoch {stop_after_epochs}; run the same command again to resume")
                data = (
                    load_results(out / "results.json") if env.is_main else {"config": cfg_dict, "runs": runs}
                )
                return StudyOutcome("interrupted", data, out, summary_table(runs))
            if env.is_main:
                record = _record_run(result, config, out, runs)
                say(f"  {spec.name}: {_run_line(record)}")
            barrier(env)
        data = {"config": cfg_dict, "runs": runs}
        if env.is_main:
            data = _finish_study(config, out, runs, time.perf_counter() - t0, say)
        return StudyOutcome("complete", data, out, summary_table(runs))
    finally:
        shutdown_distributed(env)
