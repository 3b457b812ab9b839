"""One run of the study: train the ViT under a protocol, test it, measure its attention locality."""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, Subset

from ..analysis import LocalityReport, locality_report
from ..datasets.sized import dataset_length
from .checkpoint import load_state, save_model, save_state
from .config import StudyConfig
from .datasets import load_datasets, probe_datasets
from .distributed import DistEnv, all_reduce_sum, barrier
from .model import build_model
from .protocols import Protocol, build_criterion, build_cutmix, build_test_transform, build_train_transform

__all__ = ["RunResult", "RunSpec", "WarmupCosine", "dense_probe_record", "evaluate", "train_run"]


@dataclass(frozen=True)
class RunSpec:
    """One cell of the study: protocol × attention × seed. ``name`` names its checkpoint folder."""

    protocol: Protocol
    attention: str
    seed: int
    prr: bool = False

    @property
    def name(self) -> str:
        return f"{self.protocol.name}-{self.attention}{'-prr' if self.prr else ''}-s{self.seed}"


@dataclass
class RunResult:
    """What a finished run reports (see :func:`vitattn.study.results.run_record`)."""

    spec: RunSpec
    test_acc: float
    report: LocalityReport | None  # None on ranks other than 0
    history: list[dict[str, Any]]
    seconds: float
    resumed_from_epoch: int
    checkpoint: Path
    world_size: int = 1
    probe: dict[str, Any] | None = None


