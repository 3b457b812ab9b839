"""Study configuration: presets, the model of the study, and what identifies a run for resuming."""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..datasets.scenes import VERSIONS as SCENES_VERSIONS
from ..layers.kinds import STUDY_ATTENTIONS
from .amp import AMP_CHOICES
from .dataset_specs import DATASETS, DatasetSpec
from .flags import no_option, option
from .init import INIT_SCHEMES
from .protocols import PROTOCOLS, Protocol, resolve_protocols

__all__ = [
    "ATTENTIONS",
    "GAUG_INITS",
    "PRESETS",
    "RUNTIME_KEYS",
    "STUDY_WINDOW",
    "ConfigError",
    "StudyConfig",
    "config_diff",
    "make_config",
]

# softmax, entmax-1.5, LocAt (GAug), adaptive (alpha-entmax, one learnable alpha per head from 1.5) and
# window (softmax inside a window x window neighbourhood, STUDY_WINDOW by default: vitattn.study.model)
ATTENTIONS = STUDY_ATTENTIONS

# the default neighbourhood of the "window" attention on the study's 8x8 patch grid: uniform attention
# over 5x5 patches has about the mean attention distance (1.9 patches) of LocAt's most local block-0 heads
STUDY_WINDOW = 5

# how LocAt's new GAug heads start when a backbone is patched (vitattn.patch's gaug_init)
GAUG_INITS = ("identity", "paper")

# the titles the command line lists some options under (vitattn study --help)
BACKBONE = "backbone and fine-tuning"
SPEED = "precision and speed"
IMAGEFOLDER = "imagefolder (timm's data pipeline)"

# what a config written before a field existed meant by its absence (from_dict and config_diff)
_LEGACY = {"scenes_version": 2}


