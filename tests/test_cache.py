"""vitattn.cache.cache_dir: one folder rule for every cache (scenes dataset, autotune picks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vitattn.cache import CACHE_ENV, cache_dir
from vitattn.datasets.scenes import default_cache_dir


def test_cache_dir_rule(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(CACHE_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "vitattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == Path(tmp_path / "home" / ".cache" / "vitattn")
    assert not (tmp_path / "home").exists()  # only read, never created here


def test_scenes_cache_is_the_shared_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert default_cache_dir() == tmp_path


def test_autotune_cache_is_in_the_shared_folder(monkeypatch, tmp_path):
    pytest.importorskip("triton", reason="the autotune cache belongs to the Triton kernels")
    from vitattn.kernels import ops  # with triton present, failing to import this is a bug

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert ops.autotune_cache_path() == tmp_path / "autotune.json"
