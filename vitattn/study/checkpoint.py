"""Resumable training state without pickles: tensors in safetensors, everything else in JSON.

A run's folder holds ``state.json`` (epoch, optimizer hyper-parameters, scheduler, the fp16 loss
scaler, RNG of Python and NumPy, history) and the ``state-eNNNN.safetensors`` it names (model
weights ``model.*``, optimizer tensors ``optim.<param>.<key>``, each rank's torch RNG
``rng.torch.<rank>``, NumPy's MT19937 keys).
``state.json`` is replaced last and atomically, so a crash mid-write leaves the previous epoch's
state readable. The finished model is ``model.safetensors`` (weights only).

The scheduler is anything with ``state_dict`` / ``load_state_dict`` (the trainer's is timm's
``CosineLRScheduler``, which keeps no step count: the trainer sets the lr from the epoch). A state
written before the trainer used timm's scheduler holds a ``LambdaLR`` state; loaded into a timm
scheduler it is skipped (the optimizer, the loss scaler and the rest load as ever).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from .distributed import DistEnv

__all__ = ["STATE_FORMAT", "TrainState", "load_state", "save_model", "save_state"]

STATE_FORMAT = "vitattn.study.state/1"


class Stateful(Protocol):
    """A scheduler or loss scaler: its state is a JSON-ready dict."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class TrainState(dict):
    """What :func:`load_state` restored: ``epoch`` (completed epochs) and ``history``."""


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _rng_tensors(env: DistEnv) -> dict[str, torch.Tensor]:
    """Every rank's torch CPU RNG state (``(5056,)`` uint8 each), gathered on all ranks."""
    state = torch.get_rng_state()
    if not env.distributed:
        return {"rng.torch.0": state}
    local = state.to(env.device)
    gathered = [torch.empty_like(local) for _ in range(env.world_size)]
    dist.all_gather(gathered, local)
    return {f"rng.torch.{r}": t.cpu() for r, t in enumerate(gathered)}


def save_model(model: nn.Module, path: Path) -> None:
    """Weights of ``model`` (its ``state_dict``, on CPU) as a safetensors file."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def save_state(
    folder: Path,
    env: DistEnv,
    epoch: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Stateful,
    history: list[dict[str, Any]],
    scaler: Stateful | None = None,
) -> None:
    """Write the training state after ``epoch`` completed epochs (collective: call on every rank;
    rank 0 writes)."""
    rng = _rng_tensors(env)
    if not env.is_main:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in opt["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    tensors.update(rng)
    # the legacy global state third-party code may use
    np_state = np.random.get_state(legacy=True)  # noqa: NPY002
    if not isinstance(np_state, tuple):  # legacy=True gives a tuple for numpy's MT19937 global state
        raise TypeError(f"numpy's global random state is {type(np_state).__name__}, expected MT19937's tuple")
    tensors["rng.numpy.keys"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    name = f"state-e{epoch:04d}.safetensors"
    save_file(tensors, str(folder / (name + ".tmp")))
    os.replace(folder / (name + ".tmp"), folder / name)
    meta = {
        "format": STATE_FORMAT,
        "epoch": epoch,
        "tensors": name,
        "world_size": env.world_size,
        "optimizer": {"param_groups": opt["param_groups"], "state_scalars": scalars},
        "scheduler": scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "rng": {
            "python": list(random.getstate()[1]),
            "python_version": random.getstate()[0],
            "numpy": {"pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        },
        "history": history,
    }
    _write_json(folder / "state.json", meta)
    for old in folder.glob("state-e*.safetensors"):
        if old.name != name:
            old.unlink()


def load_state(
    folder: Path,
    env: DistEnv,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Stateful,
    scaler: Stateful | None = None,
) -> TrainState | None:
    """Restore what :func:`save_state` wrote into ``model``, ``optimizer``, ``scheduler``, the fp16
    loss ``scaler`` (when both have one) and the RNGs.

    Returns None when ``folder`` holds no state. The torch RNG of each rank is restored when the
    world size matches; otherwise each rank reseeds from rank 0's state and its rank.
    """
    meta_path = folder / "state.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{str(meta_path)!r} is not a vitattn study state ({meta.get('format')!r})")
    tensors = load_file(str(folder / meta["tensors"]), device="cpu")
    model_sd = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    model.load_state_dict(model_sd, strict=True)
    opt_state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            opt_state.setdefault(int(idx), {})[name] = value
    for idx, entry in meta["optimizer"]["state_scalars"].items():
        opt_state.setdefault(int(idx), {}).update(entry)
    optimizer.load_state_dict({"state": opt_state, "param_groups": meta["optimizer"]["param_groups"]})
    if "lr_lambdas" not in meta["scheduler"] or isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        scheduler.load_state_dict(meta["scheduler"])
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    rng = meta["rng"]
    random.setstate((rng["python_version"], tuple(rng["python"]), None))
    keys = tensors["rng.numpy.keys"].numpy().astype(np.uint32)
    np_state = ("MT19937", keys, rng["numpy"]["pos"], rng["numpy"]["has_gauss"], rng["numpy"]["cached"])
    np.random.set_state(np_state)  # noqa: NPY002
    own = tensors.get(f"rng.torch.{env.rank}")
    if own is not None and meta.get("world_size", 1) == env.world_size:
        torch.set_rng_state(own)
    else:
        torch.set_rng_state(tensors["rng.torch.0"])
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,)).item()) + env.rank)
    return TrainState(epoch=int(meta["epoch"]), history=list(meta.get("history", [])))
