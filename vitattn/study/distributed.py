"""torchrun support: detect the launch, set up the process group, small collective helpers.

Launched plainly, everything here is a no-op (world size 1, rank 0). Under ``torchrun`` the
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` variables select DistributedDataParallel with NCCL on
GPUs or gloo on CPUs; only rank 0 writes files and prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from timm.utils.distributed import init_distributed_device_so, world_info_from_env

__all__ = [
    "DistEnv",
    "all_reduce_max",
    "all_reduce_sum",
    "barrier",
    "broadcast_flag",
    "init_distributed",
    "shutdown_distributed",
]


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job: ``rank`` of ``world_size``, its device, and whether DDP is on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _launched_by_torchrun() -> bool:
    return (
        all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        and int(os.environ["WORLD_SIZE"]) > 1
    )


def init_distributed(device: str | None = None) -> DistEnv:
    """Read the launch environment and, under torchrun, start the process group (timm's
    ``init_distributed_device_so``: NCCL for CUDA, each rank on ``cuda:LOCAL_RANK``; gloo on CPUs).

    ``device``: ``"cpu"``, ``"cuda"`` or None (CUDA when available). A process group the caller
    has started already is used as it is.
    """
    want = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not _launched_by_torchrun():
        return DistEnv(device=torch.device(want))
    if not dist.is_initialized():
        info = init_distributed_device_so(device=want)
        return DistEnv(
            info["global_rank"], info["world_size"], info["local_rank"], torch.device(info["device"])
        )
    local, rank, world = world_info_from_env()
    dev = torch.device("cuda", local) if want.startswith("cuda") else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return DistEnv(rank=rank, world_size=world, local_rank=local, device=dev)


def shutdown_distributed(env: DistEnv) -> None:
    """Destroy the process group if this module's :func:`init_distributed` made one."""
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    """Wait for every rank (no-op in a single process)."""
    if env.distributed:
        dist.barrier()


def all_reduce_sum(env: DistEnv, values: list[float]) -> list[float]:
    """Sum a few numbers over the ranks (float64 on the rank's device)."""
    if not env.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(env: DistEnv, values: list[float]) -> list[float]:
    """The largest of a few numbers over the ranks (float64 on the rank's device)."""
    if not env.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def broadcast_flag(env: DistEnv, flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank."""
    if not env.distributed:
        return flag
    t = torch.tensor([int(flag)], device=env.device)
    dist.broadcast(t, 0)
    return bool(t.item())
