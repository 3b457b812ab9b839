"""`vitattn study --dataset imagefolder`: the layout checks and their messages, timm's pipeline for
the protocols, and the issue's end-to-end run: a tiny ImageNet-layout folder trains a timm ViT patched
with LocAt (identity start) from a saved checkpoint, on one process and under torchrun (gloo, 2
ranks), interrupted and resumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from vitattn.cli import main
from vitattn.study import PROTOCOLS, make_config, validate_results
from vitattn.study.imagefolder import DataFolderError, inspect_imagefolder
from vitattn.study.model import build_model
from vitattn.study.timm_protocols import TimmData, timm_criterion, timm_mixup, timm_transforms

CLASSES = ("cat", "dog", "emu")
TIMM = "vit_tiny_patch16_224"
MODEL_ARGS = [
    "--model-arg=patch_size=4",
    "--model-arg=embed_dim=32",
    "--model-arg=depth=2",
    "--model-arg=num_heads=2",
]


def make_folder(root: Path, train: int = 4, val: int = 2, size: int = 40) -> Path:
    """``root/train/<class>/i.png`` and ``root/val/<class>/i.png``: each class a colour plus noise."""
    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", train), ("val", val)):
        for c, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = torch.randint(0, 60, (size, size, 3), generator=gen, dtype=torch.uint8)
                pixels[..., c] += 150
                Image.fromarray(pixels.numpy()).save(root / split / name / f"{i}.png")
    return root


def test_a_good_folder_is_summarised(tmp_path):
    summary = inspect_imagefolder(make_folder(tmp_path / "d"), check_images=True)
    assert summary.classes == list(CLASSES) and summary.counts == {"train": 12, "val": 6}


@pytest.mark.parametrize(
    "breaks, message",
    [
        (lambda d: os.rename(d / "val", d / "valid"), r"'.*/d/val' is missing; expected .*/<class>/<image>"),
        (lambda d: (d / "train" / "fox").mkdir(), r"\(s\) \['fox'\] in '.*/d/train' but not in '.*/d/val'"),
        (lambda d: (d / "val" / "owl").mkdir(), r"\['owl'\] in '.*/d/val' but not in '.*/d/train'"),
        (lambda d: [p.unlink() for p in (d / "val" / "dog").iterdir()], r"'.*/d/val/dog' holds no image"),
        (lambda d: (d / "train" / "dog" / "2.png").write_bytes(b"not a png"),
         r"image 6 of '.*/d/train' \('.*/d/train/dog/2.png'\) cannot be read"),
    ],
)  # fmt: skip
def test_bad_folders_are_named_before_training(tmp_path, breaks, message, capsys):
    root = make_folder(tmp_path / "d")
    breaks(root)
    with pytest.raises(DataFolderError, match=message):
        inspect_imagefolder(root, check_images=True)
    code = main(["study", "--dataset", "imagefolder", "--data-dir", str(root), "--out", str(tmp_path / "o")])
    assert code == 2 and "vitattn study: " in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing was trained or written


def test_an_unreadable_image_found_while_loading_is_named(tmp_path):
    root = make_folder(tmp_path / "d")
    inspect_imagefolder(root, check_images=False)  # a large folder: only the layout is checked first
    (root / "val" / "emu" / "1.png").write_bytes(b"\x89PNG broken")
    from vitattn.study.imagefolder import CheckedImageFolder

    with pytest.raises(DataFolderError, match=r"image 5 of '.*/d/val' \('.*/emu/1.png'\) cannot be read"):
        CheckedImageFolder(str(root / "val"))[5]


def test_protocols_map_onto_timms_pipeline():
    data = TimmData(32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    image = Image.new("RGB", (48, 40), (200, 10, 10))
    base_train, base_test = timm_transforms(
        data, PROTOCOLS["baseline"], hflip=True, auto_augment="rand-m9-mstd0.5-inc1"
    )
    names = [type(t).__name__ for t in base_train.transforms]
    assert names[0] == "RandomResizedCropAndInterpolation" and "RandomHorizontalFlip" in names
    assert not any("RandAugment" in n or "ColorJitter" in n or "RandomErasing" in n for n in names)
    aa_train, _ = timm_transforms(data, PROTOCOLS["aa"], hflip=False, auto_augment="rand-m9-mstd0.5-inc1")
    aa_names = [type(t).__name__ for t in aa_train.transforms]
    assert "RandAugment" in aa_names and "RandomHorizontalFlip" not in aa_names
    assert base_train(image).shape == base_test(image).shape == (3, 32, 32)
    assert timm_mixup(PROTOCOLS["aa+ls"], 3, 1.0, 0.0, 0.1) is None
    mix = timm_mixup(PROTOCOLS["modern"], 3, 1.0, 0.0, 0.1)
    x, y = mix(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0]))
    assert y.shape == (4, 3) and torch.allclose(y.sum(-1), torch.ones(4))
    assert y.min() >= 0.1 / 3 - 1e-6  # smoothed soft targets
    assert timm_criterion(PROTOCOLS["modern"], 0.1).label_smoothing == 0.0  # smoothing is in the targets
    assert timm_criterion(PROTOCOLS["ls"], 0.1).label_smoothing == 0.1


def _checkpoint(tmp_path: Path) -> Path:
    """A softmax timm ViT's weights (3 classes): the fine-tuning start."""
    torch.manual_seed(5)
    config = make_config("quick", model=TIMM, model_args={"patch_size": 4, "embed_dim": 32, "depth": 2,
                         "num_heads": 2}, img_size=32, dataset="imagefolder", num_classes=3)  # fmt: skip
    model = build_model(config, "softmax")
    path = tmp_path / "start.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def _args(root: Path, checkpoint: Path, out: Path) -> list[str]:
    return [
        "study", "--dataset", "imagefolder", "--data-dir", str(root), "--img-size", "32", "--model", TIMM,
        *MODEL_ARGS, "--checkpoint", str(checkpoint), "--attention", "locat", "--protocol", "modern",
        "--epochs", "2", "--batch-size", "4", "--workers", "0", "--amp", "none", "--no-progress",
        "--analysis-images", "4", "--out", str(out),
    ]  # fmt: skip


