"""Attention analysis: maps from any ViT, locality metrics per head, reports and plots.

``attention_maps`` reads ``(B, H, N, N)`` probabilities of a timm or vitattn ViT; the metrics
``mean_attention_distance`` and ``attention_entropy`` turn them into ``(B, H)``;
``locality_report`` averages them over images per layer and head; ``attention_rollout`` /
``gradient_rollout`` follow them through the blocks (``rollout_heatmap``: the class token's map of
the patches). Plots (``plot_*``) need
matplotlib, progress bars tqdm and the digits data scikit-learn (the ``study`` extra).
``build_model`` makes the model ``vitattn analyze`` looks at: a timm name, optionally patched and
loaded from a checkpoint.
"""

from .checkpoint import load_checkpoint, read_state_dict
from .images import InputSpec, digits_images, image_folder_batches, input_spec
from .maps import attention_maps, record_attention, resolve_layers, timm_attention_probs
from .metrics import attention_entropy, grid_diagonal, grid_distances, mean_attention_distance
from .model import build_model
from .plots import (
    plot_alpha_per_layer,
    plot_locality_plane,
    plot_mad_per_layer,
    plot_query_attention,
    plot_rollout,
)
from .report import LocalityReport, ReportDiff, head_alphas, locality_report
from .rollout import (
    attention_gradients,
    attention_rollout,
    gradient_rollout,
    model_heatmap,
    model_rollout,
    rollout_heatmap,
    upsample_heatmap,
)

__all__ = [
    "InputSpec",
    "LocalityReport",
    "ReportDiff",
    "attention_entropy",
    "attention_gradients",
    "attention_maps",
    "attention_rollout",
    "build_model",
    "digits_images",
    "grid_diagonal",
    "grid_distances",
    "gradient_rollout",
    "head_alphas",
    "image_folder_batches",
    "input_spec",
    "load_checkpoint",
    "locality_report",
    "mean_attention_distance",
    "model_heatmap",
    "model_rollout",
    "plot_alpha_per_layer",
    "plot_locality_plane",
    "plot_mad_per_layer",
    "plot_query_attention",
    "plot_rollout",
    "read_state_dict",
    "record_attention",
    "resolve_layers",
    "rollout_heatmap",
    "timm_attention_probs",
    "upsample_heatmap",
]
