"""The trainer: the training-protocol locality study, and fine-tuning of any timm backbone.

Train the study's compact ViT (depth 8, dim 192, 8 heads, MLP ratio 2) — or any timm ViT / Eva /
Swin from scratch, from timm's pretrained weights or a checkpoint, patched with vitattn's attention
— under protocols built from AutoAugment, CutMix and label smoothing, on the built-in sets or an
ImageNet-layout folder, in mixed precision and under torchrun; then measure test accuracy, the
attention locality (MAD, entropy) of every head, and images/s and peak memory per epoch.
``vitattn study`` is the command; :func:`run_study` the API::

    from vitattn.study import make_config, run_study
    outcome = run_study(make_config("quick", epochs=2), "runs/my-study")
    print(outcome.table)

Needs the ``study`` extra (scikit-learn, torchvision, matplotlib, tqdm, safetensors).
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "backbone": ("CheckpointMismatch",),
    "config": ("ATTENTIONS", "PRESETS", "ConfigError", "StudyConfig", "make_config"),
    "builtin_datasets": ("DatasetMissingError", "load_datasets"),
    "dataset_specs": ("DATASETS", "DatasetSpec"),
    "imagefolder": ("DataFolderError", "inspect_imagefolder"),
    "model": ("build_model",),
    "protocols": ("ABLATION", "PROTOCOLS", "Protocol", "resolve_protocols"),
    "results": ("load_results", "summary_table", "validate_results"),
    "runner": (
        "StudyConfigMismatch",
        "StudyOutcome",
        "default_out_dir",
        "prepare_config",
        "run_specs",
        "run_study",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    """Import on first use: ``vitattn`` (and its CLI) stays quick to load without torchvision."""
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ABLATION",
    "ATTENTIONS",
    "DATASETS",
    "PRESETS",
    "PROTOCOLS",
    "CheckpointMismatch",
    "ConfigError",
    "DataFolderError",
    "DatasetMissingError",
    "DatasetSpec",
    "Protocol",
    "StudyConfig",
    "StudyConfigMismatch",
    "StudyOutcome",
    "build_model",
    "default_out_dir",
    "inspect_imagefolder",
    "load_datasets",
    "load_results",
    "make_config",
    "prepare_config",
    "resolve_protocols",
    "run_specs",
    "run_study",
    "summary_table",
    "validate_results",
]
