"""Study configuration: presets, the model of the study, and what identifies a run for resuming."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from .datasets import DATASETS, DatasetSpec
from .protocols import PROTOCOLS, Protocol, resolve_protocols

__all__ = ["ATTENTIONS", "PRESETS", "RUNTIME_KEYS", "StudyConfig", "config_diff", "make_config"]

# softmax, entmax-1.5, LocAt (GAug), adaptive (alpha-entmax, one learnable alpha per head from 1.5) and
# window (softmax inside a STUDY_WINDOW x STUDY_WINDOW neighbourhood, see vitattn.study.model)
ATTENTIONS = ("softmax", "entmax15", "locat", "adaptive", "window")

# what each preset sets; everything else comes from StudyConfig's defaults. ``quick`` is the main
# job: a narrower, shallower ViT on the scenes, trained long enough to learn, comparing attentions
# under the baseline protocol in about 3 minutes on 2 CPU cores. ``paper`` is the study's own model
# (depth 8, dim 192, 8 heads) and 200-epoch schedule under the baseline and modern protocols.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(
        epochs=5,
        warmup_epochs=0.5,
        protocols=["baseline"],
        attentions=["softmax", "entmax15", "locat"],
        depth=2,
        dim=64,
        heads=4,
        lr=1e-3,
        init="mimetic",
        pos_embed_std=1.0,
        probe_bank_size=8192,
        probe_epochs=10,
    ),
    "paper": dict(epochs=200, warmup_epochs=10.0, protocols=["baseline", "modern"]),
}

# keys that do not change what is computed (where data lives, how it is shown, how many loader
# workers or threads): they may differ between an interrupted run and its resumption
RUNTIME_KEYS = ("data_dir", "download", "workers", "threads", "progress", "device", "compile", "check_images")


@dataclass
class StudyConfig:
    """Everything a study run depends on. Stored as ``results.json["config"]``.

    The model is the study's compact ViT: ``depth`` 8, ``dim`` 192, ``heads`` 8, MLP ratio 2
    (about 2.4 M parameters), dropout 0, a class token, on the dataset's 8×8 patch grid.
    ``batch_size`` and ``pos_embed_std`` (the std of the position embedding at init) default to
    the dataset's (:class:`DatasetSpec`): 64 and timm's 0.02 on scenes, 32 and 1.0 on digits, 128
    and 0.02 elsewhere; so does ``hflip``, the baseline's horizontal flip (off on scenes and
    digits, on elsewhere). The ``quick`` preset overrides the model (see :data:`PRESETS`).
    ``first_layers`` blocks from the input make up the "first layers" whose smallest head MAD
    the summary reports (default: the first quarter of the blocks, at least 1: 2 of 8).
    """

    dataset: str = "scenes"
    preset: str = "quick"
    scenes_version: int = 3  # DigitScenes' generator version (2: the digit anywhere; 3: near the centre)
    # backbone: None = the study's own ViT (below); else any timm name (vitattn's locatvit_* too)
    model: str | None = None
    model_args: dict[str, Any] = field(default_factory=dict)
    pretrained: bool = False  # timm's pretrained weights (Hub cache) for ``model``
    checkpoint: str | None = (
        None  # a starting point: safetensors / weights-only state dict; {seed} = the run's seed
    )
    gaug_init: str | None = None  # "identity" / "paper"; None: identity when starting from weights
    img_size: int | None = None  # None: the dataset's (built-in sets), 224 for imagefolder
    num_classes: int | None = None  # None: the dataset's (imagefolder: its class folders, found at the start)
    drop_path: float = 0.0
    layer_decay: float | None = None  # layer-wise lr decay (timm's param_groups_layer_decay)
    gaug_lr_scale: float = 1.0  # learning rate of LocAt's GAug heads (parameters under ".gaug.") x this
    amp: str | None = None  # bf16 / fp16 / none; None: bf16 on CUDA, none on the CPU
    protocols: list[str] = field(default_factory=lambda: ["baseline", "modern"])
    attentions: list[str] = field(default_factory=lambda: ["softmax"])
    prr: bool = False
    seeds: list[int] = field(default_factory=lambda: [0])
    # model
    depth: int = 8
    dim: int = 192
    heads: int = 8
    mlp_ratio: float = 2.0
    # initialisation of the study's ViT: "timm" or "mimetic" (see vitattn.study.init), and the std
    # of its position embedding at init
    init: str = "timm"
    pos_embed_std: float | None = None
    # schedule: AdamW, linear warmup then cosine to 0, stepped per batch
    epochs: int = 3
    batch_size: int | None = None
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 0.5
    # protocol components
    hflip: bool | None = None
    cutmix_alpha: float = 1.0
    label_smoothing: float = 0.1
    # imagefolder (timm's pipeline): the protocol's AutoAugment is this timm policy; MixUp alpha
    # (0: CutMix alone) when the protocol has CutMix
    auto_augment: str = "rand-m9-mstd0.5-inc1"
    mixup_alpha: float = 0.0
    # analysis
    first_layers: int | None = None
    analysis_images: int = 256
    # dense probe of every run on datasets with masks (scenes): a linear and a k-NN segmentation
    # probe of the frozen features of block ``probe_layer``, fitted on the first
    # ``probe_train_images`` training scenes (the k-NN memory bank: at most ``probe_bank_size`` of
    # their patches), scored on the test scenes
    probe: bool = True
    probe_layer: int = -1
    probe_train_images: int = 1000
    probe_epochs: int = 20
    probe_bank_size: int = 32768
    # data subsets (smoke tests): first N images of the split, None = all
    limit_train: int | None = None
    limit_test: int | None = None
    # runtime (see RUNTIME_KEYS)
    data_dir: str = "data"
    download: bool = False
    workers: int = 0
    threads: int | None = None
    progress: bool = True
    device: str | None = None
    compile: bool = False  # torch.compile the training model
    check_images: bool | None = None  # imagefolder: open every image first (None: when <= 50000)

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; known: {', '.join(DATASETS)}")
        self.protocols = [p.name for p in resolve_protocols(self.protocols)]
        bad = [a for a in self.attentions if a not in ATTENTIONS]
        if bad or not self.attentions:
            raise ValueError(f"attention must be among {', '.join(ATTENTIONS)}, got {self.attentions}")
        self.attentions = list(dict.fromkeys(self.attentions))
        if not self.seeds:
            raise ValueError("give at least one seed")
        self.seeds = [int(s) for s in dict.fromkeys(self.seeds)]
        spec = DATASETS[self.dataset]
        if self.batch_size is None:
            self.batch_size = spec.batch_size
        if self.pos_embed_std is None:
            self.pos_embed_std = spec.pos_embed_std
        if self.hflip is None:
            self.hflip = spec.hflip
        if self.num_classes is None and spec.num_classes:
            self.num_classes = spec.num_classes
        if self.num_classes is not None and spec.num_classes and self.num_classes != spec.num_classes:
            raise ValueError(
                f"{self.dataset} has {spec.num_classes} classes, not num_classes={self.num_classes}"
            )
        self._check_backbone()
        if self.first_layers is None:
            self.first_layers = max(1, self.model_depth // 4)
        if not -self.model_depth <= int(self.probe_layer) < self.model_depth:
            raise ValueError(f"probe_layer {self.probe_layer} is out of range for depth {self.model_depth}")
        numbered = ("depth", "dim", "heads", "epochs", "batch_size", "first_layers", "analysis_images")
        for name in (*numbered, "probe_train_images", "probe_epochs", "probe_bank_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.first_layers > self.model_depth:
            raise ValueError(f"first_layers ({self.first_layers}) exceeds depth ({self.model_depth})")
        if self.warmup_epochs < 0 or self.lr <= 0 or self.weight_decay < 0:
            raise ValueError("warmup_epochs and weight_decay must be >= 0 and lr > 0")
        for name in ("limit_train", "limit_test"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None")

    def _check_backbone(self) -> None:
        """Resolve and check the backbone options (``gaug_init``, ``init``, ``amp``, ...)."""
        from ..datasets.scenes import VERSIONS
        from .amp import AMP_CHOICES
        from .init import INIT_SCHEMES

        if self.scenes_version not in VERSIONS:
            raise ValueError(f"scenes_version must be one of {VERSIONS}, got {self.scenes_version!r}")
        if self.pretrained and self.checkpoint is not None:
            raise ValueError("give --pretrained or --checkpoint, not both")
        if self.pretrained and self.model is None:
            raise ValueError("--pretrained needs --model NAME (a timm model with pretrained weights)")
        if self.gaug_init is None:
            self.gaug_init = "identity" if self.from_weights else "paper"
        if self.gaug_init not in ("identity", "paper"):
            raise ValueError(f"gaug_init must be 'identity' or 'paper', got {self.gaug_init!r}")
        if self.init not in INIT_SCHEMES:
            raise ValueError(f"init must be one of {', '.join(INIT_SCHEMES)}, got {self.init!r}")
        if self.amp is not None and self.amp not in AMP_CHOICES:
            raise ValueError(f"amp must be one of {', '.join(AMP_CHOICES)}, got {self.amp!r}")
        if self.img_size is not None and self.img_size < 1:
            raise ValueError(f"img_size must be >= 1, got {self.img_size}")
        if self.model is None and self.input_size % self.spec.grid_size[0]:
            raise ValueError(
                f"img_size {self.input_size} is not divisible by the study ViT's {self.spec.grid_size[0]}x"
                f"{self.spec.grid_size[1]} patch grid"
            )
        if not 0.0 <= self.drop_path < 1.0:
            raise ValueError(f"drop_path must be in [0, 1), got {self.drop_path}")
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            raise ValueError(f"layer_decay must be in (0, 1], got {self.layer_decay}")
        if not self.gaug_lr_scale > 0.0:
            raise ValueError(f"gaug_lr_scale must be > 0, got {self.gaug_lr_scale}")
        if self.mixup_alpha < 0 or self.cutmix_alpha < 0:
            raise ValueError("mixup_alpha and cutmix_alpha must be >= 0")
        if self.model is not None and self._model_depth is None:
            self._model_depth = _timm_depth(self.model, self.model_args)

    _model_depth: int | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def model_depth(self) -> int:
        """Blocks of the backbone: ``depth`` for the study's ViT, the timm model's otherwise."""
        return int(self.depth) if self.model is None or self._model_depth is None else self._model_depth

    @property
    def from_weights(self) -> bool:
        """The run starts from weights (``pretrained`` or a ``checkpoint``), not from scratch."""
        return bool(self.pretrained) or self.checkpoint is not None

    def checkpoint_path(self, seed: int) -> str:
        """``checkpoint`` with ``{seed}`` replaced by ``seed``."""
        if self.checkpoint is None:
            raise ValueError("no checkpoint was given")
        return self.checkpoint.replace("{seed}", str(seed))

    @property
    def input_size(self) -> int:
        """Side of the model's input images: ``img_size``, else the dataset's."""
        return int(self.img_size) if self.img_size is not None else self.spec.img_size

    @property
    def classes(self) -> int:
        """Classes of the head (``num_classes``; an imagefolder study must have found them first)."""
        if not self.num_classes:
            raise ValueError(f"the number of classes of {self.dataset} is not known yet")
        return int(self.num_classes)

    @property
    def spec(self) -> DatasetSpec:
        return DATASETS[self.dataset]

    @property
    def protocol_list(self) -> list[Protocol]:
        return [PROTOCOLS[name] for name in self.protocols]

    @property
    def global_batch_size(self) -> int:
        """``batch_size`` over all ranks, the dataset's default when unset (``__post_init__`` fills it)."""
        return self.spec.batch_size if self.batch_size is None else int(self.batch_size)

    @property
    def first_layer_indices(self) -> list[int]:
        return list(range(int(self.first_layers or 1)))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict, plus the derived ``input_size``, ``patch_size``, ``grid_size`` etc.
        (the study ViT's; a timm backbone's own patch grid is in each run's locality report)."""
        d = asdict(self)
        d.pop("_model_depth", None)
        spec = self.spec
        grid = spec.grid_size
        d.update(
            input_size=self.input_size,
            patch_size=self.input_size // grid[0],
            grid_size=list(grid),
            in_chans=spec.channels,
            autoaugment_op=spec.color_augment,
            model_depth=self.model_depth,
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StudyConfig:
        """Inverse of :meth:`to_dict` (derived keys ignored). A config written before
        ``scenes_version`` existed used version 2 of the scenes."""
        names = {f.name for f in fields(cls) if f.init}
        values = {k: v for k, v in d.items() if k in names}
        values.setdefault("scenes_version", 2)
        return cls(**values)

    def identity(self) -> dict[str, Any]:
        """The keys that decide what a run computes (all but :data:`RUNTIME_KEYS`)."""
        return {k: v for k, v in asdict(self).items() if k not in RUNTIME_KEYS and not k.startswith("_")}

    def digest(self) -> str:
        """8 hex digits of a hash of :meth:`identity` (names the default output folder)."""
        text = json.dumps(self.identity(), sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:8]

    def with_runtime(self, **kwargs: Any) -> StudyConfig:
        """A copy with runtime keys replaced (only :data:`RUNTIME_KEYS` may change)."""
        bad = set(kwargs) - set(RUNTIME_KEYS)
        if bad:
            raise ValueError(f"only runtime keys may change on resume, not {sorted(bad)}")
        return replace(self, **kwargs)


def _timm_depth(name: str, model_args: dict[str, Any]) -> int:
    """Blocks of timm model ``name`` (built on the meta device: no memory, no weights)."""
    import timm
    import torch

    from .. import models as _models  # noqa: F401  (registers locatvit_* with timm)

    if not timm.is_model(name):
        raise ValueError(f"unknown model {name!r}: give a timm model name (see timm.list_models())")
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **model_args)
    blocks = getattr(model, "blocks", None)
    if blocks is not None:
        return len(blocks)
    layers = getattr(model, "layers", None)  # Swin: blocks stage by stage
    if layers is not None:
        return sum(len(stage.blocks) for stage in layers)
    raise ValueError(f"{name!r} has neither blocks nor layers[i].blocks: not a ViT, Eva or Swin")


def make_config(preset: str = "quick", **overrides: Any) -> StudyConfig:
    """A :class:`StudyConfig` from a preset (``quick`` or ``paper``) and explicit overrides.

    ``overrides`` with value None are ignored (so argparse defaults of None keep the preset's).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    values: dict[str, Any] = dict(PRESETS[preset])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return StudyConfig(preset=preset, **values)


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every identity key that differs between two config dicts."""
    keys = [k for k in sorted(set(old) | set(new)) if k not in RUNTIME_KEYS]
    names = {f.name for f in fields(StudyConfig)}
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if k in names and old.get(k) != new.get(k)]
