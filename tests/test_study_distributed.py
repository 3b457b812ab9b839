"""The study's launch detection on one process (torchrun itself: tests/test_study.py and
tests/test_study_imagefolder.py, slow tier)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vitattn.study.distributed import DistEnv, init_distributed


def test_a_plain_launch_is_one_process(monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")  # not torchrun: still one process (timm would start DDP)
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert init_distributed("cpu") == DistEnv(device=torch.device("cpu"))
    assert not dist.is_initialized()


def test_a_process_group_started_by_the_caller_is_used(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = init_distributed("cpu")  # starting a second group would raise
    finally:
        dist.destroy_process_group()
    assert env == DistEnv(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
