"""``vitattn probe`` end to end on tiny models (in-process), a study checkpoint, and its data errors."""

from __future__ import annotations

import json

import pytest

from vitattn.cli import main

TINY = [
    "--model-arg", "img_size=32", "--model-arg", "patch_size=4", "--model-arg", "embed_dim=32",
    "--model-arg", "depth=2", "--model-arg", "num_heads=2", "--model-arg", "num_classes=0",
]  # fmt: skip
SMALL = ["--limit-train", "64", "--limit-test", "32", "--epochs", "2", "--no-progress"]


pytestmark = pytest.mark.usefixtures("one_thread")


def test_probe_scenes_end_to_end(tmp_path, capsys) -> None:
    pytest.importorskip("vitattn.datasets.scenes")
    out = tmp_path / "out"
    argv = ["probe", "vit_tiny_patch16_224", *TINY, "--dataset", "scenes", "--layers", "0,-1", *SMALL]
    rc = main([*argv, "--out", str(out), "--json", str(tmp_path / "copy.json")])
    assert rc == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "probe.json").read_text())
    assert set(data) >= {"model", "source", "dataset", "layers", "results", "normalization", "grid_size"}
    assert data["layers"] == [0, 1] and data["dataset"]["num_classes"] == 11
    assert set(data["results"]) == {"linear", "knn"}
    assert data["train_images"] == 64 and data["test_images"] == 32
    assert data["results"]["linear"]["options"]["epochs"] == 2
    for method, res in data["results"].items():
        assert [p["layer"] for p in res["per_layer"]] == [0, 1]
        assert 0 <= res["miou"] <= 1 and res["per_layer"][0]["alignment"] is not None
        assert f"| {method} | 1 | {100 * res['miou']:.2f} |" in printed
    assert data["normalization"]["mean"] == pytest.approx([0.5, 0.5, 0.5])  # vit_tiny's pretrained_cfg
    assert (out / "pca.png").stat().st_size > 0
    assert json.loads((tmp_path / "copy.json").read_text()) == data


def test_probe_a_study_checkpoint(tmp_path) -> None:
    """A fake `vitattn study` output: the model is rebuilt from its config and run record, and the
    study dataset's normalization is used even on another probe dataset."""
    pytest.importorskip("vitattn.datasets.scenes")
    from vitattn.study.checkpoint import save_model
    from vitattn.study.config import StudyConfig
    from vitattn.study.dataset_specs import DATASETS
    from vitattn.study.model import build_model

    config = StudyConfig(dataset="cifar10", depth=2, dim=32, heads=2)
    model = build_model(config, "locat")
    run = tmp_path / "study" / "checkpoints" / "baseline-locat-s0"
    run.mkdir(parents=True)
    save_model(model, run / "model.safetensors")
    record = {"name": "baseline-locat-s0", "attention": "locat", "prr": False}
    results = {"schema_version": 1, "status": "complete", "config": config.to_dict(), "runs": [record]}
    (tmp_path / "study" / "results.json").write_text(json.dumps(results))
    for target in (tmp_path / "study", run / "model.safetensors"):
        out = tmp_path / f"out-{target.name}"
        argv = ["probe", str(target), "--method", "knn", "--limit-train", "16", "--limit-test", "8"]
        assert main([*argv, "--no-progress", "--out", str(out)]) == 0
        data = json.loads((out / "probe.json").read_text())
        assert data["source"]["run"] == "baseline-locat-s0" and data["source"]["attention"] == "locat"
        assert data["normalization"]["mean"] == pytest.approx(list(DATASETS["cifar10"].mean))
        assert data["layers"] == [1]


@pytest.mark.parametrize(
    ("dataset", "folder"), [("voc", "VOCdevkit/VOC2012"), ("ade20k", "ADEChallengeData2016")]
)
def test_probe_missing_data_exits_2(tmp_path, capsys, dataset: str, folder: str) -> None:
    rc = main(["probe", "vit_tiny_patch16_224", *TINY, "--dataset", dataset, "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("vitattn probe: ") and len(err.strip().splitlines()) == 1
    assert str(tmp_path / folder) in err
    rc = main(["probe", "vit_tiny_patch16_224", "--dataset", dataset])
    assert rc == 2 and "--data-dir" in capsys.readouterr().err


def test_probe_usage_errors_exit_2(tmp_path, capsys) -> None:
    pytest.importorskip("vitattn.datasets.scenes")
    rc = main(
        ["probe", "vit_tiny_patch16_224", *TINY, "--layers", "5", "--limit-train", "4", "--limit-test", "2"]
    )
    assert rc == 2 and "layer index 5 is out of range" in capsys.readouterr().err
    rc = main(["probe", "no_such_model_xyz", "--limit-train", "4", "--limit-test", "2"])
    assert rc == 2 and "unknown model" in capsys.readouterr().err
    rc = main(["probe", "vit_tiny_patch16_224", "--limit-train", "4", "--limit-test", "2"])
    assert rc == 2 and "--image-size 224" in capsys.readouterr().err