class ConfigError(ValueError):
    """An input of a study that is out of range or inconsistent: a :class:`StudyConfig` field, or an
    argument of :func:`~vitattn.study.run_study`.

    ``fields`` are the names the message uses for them (field names, e.g. ``epochs``);
    :meth:`render` names them otherwise, e.g. the command line by its options (``--epochs``).
    """

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def render(self, name: Callable[[str], str]) -> str:
        """The message with the first mention of each field ``f`` replaced by ``name(f)``."""
        text = self.message
        for f in self.fields:
            match = re.search(rf"(?<![\w.-]){re.escape(f)}(?![\w-])", text)
            if match is not None:
                text = text[: match.start()] + name(f) + text[match.end() :]
        return text


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

    dataset: str = option(
        "scenes",
        choices=tuple(DATASETS),
        help="scenes (default: procedural digit scenes with masks, nothing to download; runs get a "
        "dense probe), digits (scikit-learn's 8x8 digits), cifar10, cifar100, tinyimagenet, imagefolder "
        "(--data-dir DIR with DIR/train/<class>/* and DIR/val/<class>/*, timm's data pipeline)",
    )
    preset: str = option(
        "quick",
        choices=sorted(PRESETS),
        help="quick (default: the main job, a small ViT for 5 epochs, softmax vs entmax15 vs locat under "
        "the baseline, about 2-3 minutes on 2 CPU cores) or paper (the study's model and 200-epoch "
        "schedule, baseline and modern)",
    )
    # DigitScenes' generator version (2: the digit anywhere; 3: near the centre)
    scenes_version: int = option(
        3,
        choices=SCENES_VERSIONS,
        help="DigitScenes generator: 3 (default: the main digit near the centre), 2 (anywhere: earlier runs)",
    )
    # backbone: None = the study's own ViT (below); else any timm name (vitattn's locatvit_* too)
    model: str | None = option(
        None,
        metavar="NAME",
        group=BACKBONE,
        help="a timm model (ViT, Eva, Swin, vitattn's locatvit_*) instead of the study's own ViT; "
        "--attention entmax15 / locat and --prr patch it with vitattn.patch (softmax keeps its attention)",
    )
    model_args: dict[str, Any] = option(
        factory=dict,
        name="--model-arg",
        kind="pairs",
        metavar="KEY=VALUE",
        group=BACKBONE,
        help="extra timm.create_model argument (repeatable), e.g. depth=6 or "
        "pretrained_cfg_overlay=\"{'file': 'weights.safetensors'}\" for --pretrained from a local file",
    )
    pretrained: bool = option(
        False,
        kind="on",
        group=BACKBONE,
        exclusive="start",
        help="start from timm's pretrained weights of --model (Hub cache)",
    )
    # a starting point: safetensors / weights-only state dict; {seed} = the run's seed
    checkpoint: str | None = option(
        None,
        metavar="PATH",
        group=BACKBONE,
        exclusive="start",
        help="start from these weights (safetensors or a weights-only state dict of the model; {seed} in "
        "PATH is the run's seed); a head of another size is re-initialised",
    )
    # None: identity when starting from weights, else paper
    gaug_init: str | None = option(
        None,
        choices=GAUG_INITS,
        group=BACKBONE,
        help="how LocAt's new GAug heads start on a backbone with weights: identity (default from weights: "
        "the model keeps its function) or paper (LocAtViT's init, the default from scratch)",
    )
    img_size: int | None = option(  # None: the dataset's (built-in sets), 224 for imagefolder
        None, metavar="PX", group=BACKBONE, help="input size (default: the dataset's; 224 for imagefolder)"
    )
    num_classes: int | None = no_option(
        None
    )  # None: the dataset's (imagefolder: its class folders, found at the start)
    drop_path: float = option(0.0, metavar="P", group=BACKBONE, help="stochastic depth rate (default 0)")
    layer_decay: float | None = option(  # layer-wise lr decay (timm's param_groups_layer_decay)
        None,
        metavar="D",
        group=BACKBONE,
        help="layer-wise lr decay for fine-tuning (timm's param_groups_layer_decay, e.g. 0.65)",
    )
    gaug_lr_scale: float = option(  # learning rate of LocAt's GAug heads (parameters under ".gaug.") x this
        1.0,
        metavar="F",
        group=BACKBONE,
        help="learning rate of LocAt's GAug heads times F (default 1; with --gaug-init identity their "
        "per-head gate starts at 0 and AdamW moves it by about lr per step: F sets how fast GAug may move)",
    )
    amp: str | None = option(  # None: bf16 on CUDA, none on the CPU
        None,
        choices=AMP_CHOICES,
        group=SPEED,
        help="mixed precision: bf16 (default on CUDA: the Triton kernels run), fp16 (with a grad scaler), "
        "none (default on the CPU)",
    )
    protocols: list[str] = option(
        factory=lambda: ["baseline", "modern"],
        name="--protocol",
        kind="list",
        metavar="NAME",
        exclusive="protocols",
        help=f"protocols to run (default: the preset's baseline modern); known: {' '.join(PROTOCOLS)}",
    )
    attentions: list[str] = option(
        factory=lambda: ["softmax"],
        name="--attention",
        kind="list",
        choices=ATTENTIONS,
        metavar="KIND",
        help="softmax, entmax15, locat, adaptive (alpha-entmax, one learnable alpha per head) and/or "
        f"window ({STUDY_WINDOW}x{STUDY_WINDOW} neighbourhood softmax, --window) (default: the preset's; "
        "quick: the first three); several give one run each",
    )
    prr: bool = option(False, kind="on", help="add PRR before the head")
    seeds: list[int] = option(
        factory=lambda: [0], kind="count", start="first_seed", metavar="N", help="number of seeds (default 1)"
    )
    # the "window" attention's neighbourhood: window x window patches (None: STUDY_WINDOW), every
    # window_dilation-th patch (None: 1, contiguous)
    window: int | None = option(
        None,
        metavar="K",
        help="--attention window: each patch attends to the K x K patches around it (default "
        f"{STUDY_WINDOW}; a window as large as the patch grid is plain softmax attention, which the "
        "study notes)",
    )
    window_dilation: int | None = option(
        None, metavar="D", help="--attention window: the window takes every D-th patch (default 1)"
    )
    # model
    depth: int = option(8, help="blocks (default 8; quick: 2)")
    dim: int = option(192, help="embedding width (default 192; quick: 64)")
    heads: int = option(8, help="attention heads (default 8; quick: 4)")
    mlp_ratio: float = no_option(2.0)
    # initialisation of the study's ViT: "timm" or "mimetic" (see vitattn.study.init), and the std
    # of its position embedding at init
    init: str = option(
        "timm",
        choices=INIT_SCHEMES,
        group=BACKBONE,
        help="initialisation of the study's ViT: timm or mimetic (attention; default: the preset's)",
    )
    pos_embed_std: float | None = option(
        None, help="std of the position embedding at init (quick and digits 1.0, else timm's 0.02)"
    )
    # schedule: AdamW, linear warmup then cosine to 0, stepped per batch
    epochs: int = option(3, metavar="N", help="override the preset's epochs")
    batch_size: int | None = option(
        None, metavar="N", help="global batch size (default 64 on scenes, 32 on digits, else 128)"
    )
    lr: float = option(1e-3, help="AdamW peak learning rate (default 1e-3)")
    weight_decay: float = option(0.05, help="AdamW weight decay (default 0.05)")
    warmup_epochs: float = option(0.5, help="linear warmup before the cosine decay")
    # protocol components
    hflip: bool | None = option(
        None,
        kind="switch",
        negative="--no-hflip",
        negative_help="no horizontal flip",
        help="random horizontal flip (default: on, off on digits)",
    )
    cutmix_alpha: float = option(
        1.0, name="--cutmix", metavar="ALPHA", group=IMAGEFOLDER, help="CutMix alpha (default 1.0)"
    )
    label_smoothing: float = option(
        0.1,
        name="--smoothing",
        metavar="EPS",
        group=IMAGEFOLDER,
        help="label smoothing of the protocols with LS (default 0.1)",
    )
    # imagefolder (timm's pipeline): the protocol's AutoAugment is this timm policy; MixUp alpha
    # (0: CutMix alone) when the protocol has CutMix
    auto_augment: str = option(
        "rand-m9-mstd0.5-inc1",
        metavar="POLICY",
        group=IMAGEFOLDER,
        help="timm policy of the protocol's AA (default rand-m9-mstd0.5-inc1; original: AutoAugment)",
    )
    mixup_alpha: float = option(
        0.0,
        name="--mixup",
        metavar="ALPHA",
        group=IMAGEFOLDER,
        help="MixUp alpha next to CutMix (default 0: CutMix alone)",
    )
    # analysis
    first_layers: int | None = option(
        None,
        metavar="K",
        help="the first K blocks whose minimum head MAD is reported (default depth // 4, i.e. 2 of 8)",
    )
    analysis_images: int = option(256, metavar="N", help="test images for MAD / entropy (default 256)")
    # dense probe of every run on datasets with masks (scenes): a linear and a k-NN segmentation
    # probe of the frozen features of block ``probe_layer``, fitted on the first
    # ``probe_train_images`` training scenes (the k-NN memory bank: at most ``probe_bank_size`` of
    # their patches), scored on the test scenes
    probe: bool = option(
        True, name="--no-probe", kind="off", help="skip the dense probe of each run (scenes)"
    )
    probe_layer: int = option(-1, metavar="I", help="block whose features are probed (default -1, the last)")
    probe_train_images: int = option(
        1000, metavar="N", help="training scenes the probes are fitted on (default 1000)"
    )
    probe_epochs: int = option(20, metavar="N", help="epochs of the linear probe (quick: 10, else 20)")
    probe_bank_size: int = option(
        32768, metavar="N", help="k-NN probe memory bank, patches (quick: 8192, else 32768)"
    )
    # data subsets (smoke tests): first N images of the split, None = all
    limit_train: int | None = option(None, metavar="N", help="use the first N training images (smoke tests)")
    limit_test: int | None = option(None, metavar="N", help="use the first N test images (smoke tests)")
    # runtime: what does not change what a run computes (RUNTIME_KEYS)
    data_dir: str = option(
        "data",
        runtime=True,
        metavar="DIR",
        help="where CIFAR / Tiny-ImageNet live, or the image folder (default data)",
    )
    download: bool = option(False, runtime=True, kind="on", help="download CIFAR into --data-dir if missing")
    workers: int = option(
        0, runtime=True, metavar="N", help="data-loader workers (default 0 for digits, else 2)"
    )
    threads: int | None = option(
        None, runtime=True, metavar="N", help="torch CPU threads (default: torch's choice)"
    )
    progress: bool = option(True, runtime=True, name="--no-progress", kind="off", help="no progress bars")
    device: str | None = option(None, runtime=True, help="cpu or cuda (default: cuda when available)")
    compile: bool = option(  # torch.compile the training model
        False, runtime=True, kind="on", group=SPEED, help="torch.compile the training model"
    )
    check_images: bool | None = option(  # imagefolder: open every image first (None: when <= 50000)
        None,
        runtime=True,
        kind="switch",
        negative="--no-check-images",
        group=IMAGEFOLDER,
        help="open every image before training (default: when there are at most 50000)",
    )

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}; known: {', '.join(DATASETS)}", "dataset")
        try:
            self.protocols = [p.name for p in resolve_protocols(self.protocols)]
        except ValueError as err:
            raise ConfigError(f"protocols: {err}", "protocols") from err
        bad = [a for a in self.attentions if a not in ATTENTIONS]
        if bad or not self.attentions:
            raise ConfigError(
                f"attentions must be among {', '.join(ATTENTIONS)}, got {self.attentions}", "attentions"
            )
        self.attentions = list(dict.fromkeys(self.attentions))
        if not self.seeds or not all(_is_int(s) for s in self.seeds):
            raise ConfigError(f"seeds must be a non-empty list of ints, got {self.seeds!r}", "seeds")
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
            raise ConfigError(
                f"{self.dataset} has {spec.num_classes} classes, not num_classes={self.num_classes}",
                "num_classes",
            )
        self._check_numbers()
        self._check_backbone()
        if self.first_layers is None:
            self.first_layers = max(1, self.model_depth // 4)
        _at_least(self, 1, "first_layers")
        if not -self.model_depth <= int(self.probe_layer) < self.model_depth:
            raise ConfigError(
                f"probe_layer {self.probe_layer} is out of range for depth {self.model_depth}", "probe_layer"
            )
        if self.first_layers > self.model_depth:
            raise ConfigError(
                f"first_layers ({self.first_layers}) exceeds depth ({self.model_depth})", "first_layers"
            )

    def _check_numbers(self) -> None:
        """Counts, rates and ranges (the model's shape, the schedule, the protocol, the probes, data
        subsets and runtime), each refused with its field's name and value."""
        counts = ("depth", "dim", "heads", "epochs", "batch_size", "analysis_images")
        _at_least(self, 1, *counts, "probe_train_images", "probe_epochs", "probe_bank_size")
        _at_least(self, 1, "limit_train", "limit_test", "threads", "window", "window_dilation", optional=True)
        _at_least(self, 0, "workers")
        if not _is_int(self.probe_layer):
            raise ConfigError(f"probe_layer must be an int, got {self.probe_layer!r}", "probe_layer")
        if self.dim % self.heads:
            raise ConfigError(f"dim ({self.dim}) must be divisible by heads ({self.heads})", "dim", "heads")
        _in_range(self, "lr", 0.0, math.inf, low_open=True)
        _in_range(self, "mlp_ratio", 0.0, math.inf, low_open=True)
        _in_range(self, "gaug_lr_scale", 0.0, math.inf, low_open=True)
        for name in ("weight_decay", "warmup_epochs", "mixup_alpha", "cutmix_alpha"):
            _in_range(self, name, 0.0, math.inf)
        _in_range(self, "label_smoothing", 0.0, 1.0, high_open=True)
        _in_range(self, "drop_path", 0.0, 1.0, high_open=True)
        if self.layer_decay is not None:
            _in_range(self, "layer_decay", 0.0, 1.0, low_open=True)
        if self.pos_embed_std is not None:
            _in_range(self, "pos_embed_std", 0.0, math.inf)
        if (self.window is not None or self.window_dilation is not None) and "window" not in self.attentions:
            raise ConfigError(
                f"window and window_dilation are for the 'window' attention, which attentions "
                f"{self.attentions} does not hold",
                "window",
                "window_dilation",
                "attentions",
            )
        if self.device is not None:
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise ConfigError(
                    f"device {self.device!r} is not a torch device (e.g. cpu, cuda, cuda:1)", "device"
                ) from None

    def _check_backbone(self) -> None:
        """Resolve and check the backbone options (``gaug_init``, ``init``, ``amp``, the input size
        against the patches, ...)."""
        if self.scenes_version not in SCENES_VERSIONS:
            raise ConfigError(
                f"scenes_version must be one of {SCENES_VERSIONS}, got {self.scenes_version!r}",
                "scenes_version",
            )
        if self.pretrained and self.checkpoint is not None:
            raise ConfigError("give --pretrained or --checkpoint, not both")
        if self.pretrained and self.model is None:
            raise ConfigError("--pretrained needs --model NAME (a timm model with pretrained weights)")
        if self.checkpoint is not None and not str(self.checkpoint).strip():
            raise ConfigError("checkpoint must be a file path, got an empty string", "checkpoint")
        if self.gaug_init is None:
            self.gaug_init = "identity" if self.from_weights else "paper"
        if self.gaug_init not in GAUG_INITS:
            raise ConfigError(f"gaug_init must be 'identity' or 'paper', got {self.gaug_init!r}", "gaug_init")
        if self.init not in INIT_SCHEMES:
            raise ConfigError(f"init must be one of {', '.join(INIT_SCHEMES)}, got {self.init!r}", "init")
        if self.amp is not None and self.amp not in AMP_CHOICES:
            raise ConfigError(f"amp must be one of {', '.join(AMP_CHOICES)}, got {self.amp!r}", "amp")
        _at_least(self, 1, "img_size", optional=True)
        if self.model is None and self.input_size % self.spec.grid_size[0]:
            raise ConfigError(
                f"img_size {self.input_size} is not divisible by the study ViT's {self.spec.grid_size[0]}x"
                f"{self.spec.grid_size[1]} patch grid",
                "img_size",
            )
        if self.model is not None and self._model_depth is None:
            self._model_depth = self._check_timm_backbone()

    def _check_timm_backbone(self) -> int:
        """Build the timm backbone on the meta device (no memory, no weights) as a run will; check that
        the input size is a multiple of its patch size; its number of blocks."""
        import torch

        from ..probe.features import check_image_size
        from .backbone import create_timm_model

        assert self.model is not None
        with torch.device("meta"):
            try:
                model = create_timm_model(
                    self.model,
                    num_classes=self.num_classes or 1,
                    img_size=self.input_size,
                    in_chans=self.spec.channels,
                    drop_path=float(self.drop_path),
                    pretrained=False,
                    model_args=self.model_args,
                )
            except ValueError as err:  # an unknown name, or arguments its builder does not take
                raise ConfigError(str(err), "model") from err
            except (RuntimeError, AssertionError, KeyError) as err:  # timm refuses the size or arguments
                raise ConfigError(
                    f"timm cannot build model {self.model!r} at img_size {self.input_size} with model_args "
                    f"{self.model_args}: {err}",
                    "model",
                    "img_size",
                    "model_args",
                ) from err
        try:
            check_image_size(model, self.input_size, "img_size")
        except ValueError as err:
            raise ConfigError(f"{err} (model {self.model})", "img_size") from err
        blocks = getattr(model, "blocks", None)
        if blocks is not None:
            return len(blocks)
        layers = getattr(model, "layers", None)  # Swin: blocks stage by stage
        if layers is not None:
            return sum(len(stage.blocks) for stage in layers)
        raise ConfigError(
            f"model {self.model!r} has neither blocks nor layers[i].blocks: not a ViT, Eva or Swin", "model"
        )

    _model_depth: int | None = field(
        default=None, init=False, repr=False, compare=False, metadata={"flag": None}
    )

    @property
    def model_depth(self) -> int:
        """Blocks of the backbone: ``depth`` for the study's ViT, the timm model's otherwise."""
        return int(self.depth) if self.model is None or self._model_depth is None else self._model_depth

    @property
    def window_size(self) -> int:
        """Side of the ``window`` attention's neighbourhood, in patches (:data:`STUDY_WINDOW` by default)."""
        return STUDY_WINDOW if self.window is None else int(self.window)

    @property
    def dilation(self) -> int:
        """Dilation of the ``window`` attention's neighbourhood (1: contiguous patches)."""
        return 1 if self.window_dilation is None else int(self.window_dilation)

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
        for key, value in _LEGACY.items():
            values.setdefault(key, value)
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


# keys that do not change what is computed (where data lives, how it is shown, how many loader
# workers or threads): they may differ between an interrupted run and its resumption
RUNTIME_KEYS = tuple(f.name for f in fields(StudyConfig) if f.metadata.get("runtime"))


def _is_int(value: Any) -> bool:
    """An integer (Python's or NumPy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _at_least(config: StudyConfig, low: int, *names: str, optional: bool = False) -> None:
    """Refuse a field that is not an int ``>= low`` (None passes when ``optional``)."""
    for name in names:
        value = getattr(config, name)
        if value is None and optional:
            continue
        if not _is_int(value) or value < low:
            raise ConfigError(f"{name} must be an int >= {low}, got {value!r}", name)


def _in_range(
    config: StudyConfig, name: str, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> None:
    """Refuse a field that is not a number in the interval (NaN never is)."""
    value = getattr(config, name)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        if math.isinf(high):
            interval = f"{'>' if low_open else '>='} {low:g}"
        else:
            interval = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be {interval}, got {value!r}", name)


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
    defaults = {f.name: f.default for f in fields(StudyConfig) if f.init}
    defaults.update(_LEGACY)

    def value(d: dict[str, Any], k: str) -> Any:  # a key a config was written without: its meaning then
        return d[k] if k in d else defaults.get(k)

    return [
        f"{k}: {value(old, k)!r} -> {value(new, k)!r}"
        for k in keys
        if k in defaults and value(old, k) != value(new, k)
    ]