class WarmupCosine:
    """LR factor per optimizer step: linear warmup from 0 over ``warmup`` steps, then cosine to 0
    at ``total`` steps. A plain object, so ``LambdaLR.state_dict()`` stores its fields as JSON."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup = int(warmup)
        self.total = max(int(total), 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 - seeds the global state for third-party code
    torch.manual_seed(seed)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight matrices decay; biases, norms, position embedding and class token do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        matrix = p.ndim > 1 and "pos_embed" not in name and "token" not in name
        (decay if matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _subset(dataset: Dataset, limit: int | None) -> Dataset:
    n = dataset_length(dataset)
    return dataset if limit is None or limit >= n else Subset(dataset, range(limit))


def _loader(dataset: Dataset, config: StudyConfig, env: DistEnv, seed: int, epoch: int) -> DataLoader:
    """Training batches for ``epoch``: the order depends only on (seed, epoch), so a resumed run
    sees the batches it would have seen."""
    if not isinstance(dataset, Sized):  # RandomSampler and drop_last read its length
        raise TypeError(f"the training set must have __len__, got {type(dataset).__name__}")
    per_rank = config.global_batch_size // env.world_size
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    sampler: Sampler[int]
    if env.distributed:
        shards: DistributedSampler[int] = DistributedSampler(
            dataset, env.world_size, env.rank, shuffle=True, seed=seed
        )
        shards.set_epoch(epoch)
        sampler = shards
    else:
        sampler = RandomSampler(dataset, generator=generator)
    return DataLoader(
        dataset,
        batch_size=per_rank,
        sampler=sampler,
        num_workers=config.workers,
        drop_last=len(dataset) >= config.global_batch_size,
        generator=generator,
        pin_memory=env.device.type == "cuda",
    )


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, env: DistEnv, batch_size: int = 256) -> float:
    """Top-1 accuracy in [0, 1] over the whole ``dataset`` (each rank takes every world_size-th image)."""
    shard = Subset(dataset, range(env.rank, dataset_length(dataset), env.world_size))
    loader = DataLoader(shard, batch_size=batch_size, shuffle=False)
    correct, total = 0, 0
    was_training = model.training
    model.eval()
    for x, y in loader:
        x, y = x.to(env.device), y.to(env.device)
        correct += int((model(x).argmax(-1) == y).sum())
        total += int(y.numel())
    model.train(was_training)
    correct_all, total_all = all_reduce_sum(env, [correct, total])
    return correct_all / max(total_all, 1)


def _analysis_batches(
    dataset: Dataset, n: int, batch_size: int = 64
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n`` test images, unaugmented, as ``(B, C, H, W)`` batches."""
    loader = DataLoader(Subset(dataset, range(min(n, dataset_length(dataset)))), batch_size=batch_size)
    return list(loader)


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr when it is a terminal; none in a log file (the per-epoch lines stay)."""
    from tqdm.auto import tqdm

    live = enabled and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="batch", leave=False, disable=not live, file=sys.stderr)


def dense_probe_record(model: nn.Module, config: StudyConfig, device: torch.device) -> dict[str, Any] | None:
    """Linear and k-NN segmentation probes of the frozen ``model`` on the dataset's scenes.

    Returns ``{"linear_miou", "knn_miou", "linear_pixel_acc", "knn_pixel_acc", "alignment",
    "layer"}`` (mIoU and accuracy in [0, 1], ``layer`` the non-negative block index), or None when
    the dataset has no masks or ``config.probe`` is off.
    """
    sets = probe_datasets(config.dataset) if config.probe else None
    if sets is None:
        return None
    from torchvision.transforms import v2

    from ..probe import extract_dense_features, probe_features

    train, test = sets
    train = _subset(train, config.probe_train_images)
    test = _subset(test, config.limit_test)
    spec = config.spec
    normalize = v2.Normalize(list(spec.mean), list(spec.std))
    features = {
        name: extract_dense_features(
            model,
            data,
            layers=(config.probe_layer,),
            num_classes=data_set.num_seg_classes,
            ignore_index=data_set.ignore_index,
            transform=normalize,
            device=device,
            progress=False,
        )
        for name, data, data_set in (("train", train, sets[0]), ("test", test, sets[1]))
    }
    method_options: dict[str, dict[str, Any]] = {
        "linear": {"epochs": config.probe_epochs},
        "knn": {"bank_size": config.probe_bank_size},
    }
    linear, knn = (
        probe_features(
            features["train"], features["test"], method=method, device=device, progress=False, **options
        )
        for method, options in method_options.items()
    )
    layer = linear.layers[-1]
    return {
        "linear_miou": float(linear.miou),
        "knn_miou": float(knn.miou),
        "linear_pixel_acc": float(linear.pixel_acc),
        "knn_pixel_acc": float(knn.pixel_acc),
        "alignment": linear.per_layer[layer].alignment,
        "layer": int(layer),
    }


@dataclass
class _Training:
    """The state one run trains: model (and its DDP wrapper), optimizer, schedule, loss, history."""

    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    cutmix: Any
    criterion: nn.Module
    first_epoch: int
    history: list[dict[str, Any]]


def _run_datasets(config: StudyConfig, spec: RunSpec) -> tuple[Dataset, Dataset]:
    """The run's ``(train, test)`` sets: the protocol's train transform, the plain test one, limits."""
    ds = config.spec
    train_set, test_set = load_datasets(
        config.dataset,
        build_train_transform(spec.protocol, ds, hflip=bool(config.hflip)),
        build_test_transform(ds),
        config.data_dir,
        config.download,
    )
    return _subset(train_set, config.limit_train), _subset(test_set, config.limit_test)


def _setup_training(
    config: StudyConfig,
    spec: RunSpec,
    folder: Path,
    env: DistEnv,
    train_set: Dataset,
    log: Callable[[str], object],
) -> _Training:
    """Seeded model, AdamW, warmup-cosine schedule and loss; restored from ``folder`` when it holds
    an unfinished run's state (the order of the seeded draws is part of the resume contract)."""
    if config.global_batch_size % env.world_size:
        raise ValueError(
            f"batch_size {config.global_batch_size} is not divisible by the {env.world_size} ranks"
        )
    _seed_everything(spec.seed)  # same initial weights on every rank
    model = build_model(config, spec.attention).to(env.device)
    optimizer = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr)
    steps_per_epoch = len(_loader(train_set, config, env, spec.seed, 0))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        WarmupCosine(round(config.warmup_epochs * steps_per_epoch), config.epochs * steps_per_epoch),
    )
    _seed_everything(spec.seed * 1000 + 7 + env.rank)  # augmentation streams differ per rank
    state = load_state(folder, env, model, optimizer, scheduler)
    first_epoch = state["epoch"] if state else 0
    if state:
        log(f"  {spec.name}: resumed from epoch {first_epoch} (checkpoint in {folder})")
    net: nn.Module = model
    if env.distributed:
        net = DistributedDataParallel(
            model, device_ids=[env.device.index] if env.device.type == "cuda" else None
        )
    return _Training(
        model=model,
        net=net,
        optimizer=optimizer,
        scheduler=scheduler,
        cutmix=build_cutmix(spec.protocol, config.spec.num_classes, config.cutmix_alpha),
        criterion=build_criterion(spec.protocol, config.label_smoothing),
        first_epoch=first_epoch,
        history=list(state["history"]) if state else [],
    )


