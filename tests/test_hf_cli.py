"""``vitattn probe|analyze hf:<folder>``: transformers models on the command line, offline (in-process)."""

from __future__ import annotations

import json

import pytest

from vitattn.cli import main

from .hf_tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = ["--limit-train", "32", "--limit-test", "16", "--epochs", "2", "--no-progress"]


@pytest.fixture
def saved_dinov2(tmp_path):
    """A tiny DINOv2 with 2 registers, LocAt-patched, saved with an image processor config."""
    import vitattn

    folder = tmp_path / "dinov2"
    model = vitattn.patch(tiny_model("dinov2_reg"), "locat", gaug_init="identity")
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]})
    )
    return folder


def test_probe_prints_its_table(saved_dinov2, tmp_path, capsys) -> None:
    pytest.importorskip("vitattn.datasets.scenes")
    out = tmp_path / "out"
    argv = ["probe", f"hf:{saved_dinov2}", "--dataset", "scenes", "--image-size", "32", "--layers", "0,-1"]
    assert main([*argv, *SMALL, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "probe.json").read_text())
    assert data["source"]["kind"] == "hf" and data["source"]["family"] == "DINOv2 with registers"
    assert data["normalization"]["std"] == pytest.approx([0.229, 0.224, 0.225])
    assert data["grid_size"] == [4, 4] and data["layers"] == [0, 1]
    for method, res in data["results"].items():
        assert f"| {method} | 1 | {100 * res['miou']:.2f} |" in printed
        assert res["per_layer"][0]["alignment"] is not None  # a class token


def test_analyze_writes_its_report(saved_dinov2, tmp_path, capsys) -> None:
    out = tmp_path / "analysis"
    argv = ["analyze", f"hf:{saved_dinov2}", "--max-images", "8", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["grid_size"] == [4, 4] and report["num_prefix_tokens"] == 3
    assert (out / "attention_maps.png").stat().st_size > 0
    assert "Locality report" in capsys.readouterr().out


def test_missing_models_fail_at_once(tmp_path, capsys) -> None:
    assert main(["probe", "hf:nobody/no-such-model", "--out", str(tmp_path)]) == 2
    assert "no copy of the model 'nobody/no-such-model'" in capsys.readouterr().err
    assert main(["analyze", f"hf:{tmp_path / 'none'}", "--out", str(tmp_path)]) == 2
    assert "vitattn analyze:" in capsys.readouterr().err
    assert main(["probe", "hf:x", "--checkpoint", "w.safetensors", "--out", str(tmp_path)]) == 2
    assert "not to hf: models" in capsys.readouterr().err


def test_an_image_size_that_drops_pixels_is_refused(tmp_path, capsys) -> None:
    """A transformers ViT interpolates its position embedding to any size, but its conv patch embedding
    drops the pixels past the last whole patch: 40 px with 16-px patches is refused, nothing written."""
    pytest.importorskip("vitattn.datasets.scenes")
    folder = tmp_path / "vit16"
    tiny_model("vit", patch_size=16).save_pretrained(folder)
    capsys.readouterr()  # transformers' saving progress
    out = tmp_path / "out"
    argv = ["probe", f"hf:{folder}", "--image-size", "40", *SMALL, "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--image-size 40 is not a multiple of the patch size 16" in err
    assert not out.exists()


def test_gradient_rollout_of_an_hf_model_is_refused_before_anything_is_written(
    saved_dinov2, tmp_path, capsys
):
    out = tmp_path / "analysis"
    argv = ["analyze", f"hf:{saved_dinov2}", "--rollout", "--gradient-rollout", "--out", str(out)]
    assert main([*argv, "--max-images", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gradient-rollout needs a timm or vitattn ViT" in err
    assert not out.exists()  # it used to write report.json and three plots first
