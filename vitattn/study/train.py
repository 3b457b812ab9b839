"""One run of the study: train the ViT under a protocol, test it, measure its attention locality."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from timm.scheduler import CosineLRScheduler
from timm.utils import NativeScaler
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, Subset

from ..adapter import layout_of
from ..analysis import LocalityReport, locality_report
from ..datasets.sized import dataset_length
from .amp import AmpMode, autocast, grad_scaler, resolve_amp
from .builtin_datasets import probe_datasets
from .checkpoint import load_state, save_model, save_state
from .config import StudyConfig
from .distributed import DistEnv, all_reduce_max, all_reduce_sum, barrier
from .memory import memory_kind, peak_memory_mb, reset_peak_memory
from .model import build_model
from .optim import build_optimizer
from .protocols import Protocol
from .run_data import RunData, probe_transform, run_data, subset

__all__ = [
    "Evaluation",
    "RunResult",
    "RunSpec",
    "dense_probe_record",
    "evaluate",
    "train_run",
    "warmup_cosine",
]


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
    grid_size: tuple[int, int] | None = None
    amp: str = "none"
    memory: str = "cpu_rss"  # what the history's peak_memory_mb measures (vitattn.study.memory)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> CosineLRScheduler:
    """timm's per-step cosine schedule: the lr of the optimizer step numbered ``t`` (from 1; set by
    ``step_update(t)``) rises linearly as ``lr * t / (warmup + 1)`` for ``t <= warmup``, then falls
    along a cosine to 0 at step ``total + 1``; each group's ``lr_scale`` multiplies it."""
    return CosineLRScheduler(
        optimizer,
        t_initial=max(int(total) - int(warmup), 1),
        warmup_t=int(warmup) + 1,
        warmup_lr_init=0.0,
        warmup_prefix=True,
        t_in_epochs=False,
    )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 - seeds the global state for third-party code
    torch.manual_seed(seed)


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


@dataclass(frozen=True)
class Evaluation:
    """Top-1 ``accuracy`` in [0, 1] over a test set, and how fast: ``images_per_s`` (all ranks together)."""

    accuracy: float
    images_per_s: float
    seconds: float


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    env: DistEnv,
    batch_size: int = 256,
    amp: AmpMode = "none",
    workers: int = 0,
) -> Evaluation:
    """Top-1 accuracy over the whole ``dataset`` (each rank takes every world_size-th image), in eval
    mode under the run's autocast."""
    t0 = time.perf_counter()
    shard = Subset(dataset, range(env.rank, dataset_length(dataset), env.world_size))
    loader = DataLoader(
        shard, batch_size=batch_size, shuffle=False, num_workers=workers, pin_memory=env.device.type == "cuda"
    )
    correct, total = 0, 0
    was_training = model.training
    model.eval()
    for x, y in loader:
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        with autocast(env.device, amp):
            logits = model(x)
        correct += int((logits.argmax(-1) == y).sum())
        total += int(y.numel())
    model.train(was_training)
    seconds = time.perf_counter() - t0
    correct_all, total_all, slowest = (
        *all_reduce_sum(env, [correct, total]),
        all_reduce_max(env, [seconds])[0],
    )
    return Evaluation(correct_all / max(total_all, 1), total_all / max(slowest, 1e-9), slowest)


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
    sets = probe_datasets(config.dataset, config.scenes_version) if config.probe else None
    if sets is None:
        return None
    from ..probe import extract_dense_features, probe_features

    train, test = sets
    train = subset(train, config.probe_train_images)
    test = subset(test, config.limit_test)
    normalize = probe_transform(config)
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
    """The state one run trains: model (its DDP / compiled wrapper), optimizer, schedule, loss scaler,
    data, history."""

    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: CosineLRScheduler
    data: RunData
    amp: AmpMode
    scaler: NativeScaler | None
    first_epoch: int
    history: list[dict[str, Any]]
    compiling: bool = False  # torch.compile compiles in the next step (the run's first in this process)
    updates: int = 0  # optimizer steps taken