def _train_epoch(
    tr: _Training, train_set: Dataset, config: StudyConfig, spec: RunSpec, env: DistEnv, epoch: int
) -> dict[str, Any]:
    """One epoch over ``train_set``; the history entry ``{epoch, train_loss, lr, seconds}``."""
    t0 = time.perf_counter()
    tr.net.train()
    loader = _loader(train_set, config, env, spec.seed, epoch)
    loss_sum, count = 0.0, 0
    bar = _progress(
        len(loader), f"{spec.name} epoch {epoch + 1}/{config.epochs}", config.progress and env.is_main
    )
    for x, y in loader:
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        if tr.cutmix is not None:
            x, y = tr.cutmix(x, y)
        loss = tr.criterion(tr.net(x), y)
        tr.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        tr.optimizer.step()
        tr.scheduler.step()
        loss_sum += float(loss.detach()) * x.shape[0]
        count += x.shape[0]
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    bar.close()
    loss_all, count_all = all_reduce_sum(env, [loss_sum, count])
    return dict(
        epoch=epoch + 1,
        train_loss=loss_all / max(count_all, 1),
        lr=float(tr.scheduler.get_last_lr()[0]),
        seconds=round(time.perf_counter() - t0, 2),
    )


def train_run(
    config: StudyConfig,
    spec: RunSpec,
    folder: Path,
    env: DistEnv,
    *,
    stop_after_epochs: int | None = None,
    log: Callable[[str], object] = print,
) -> RunResult | None:
    """Train one run to ``config.epochs``, resuming from ``folder``'s state when it holds one.

    Checkpoints the full training state after every epoch (see :mod:`.checkpoint`). Returns None
    when ``stop_after_epochs`` stopped it early (an interruption on purpose, for tests); else the
    test accuracy, the locality report of the first ``analysis_images`` test images, the dense
    probe, the per-epoch history, and ``model.safetensors`` written in ``folder``.
    """
    start = time.perf_counter()
    train_set, test_set = _run_datasets(config, spec)
    tr = _setup_training(config, spec, folder, env, train_set, log)
    for epoch in range(tr.first_epoch, config.epochs):
        entry = _train_epoch(tr, train_set, config, spec, env, epoch)
        tr.history.append(entry)
        log(
            f"  {spec.name}: epoch {epoch + 1}/{config.epochs}  train loss {entry['train_loss']:.4f}  "
            f"({entry['seconds']:.1f} s)"
        )
        save_state(folder, env, epoch + 1, tr.model, tr.optimizer, tr.scheduler, tr.history)
        if stop_after_epochs is not None and epoch + 1 >= stop_after_epochs and epoch + 1 < config.epochs:
            barrier(env)
            return None
    return _finish_run(tr, config, spec, folder, env, test_set, time.perf_counter() - start)


def _finish_run(
    tr: _Training,
    config: StudyConfig,
    spec: RunSpec,
    folder: Path,
    env: DistEnv,
    test_set: Dataset,
    elapsed: float,
) -> RunResult:
    """Test accuracy (every rank), then on rank 0 the locality report, the dense probe and the
    weights; the :class:`RunResult` (``report`` and ``probe`` None on other ranks)."""
    t0 = time.perf_counter()
    test_acc = evaluate(tr.model, test_set, env)
    report, probe = None, None
    if env.is_main:
        batches = _analysis_batches(test_set, config.analysis_images)
        report = locality_report(tr.model, batches, progress=False, name=spec.name)
        probe = dense_probe_record(tr.model, config, env.device)
        save_model(tr.model, folder / "model.safetensors")
    barrier(env)
    return RunResult(
        spec=spec,
        test_acc=test_acc,
        report=report,
        history=tr.history,
        seconds=round(elapsed + time.perf_counter() - t0, 2),
        resumed_from_epoch=tr.first_epoch,
        checkpoint=folder / "model.safetensors",
        world_size=env.world_size,
        probe=probe,
    )
