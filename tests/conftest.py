"""Shared test settings: deterministic seeds and a hypothesis profile sized for 2 CPU cores."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "vitattn",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "vitattn"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