def _setup_training(
    config: StudyConfig,
    spec: RunSpec,
    folder: Path,
    env: DistEnv,
    data: RunData,
    log: Callable[[str], object],
) -> _Training:
    """Seeded model, AdamW (layer-wise lr decay if asked), warmup-cosine schedule, loss scaler;
    restored from ``folder`` when it holds an unfinished run's state (the order of the seeded draws
    is part of the resume contract).

    What building the model from a checkpoint did (a re-initialised head, heads kept at their start)
    is logged for a fresh run; a resumed run says it resumed instead, since its weights then come
    from its own training state."""
    if config.global_batch_size % env.world_size:
        raise ValueError(
            f"batch_size {config.global_batch_size} is not divisible by the {env.world_size} ranks"
        )
    per_rank = config.global_batch_size // env.world_size
    if data.mix is not None and per_rank % 2 and config.dataset == "imagefolder":
        raise ValueError(f"timm's Mixup needs an even batch on every rank, got {per_rank}")
    _seed_everything(spec.seed)  # same initial weights on every rank
    notes: list[str] = []
    model = _build_on_rank(config, spec, env, notes.append).to(env.device)
    optimizer = build_optimizer(model, config)
    steps_per_epoch = len(_loader(data.train, config, env, spec.seed, 0))
    scheduler = warmup_cosine(
        optimizer, round(config.warmup_epochs * steps_per_epoch), config.epochs * steps_per_epoch
    )
    amp = resolve_amp(config.amp, env.device)
    scaler = grad_scaler(env.device, amp)
    _seed_everything(spec.seed * 1000 + 7 + env.rank)  # augmentation streams differ per rank
    state = load_state(folder, env, model, optimizer, scheduler, scaler)
    first_epoch = state["epoch"] if state else 0
    scheduler.step_update(first_epoch * steps_per_epoch + 1)  # the lr of the next step
    if state:
        log(f"  {spec.name}: resumed from epoch {first_epoch} (checkpoint in {folder})")
    else:
        for line in notes:
            log(line)
    net: nn.Module = model
    if env.distributed:
        net = DistributedDataParallel(
            model, device_ids=[env.device.index] if env.device.type == "cuda" else None
        )
    if config.compile:
        net = cast(nn.Module, torch.compile(net))
    return _Training(
        model=model,
        net=net,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        amp=amp,
        scaler=scaler,
        first_epoch=first_epoch,
        history=list(state["history"]) if state else [],
        compiling=config.compile,
        updates=first_epoch * steps_per_epoch,
    )


def _build_on_rank(
    config: StudyConfig, spec: RunSpec, env: DistEnv, log: Callable[[str], object]
) -> nn.Module:
    """:func:`build_model` on this rank; rank 0 first when timm downloads pretrained weights (the
    others then read the Hub cache), and only rank 0 logs what loading a checkpoint did."""
    say = log if env.is_main else (lambda _: None)
    if config.pretrained and env.distributed and not env.is_main:
        barrier(env)
    model = build_model(
        config, spec.attention, seed=spec.seed, log=lambda line: say(f"  {spec.name}: {line}")
    )
    if config.pretrained and env.distributed and env.is_main:
        barrier(env)
    return model