def test_imagefolder_finetuning_resumes_on_one_process(tmp_path, capsys):
    root = make_folder(tmp_path / "d")
    args = _args(root, _checkpoint(tmp_path), tmp_path / "out")
    assert main([*args, "--stop-after-epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 classes, 12 training and 6 validation images" in out and "GAug start identity" in out
    assert main(args) == 0
    assert "resumed from epoch 1" in capsys.readouterr().out
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    validate_results(data)
    run = data["runs"][0]
    assert data["config"]["num_classes"] == 3 and data["config"]["gaug_init"] == "identity"
    assert run["resumed_from_epoch"] == 1 and run["grid_size"] == [8, 8] and run["probe"] is None
    assert [h["epoch"] for h in run["history"]] == [1, 2]
    for h in run["history"]:
        assert h["train_images_per_s"] > 0 and h["eval_images_per_s"] > 0 and h["peak_memory_mb"] > 0
    assert run["throughput"]["memory"] == "cpu_rss"
    header = (tmp_path / "out" / "results.csv").read_text().splitlines()[0]
    assert (
        header.endswith("train_images_per_s,eval_images_per_s,peak_memory_mb") or "peak_memory_mb" in header
    )


@pytest.mark.slow
def test_imagefolder_finetuning_under_torchrun_with_resume(tmp_path):
    """The issue's 'done when': two gloo ranks, a timm ViT patched with LocAt from a checkpoint
    (identity start), interrupted after epoch 1 and resumed by the same command."""
    root = make_folder(tmp_path / "d")
    out = tmp_path / "ddp"
    args = _args(root, _checkpoint(tmp_path), out)[1:]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    base = [*torchrun, "-m", "vitattn", "study", *args, "--device", "cpu"]
    first = subprocess.run(
        [*base, "--stop-after-epochs", "1"], capture_output=True, text=True, env=env, timeout=600
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stopped after epoch 1" in first.stdout
    state = json.loads((out / "checkpoints/modern-locat-s0/state.json").read_text())
    assert state["epoch"] == 1 and state["world_size"] == 2
    second = subprocess.run(base, capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from epoch 1" in second.stdout and "DDP over 2 ranks" in second.stdout
    data = json.loads((out / "results.json").read_text())
    validate_results(data)
    run = data["runs"][0]
    assert data["status"] == "complete" and run["world_size"] == 2 and run["resumed_from_epoch"] == 1
    assert run["history"][0] == state["history"][0] and len(run["history"]) == 2
    assert run["history"][1]["train_images_per_s"] > 0


@pytest.mark.slow
def test_pretrained_timm_backbone_under_torchrun(tmp_path):
    """--pretrained (timm's loader, here from a local file as from the Hub cache) on two gloo ranks:
    rank 0 loads first, both start from the same weights."""
    import timm

    root = make_folder(tmp_path / "d", train=2, val=1)
    torch.manual_seed(0)
    source = timm.create_model(TIMM, patch_size=4, embed_dim=32, depth=2, num_heads=2, img_size=32)
    weights = tmp_path / "pretrained.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(weights))
    out = tmp_path / "pre"
    args = ["study", "--dataset", "imagefolder", "--data-dir", str(root), "--img-size", "32", "--model", TIMM]
    args += [*MODEL_ARGS, f"--model-arg=pretrained_cfg_overlay={{'file': '{weights}'}}", "--pretrained"]
    args += [
        "--attention",
        "entmax15",
        "--epochs",
        "1",
        "--batch-size",
        "2",
        "--amp",
        "none",
        "--no-progress",
    ]
    args += ["--analysis-images", "2", "--device", "cpu", "--out", str(out)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*torchrun, "-m", "vitattn", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "timm's pretrained weights" in proc.stdout and "DDP over 2 ranks" in proc.stdout
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["world_size"] == 2 and run["attention"] == "entmax15"
