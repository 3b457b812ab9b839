"""Dense evaluation of a frozen backbone: linear and nearest-neighbour segmentation probes per block.

- :func:`dense_probe`: features of a train and a test segmentation set, computed once, then a linear
  head (BatchNorm + 1×1 conv, upsampled logits) or Hummingbird-style dense kNN retrieval per block;
  a :class:`ProbeResult` with mIoU, pixel accuracy, IoU per class and patch / class-token alignment.
- :func:`patch_features`: ``(B, C, gh, gw)`` patch features and the class token of chosen blocks.
- :func:`miou`, :func:`confusion_matrix`, :func:`scores_from_confusion`, :class:`ConfusionMeter`.
- :func:`patch_cls_alignment`, :func:`pca_images`, :func:`plot_pca_images`: diagnostics.

See ``docs/dense.md``.
"""

from .api import METHODS, LayerProbe, ProbeResult, dense_probe, probe_features
from .diagnostics import patch_cls_alignment, pca_images
from .extract import DenseFeatures, extract_dense_features
from .features import FeatureMaps, patch_features
from .knn import KNN_DEFAULTS, knn_probe, patch_label_distributions
from .linear import LINEAR_DEFAULTS, LinearHead, linear_probe
from .metrics import ConfusionMeter, SegmentationScores, confusion_matrix, miou, scores_from_confusion
from .plots import plot_pca_images

__all__ = [
    "KNN_DEFAULTS",
    "LINEAR_DEFAULTS",
    "METHODS",
    "ConfusionMeter",
    "DenseFeatures",
    "FeatureMaps",
    "LayerProbe",
    "LinearHead",
    "ProbeResult",
    "SegmentationScores",
    "confusion_matrix",
    "dense_probe",
    "extract_dense_features",
    "knn_probe",
    "linear_probe",
    "miou",
    "patch_cls_alignment",
    "patch_features",
    "patch_label_distributions",
    "pca_images",
    "plot_pca_images",
    "probe_features",
    "scores_from_confusion",
]
