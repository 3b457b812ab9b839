"""The training-protocol locality study: does the training recipe alone make early ViT layers local?

Train the study's compact ViT (depth 8, dim 192, 8 heads, MLP ratio 2) under protocols built from
AutoAugment, CutMix and label smoothing, then measure test accuracy and the attention locality
(MAD, entropy) of every head. ``vitattn study`` is the command; :func:`run_study` the API::

    from vitattn.study import make_config, run_study
    outcome = run_study(make_config("quick", epochs=2), "runs/my-study")
    print(outcome.table)

Needs the ``study`` extra (scikit-learn, torchvision, matplotlib, tqdm, safetensors).
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "config": ("ATTENTIONS", "PRESETS", "StudyConfig", "make_config"),
    "datasets": ("DATASETS", "DatasetMissingError", "DatasetSpec", "load_datasets"),
    "model": ("build_model",),
    "protocols": ("ABLATION", "PROTOCOLS", "Protocol", "resolve_protocols"),
    "results": ("load_results", "summary_table", "validate_results"),
    "runner": ("StudyConfigMismatch", "StudyOutcome", "default_out_dir", "run_specs", "run_study"),
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
    "DatasetMissingError",
    "DatasetSpec",
    "Protocol",
    "StudyConfig",
    "StudyConfigMismatch",
    "StudyOutcome",
    "build_model",
    "default_out_dir",
    "load_datasets",
    "load_results",
    "make_config",
    "resolve_protocols",
    "run_specs",
    "run_study",
    "summary_table",
    "validate_results",
]