def _step(tr: _Training, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One optimizer step on the batch ``(x, y)`` under the run's autocast (the fp16 loss scaled);
    the loss, detached."""
    with autocast(device, tr.amp):
        loss = tr.data.criterion(tr.net(x), y)
    tr.optimizer.zero_grad(set_to_none=True)
    if tr.scaler is None:
        loss.backward()
        tr.optimizer.step()
    else:  # DDP has all-reduced the gradients: every rank unscales and checks the same values
        tr.scaler(loss, tr.optimizer)
    tr.updates += 1
    tr.scheduler.step_update(tr.updates + 1)
    return loss.detach()


def _train_epoch(
    tr: _Training, config: StudyConfig, spec: RunSpec, env: DistEnv, epoch: int
) -> dict[str, Any]:
    """One epoch over the training set, then the test set; the history entry ``{epoch, train_loss,
    lr, seconds, train_images_per_s, test_acc, eval_images_per_s, peak_memory_mb}``, plus
    ``compile_seconds`` under ``torch.compile``.

    ``seconds`` is the whole epoch. Under ``torch.compile`` the run's first step in this process
    compiles the model: its time is ``compile_seconds`` (0 in later epochs), and ``train_images_per_s`` is the
    steady rate of the other steps (all steps when the epoch has only the one).
    """
    reset_peak_memory(env.device)
    t0 = time.perf_counter()
    tr.net.train()
    loader = _loader(tr.data.train, config, env, spec.seed, epoch)
    loss_sum, count = 0.0, 0
    warm_seconds, warm_images = 0.0, 0  # the compiling step
    bar = _progress(
        len(loader), f"{spec.name} epoch {epoch + 1}/{config.epochs}", config.progress and env.is_main
    )
    if tr.compiling:
        bar.set_postfix_str("compiling")
    for x, y in loader:
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        if tr.data.mix is not None:
            x, y = tr.data.mix(x, y)
        loss = float(_step(tr, x, y, env.device))  # float(): the step has finished (a CUDA sync)
        if tr.compiling:
            tr.compiling = False
            warm_seconds, warm_images = time.perf_counter() - t0, x.shape[0]
        loss_sum += loss * x.shape[0]
        count += x.shape[0]
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
    bar.close()
    seconds = time.perf_counter() - t0
    loss_all, count_all, warm_all = all_reduce_sum(env, [loss_sum, count, warm_images])
    train_seconds, compile_seconds = all_reduce_max(env, [seconds, warm_seconds])
    steady_images, steady_seconds = count_all, train_seconds
    if warm_all and count_all > warm_all:  # the rate of the steps after the compiling one
        steady_images, steady_seconds = count_all - warm_all, train_seconds - compile_seconds
    ev = evaluate(tr.model, tr.data.test, env, amp=tr.amp, workers=config.workers)
    peak = all_reduce_max(env, [peak_memory_mb(env.device)])[0]
    entry = dict(
        epoch=epoch + 1,
        train_loss=loss_all / max(count_all, 1),
        lr=float(max(g["lr"] for g in tr.optimizer.param_groups)),  # the next step's, the largest group's
        seconds=round(train_seconds, 2),
        train_images_per_s=round(steady_images / max(steady_seconds, 1e-9), 1),
        test_acc=ev.accuracy,
        eval_seconds=round(ev.seconds, 2),
        eval_images_per_s=round(ev.images_per_s, 1),
        peak_memory_mb=round(peak, 1),
    )
    if config.compile:
        entry["compile_seconds"] = round(compile_seconds, 2)
    return entry


def epoch_line(spec_name: str, entry: dict[str, Any], epochs: int, device: torch.device) -> str:
    """The log line of a finished epoch: loss, time, throughput, test accuracy, peak memory."""
    mem = "peak CUDA memory" if memory_kind(device) == "cuda_allocated" else "peak RSS"
    compiled = entry.get("compile_seconds") or 0.0
    compiling = f" incl. {compiled:.1f} s compiling" if compiled else ""
    return (
        f"  {spec_name}: epoch {entry['epoch']}/{epochs}  train loss {entry['train_loss']:.4f}  "
        f"({entry['seconds']:.1f} s{compiling}, {entry['train_images_per_s']:.0f} img/s)  "
        f"test acc {100 * entry['test_acc']:.1f} % ({entry['eval_images_per_s']:.0f} img/s)  "
        f"{mem} {entry['peak_memory_mb']:.0f} MiB"
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

    Tests after every epoch and checkpoints the full training state (see :mod:`.checkpoint`).
    Returns None when ``stop_after_epochs`` stopped it early (an interruption on purpose, for
    tests); else the test accuracy, the locality report of the first ``analysis_images`` test
    images, the dense probe, the per-epoch history, and ``model.safetensors`` written in ``folder``.
    """
    start = time.perf_counter()
    data = run_data(config, spec.protocol)
    tr = _setup_training(config, spec, folder, env, data, log)
    for epoch in range(tr.first_epoch, config.epochs):
        entry = _train_epoch(tr, config, spec, env, epoch)
        tr.history.append(entry)
        log(epoch_line(spec.name, entry, config.epochs, env.device))
        save_state(folder, env, epoch + 1, tr.model, tr.optimizer, tr.scheduler, tr.history, tr.scaler)
        if stop_after_epochs is not None and epoch + 1 >= stop_after_epochs and epoch + 1 < config.epochs:
            barrier(env)
            return None
    return _finish_run(tr, config, spec, folder, env, time.perf_counter() - start)


def _finish_run(
    tr: _Training, config: StudyConfig, spec: RunSpec, folder: Path, env: DistEnv, elapsed: float
) -> RunResult:
    """The last epoch's test accuracy, then on rank 0 the locality report, the dense probe and the
    weights; the :class:`RunResult` (``report`` and ``probe`` None on other ranks)."""
    t0 = time.perf_counter()
    test_acc = (
        float(tr.history[-1]["test_acc"]) if tr.history else evaluate(tr.model, tr.data.test, env).accuracy
    )
    report, probe = None, None
    if env.is_main:
        batches = _analysis_batches(tr.data.test, config.analysis_images)
        report = locality_report(tr.model, batches, progress=False, name=spec.name)  # float32
        probe = dense_probe_record(tr.model, config, env.device)
        save_model(tr.model, folder / "model.safetensors")
    barrier(env)
    grid = layout_of(tr.model).grid()
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
        grid_size=grid,
        amp=tr.amp,
        memory=memory_kind(env.device),
    )
