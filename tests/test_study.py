"""`vitattn study`: end to end on a tiny configuration, the results schema, resumption, protocols,
missing-dataset errors, and torchrun with two CPU ranks.

The tiny study: 2 blocks of width 32 with 4 heads, the first 64 training and 32 test scenes (the
default dataset; the probes fitted on 32 training scenes), batches of 32, 1–2 epochs. Resumption is
checked bit for bit against an uninterrupted run.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from vitattn.cli import main
from vitattn.study import (
    ABLATION,
    DATASETS,
    PROTOCOLS,
    StudyConfig,
    make_config,
    resolve_protocols,
    validate_results,
)
from vitattn.study.checkpoint import load_state, save_state
from vitattn.study.distributed import DistEnv
from vitattn.study.protocols import build_criterion, build_cutmix, build_train_transform
from vitattn.study.results import summary_rows, summary_table
from vitattn.study.train import warmup_cosine

TINY = [
    "--depth", "2", "--dim", "32", "--heads", "4", "--epochs", "1", "--batch-size", "32",
    "--limit-train", "64", "--limit-test", "32", "--analysis-images", "16", "--no-progress",
    "--probe-train-images", "32",
]  # fmt: skip
SOFTMAX = ("--attention", "softmax")


def study(out: Path, *extra: str) -> int:
    return main(["study", *TINY, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def quick_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The quick preset's runs (baseline x softmax, entmax15, locat) on the tiny model, through the
    CLI; (out, stdout)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("study") / "quick"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert study(out) == 0
    return out, buf.getvalue()


# --- end to end -------------------------------------------------------------------------------


def test_cli_end_to_end_writes_every_output(quick_tiny: tuple[Path, str]) -> None:
    out, stdout = quick_tiny
    data = json.loads((out / "results.json").read_text())
    assert data["status"] == "complete"
    assert [(r["protocol"], r["attention"]) for r in data["runs"]] == [
        ("baseline", "softmax"),
        ("baseline", "entmax15"),
        ("baseline", "locat"),
    ]
    for name in (
        "results.csv",
        "summary.md",
        "locality_plane.png",
        "mad_per_layer.png",
        "min_mad_vs_acc.png",
        "attention_comparison.png",
    ):
        assert (out / name).is_file(), name
    for run in data["runs"]:
        folder = out / "checkpoints" / run["name"]
        weights = load_file(str(out / run["checkpoint"]))
        assert "blocks.0.attn.qkv.weight" in weights and weights["head.weight"].shape == (10, 32)
        assert not (folder / "state.json").exists(), (
            "a finished run keeps its weights, not its training state"
        )
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 4 and csv_lines[0].startswith("name,protocol,autoaugment,cutmix,label_smoothing")
    head = csv_lines[0].split(",")
    for key in ("mean_sparsity", "linear_miou", "knn_miou", "probe_layer"):
        assert key in head, key
    assert "| protocol | AA | CM | LS |" in stdout and "min MAD (block 0)" in stdout
    assert "| sparsity | linear mIoU % | k-NN mIoU % | patch–CLS cos |" in stdout
    assert "probe (block 1) mIoU linear" in stdout
    assert (out / "summary.md").read_text().strip() == summary_table(data["runs"])


def test_counts_are_said_in_words(quick_tiny: tuple[Path, str], monkeypatch) -> None:
    """ "1 epoch", "3 runs", "block 0": the opening line, the closing note and the plot titles."""
    from vitattn.study import plots

    out, stdout = quick_tiny
    assert "1 protocol x 3 attentions x 1 seed = 3 runs of 1 epoch;" in stdout
    assert "min over the heads of block 0;" in stdout
    titles: list[str] = []
    for name in ("plot_locality_plane", "plot_mad_per_layer", "plot_min_mad_vs_accuracy"):
        monkeypatch.setattr(plots, name, lambda *a, title="", **k: titles.append(title))
    monkeypatch.setattr(plots, "plot_attention_comparison", lambda *a, **k: None)
    plots.write_plots(out, json.loads((out / "results.json").read_text()))
    assert "(scenes, 1 epoch, first seed of each)" in titles[0] and "1 epochs" not in " ".join(titles)


def test_min_mad_plot_holds_every_point_with_a_margin() -> None:
    """A run at MAD 0 or accuracy 100 % sits inside the frame, not on it (a marker there was cut in half)."""
    from vitattn.study.plots import plot_min_mad_vs_accuracy

    def run(mad: float, acc: float, cutmix: bool) -> dict:
        comps = {"autoaugment": False, "cutmix": cutmix, "label_smoothing": False}
        proto = "cm" if cutmix else "baseline"
        return {"protocol": proto, "attention": "softmax", "components": comps, "min_mad_first": mad,
                "test_acc": acc, "first_layers": [0, 1]}  # fmt: skip

    for points in ([(0.0, 1.0, True), (0.41, 0.5, False), (0.2, 0.75, True)], [(0.3, 0.9, False)]):
        fig = plot_min_mad_vs_accuracy([run(*p) for p in points])
        ax = fig.axes[0]
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        assert x0 <= 0.0  # the MAD axis shows 0
        for mad, acc, _ in points:
            assert x0 + 0.03 * (x1 - x0) <= mad <= x1 - 0.03 * (x1 - x0), (mad, ax.get_xlim())
            assert y0 + 0.03 * (y1 - y0) <= 100 * acc <= y1 - 0.03 * (y1 - y0), (acc, ax.get_ylim())


def test_results_schema(quick_tiny: tuple[Path, str]) -> None:
    out, _ = quick_tiny
    data = json.loads((out / "results.json").read_text())
    validate_results(data)
    cfg = data["config"]
    assert cfg["depth"] == 2 and cfg["dim"] == 32 and cfg["grid_size"] == [8, 8] and cfg["first_layers"] == 1
    for run in data["runs"]:
        assert set(run["components"]) == {"autoaugment", "cutmix", "label_smoothing"}
        assert run["components"] == PROTOCOLS[run["protocol"]].components()
        assert run["attention"] in ("softmax", "entmax15", "locat") and isinstance(run["seed"], int)
        assert isinstance(run["test_acc"], float) and 0.0 <= run["test_acc"] <= 1.0
        assert [layer["layer"] for layer in run["layers"]] == [0, 1]
        for layer in run["layers"]:
            assert len(layer["mad"]) == len(layer["entropy"]) == 4  # one value per head
            assert all(0.0 <= v <= 1.0 for v in layer["mad"] + layer["entropy"])
        assert run["min_mad_first"] == min(run["layers"][0]["mad"])
        assert run["mean_entropy"] == pytest.approx([sum(x["entropy"]) / 4 for x in run["layers"]])
        assert len(run["history"]) == 1 and run["world_size"] == 1
        probe = run["probe"]
        keys = {"linear_miou", "knn_miou", "linear_pixel_acc", "knn_pixel_acc", "alignment", "layer"}
        assert set(probe) == keys
        assert probe["layer"] == 1 and all(0.0 <= probe[k] <= 1.0 for k in ("linear_miou", "knn_miou"))
        assert -1.0 <= probe["alignment"] <= 1.0
        assert len(run["sparsity"]) == 2 and 0.0 <= run["mean_sparsity"] <= 1.0
    sparsity = {r["attention"]: r["mean_sparsity"] for r in data["runs"]}
    assert sparsity["softmax"] == sparsity["locat"] == 0.0  # (near-uniform tiny entmax may be dense too)


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda d: d["runs"][0]["components"].pop("cutmix"), "components"),
        (lambda d: d["runs"][0].__setitem__("test_acc", 93.5), "test_acc"),
        (lambda d: d["runs"][0]["layers"][0]["mad"].__setitem__(0, 3.2), "[0, 1]"),
        (lambda d: d["runs"][0]["layers"][1]["entropy"].pop(), "equal-length"),
        (lambda d: d["runs"][0].__setitem__("seed", "0"), "seed"),
        (lambda d: d.pop("config"), "config"),
        (lambda d: d["runs"][0]["probe"].__setitem__("knn_miou", 1.5), "knn_miou"),
        (lambda d: d["runs"][0]["probe"].__setitem__("layer", -1), "layer must be"),
        (lambda d: d["runs"][0].__setitem__("probe", [0.3]), "probe must be"),
    ],
)
def test_schema_violations_are_named(quick_tiny: tuple[Path, str], break_it, message: str) -> None:
    data = json.loads((quick_tiny[0] / "results.json").read_text())
    broken = copy.deepcopy(data)
    break_it(broken)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_results(broken)


def test_complete_study_is_reported_not_rerun(quick_tiny: tuple[Path, str], capsys) -> None:
    out, _ = quick_tiny
    before = (out / "results.json").read_text()
    assert study(out) == 0
    assert "already holds this complete study" in capsys.readouterr().out
    assert (out / "results.json").read_text() == before


def test_other_config_in_same_folder_is_refused_unless_overwritten(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s"
    assert study(out, *SOFTMAX, "--protocol", "ls") == 0
    assert study(out, *SOFTMAX, "--protocol", "ls", "--epochs", "3") == 2
    err = capsys.readouterr().err
    assert "another configuration" in err and "epochs: 1 -> 3" in err and "--overwrite" in err
    assert study(out, *SOFTMAX, "--protocol", "cm", "--overwrite") == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["protocol"] for r in data["runs"]] == ["cm"] and not (
        out / "checkpoints/ls-softmax-s0"
    ).exists()


# --- resumption -------------------------------------------------------------------------------


def test_interrupted_run_resumes_and_matches_an_uninterrupted_one(tmp_path: Path, capsys) -> None:
    args = (*SOFTMAX, "--protocol", "modern", "--epochs", "2")
    assert study(tmp_path / "straight", *args) == 0

    out = tmp_path / "interrupted"
    assert study(out, *args, "--stop-after-epochs", "1") == 0
    assert "stopped after epoch 1" in capsys.readouterr().out
    partial = json.loads((out / "results.json").read_text())
    assert partial["status"] == "running" and partial["runs"] == []
    state = json.loads((out / "checkpoints/modern-softmax-s0/state.json").read_text())
    assert state["epoch"] == 1 and len(state["history"]) == 1

    assert study(out, *args) == 0  # the same command again: picks the run up at epoch 2
    assert "resumed from epoch 1" in capsys.readouterr().out
    a = json.loads((tmp_path / "straight/results.json").read_text())["runs"][0]
    b = json.loads((out / "results.json").read_text())["runs"][0]
    assert b["resumed_from_epoch"] == 1 and a["resumed_from_epoch"] == 0
    assert [h["epoch"] for h in b["history"]] == [1, 2]
    assert b["history"][0] == state["history"][0]
    for key in ("test_acc", "layers"):
        assert a[key] == b[key], key
    assert [h["train_loss"] for h in a["history"]] == [h["train_loss"] for h in b["history"]]
    wa = load_file(str(tmp_path / "straight" / a["checkpoint"]))
    wb = load_file(str(out / b["checkpoint"]))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_resumed_run_says_it_resumed_not_how_it_started(tmp_path: Path, capsys) -> None:
    """A run from a checkpoint whose head has another size says "head re-initialised" when it starts;
    resumed, its weights come from its own training state: it says "resumed from epoch 1", and
    nothing about the head."""
    from safetensors.torch import save_file

    from vitattn.study.model import build_model

    config = make_config("quick", depth=2, dim=32, heads=4, attentions=["softmax"])
    state = build_model(config, "softmax").state_dict()
    state["head.weight"], state["head.bias"] = torch.zeros(7, 32), torch.zeros(7)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "seven.safetensors"))
    args = (*SOFTMAX, "--epochs", "2", "--checkpoint", str(tmp_path / "seven.safetensors"), "--no-probe")
    assert study(tmp_path / "s", *args, "--stop-after-epochs", "1") == 0
    first = capsys.readouterr().out
    assert "head re-initialised" in first and "resumed from" not in first
    assert study(tmp_path / "s", *args) == 0
    again = capsys.readouterr().out
    assert "resumed from epoch 1" in again and "head re-initialised" not in again


def test_compile_time_is_kept_out_of_the_throughput(tmp_path: Path, capsys, monkeypatch) -> None:
    """Under --compile the first step compiles: the first epoch reports that time as compile_seconds and
    the steady rate of its other step, not 64 images over the compile time ("0 img/s"). A stand-in for
    torch.compile and the trainer's clock make it exact: every forward takes 0.5 s, the first 100 s more."""
    import types

    from vitattn.study import train

    clock = [0.0]
    monkeypatch.setattr(train, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class SlowFirstCall(torch.nn.Module):
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net, self.calls = net, 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            clock[0] += 0.5 + (100.0 if self.calls == 1 else 0.0)
            return self.net(x)

    monkeypatch.setattr(torch, "compile", SlowFirstCall)
    out = tmp_path / "c"
    assert study(out, *SOFTMAX, "--epochs", "2", "--no-probe", "--compile") == 0  # 2 steps of 32 per epoch
    stdout = capsys.readouterr().out
    first, second = json.loads((out / "results.json").read_text())["runs"][0]["history"]
    assert first["compile_seconds"] == pytest.approx(100.5) and second["compile_seconds"] == 0.0
    assert first["seconds"] == pytest.approx(101.0)  # the epoch's own time still holds the compile
    assert first["train_images_per_s"] == pytest.approx(32 / 0.5)  # its second step alone
    assert second["train_images_per_s"] == pytest.approx(64 / 1.0)
    assert "(101.0 s incl. 100.5 s compiling, 64 img/s)" in stdout


@pytest.mark.slow  # a real torch.compile on the CPU (tens of seconds)
def test_compile_on_the_cpu_reports_a_steady_rate(tmp_path: Path) -> None:
    out = tmp_path / "c"
    assert study(out, *SOFTMAX, "--epochs", "2", "--no-probe", "--compile") == 0
    first, second = json.loads((out / "results.json").read_text())["runs"][0]["history"]
    assert first["compile_seconds"] > 1.0 and first["train_images_per_s"] > 0.2 * second["train_images_per_s"]


def test_window_flag_and_the_note_when_it_covers_the_grid() -> None:
    """--window / --window-dilation reach the configuration; on a 4x4 patch grid the default 5x5 window
    holds every patch (the window attention is softmax there): the study's opening lines say so, and
    a 3x3 window is not noted."""
    from vitattn.cli import build_parser
    from vitattn.cli.study import config_of
    from vitattn.study.distributed import DistEnv
    from vitattn.study.runner import describe_study

    tiny = ["study", "--model", "vit_tiny_patch16_224", "--img-size", "16", "--attention", "window"]
    tiny += [f"--model-arg={k}={v}" for k, v in {"patch_size": 4, "embed_dim": 32, "depth": 2}.items()]

    def lines(*extra: str) -> str:
        config = config_of(build_parser().parse_args([*tiny, "--model-arg=num_heads=2", *extra]))
        return "\n".join(describe_study(config, 1, DistEnv()))

    text = lines()
    assert "4x4 patch grid" in text and "window 5x5" in text
    assert "note: the 5x5 window covers the whole 4x4 patch grid" in text and "--window" in text
    text = lines("--window", "3")
    assert "window 3x3" in text and "covers the whole" not in text
    text = lines("--window", "4", "--window-dilation", "2")
    assert "window 4x4, dilation 2" in text and "covers the whole" not in text  # dilated: 2 sub-grids
    config = config_of(build_parser().parse_args(["study", "--attention", "window", "--window", "3"]))
    assert (config.window, config.window_size, config.dilation) == (3, 3, 1)


def test_resume_flag_reads_the_stored_config(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s"
    assert study(out, *SOFTMAX, "--protocol", "baseline", "--epochs", "2", "--stop-after-epochs", "1") == 0
    capsys.readouterr()
    assert main(["study", "--resume", "--out", str(out), "--no-progress"]) == 0  # no model options needed
    text = capsys.readouterr().out
    assert "resumed from epoch 1" in text and "depth 2, dim 32" in text
    assert main(["study", "--resume", "--out", str(tmp_path / "nothing")]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_state_round_trip_restores_optimizer_scheduler_and_rng(tmp_path: Path) -> None:
    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, warmup_cosine(opt, 2, 10)

    model, opt, sched = fresh()
    for step in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        sched.step_update(step + 2)
    save_state(tmp_path, DistEnv(), 3, model, opt, sched, [{"epoch": 3}])
    expected = torch.rand(3)
    assert not list(tmp_path.glob("*.pkl")) and {p.suffix for p in tmp_path.iterdir()} == {
        ".json",
        ".safetensors",
    }

    model2, opt2, sched2 = fresh()
    state = load_state(tmp_path, DistEnv(), model2, opt2, sched2)
    assert state is not None and state["epoch"] == 3 and state["history"] == [{"epoch": 3}]
    assert torch.equal(torch.rand(3), expected)  # the torch RNG continues where it was saved
    assert sched2.state_dict() == sched.state_dict()
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])


# --- protocols --------------------------------------------------------------------------------


def _ops(transform) -> list[str]:
    return [type(t).__name__ for t in transform.transforms]


@pytest.mark.parametrize("protocol", ABLATION, ids=lambda p: p.name)
def test_each_protocol_switches_exactly_its_components(protocol) -> None:
    digits = DATASETS["digits"]
    ops = _ops(build_train_transform(protocol, digits))
    assert ops[:3] == ["ToImage", "RandomCrop", "RandomHorizontalFlip"]  # the baseline, always
    assert ("AutoAugment" in ops) == protocol.autoaugment
    assert "ColorJitter" not in ops and "CutMix" not in ops
    tiny_imagenet = _ops(build_train_transform(protocol, DATASETS["tinyimagenet"]))
    assert ("ColorJitter" in tiny_imagenet) == protocol.autoaugment and "AutoAugment" not in tiny_imagenet
    assert (build_cutmix(protocol, 10) is not None) == protocol.cutmix
    assert build_criterion(protocol).label_smoothing == (0.1 if protocol.label_smoothing else 0.0)
    assert _ops(build_train_transform(protocol, digits, hflip=False))[2] != "RandomHorizontalFlip"


def test_protocol_names_and_ablation() -> None:
    assert [p.name for p in ABLATION] == ["baseline", "aa", "cm", "ls", "aa+cm", "aa+ls", "cm+ls", "modern"]
    assert len(set(ABLATION)) == 8
    assert PROTOCOLS["modern"].components() == dict(autoaugment=True, cutmix=True, label_smoothing=True)
    assert resolve_protocols(["cm+aa", "aa+cm+ls", "baseline", "modern"]) == [
        PROTOCOLS["aa+cm"],
        PROTOCOLS["modern"],
        PROTOCOLS["baseline"],
    ]
    with pytest.raises(ValueError, match="unknown protocol 'mixup'"):
        resolve_protocols(["mixup"])


def test_cutmix_mixes_labels_and_augmented_digits_keep_shape() -> None:
    protocol = PROTOCOLS["modern"]
    tf = build_train_transform(protocol, DATASETS["digits"])
    x = torch.stack([tf(torch.randint(0, 256, (1, 8, 8), dtype=torch.uint8)) for _ in range(8)])
    assert x.shape == (8, 1, 8, 8) and x.dtype == torch.float32
    mixed, soft = build_cutmix(protocol, 10)(x, torch.arange(8))
    assert mixed.shape == x.shape and soft.shape == (8, 10)
    assert torch.allclose(soft.sum(-1), torch.ones(8))


# --- configuration and summary ----------------------------------------------------------------


def test_presets_and_defaults() -> None:
    quick, paper = make_config("quick"), make_config("paper")
    assert quick.dataset == paper.dataset == "scenes"
    assert quick.protocols == ["baseline"] and paper.protocols == ["baseline", "modern"]
    assert quick.attentions == ["softmax", "entmax15", "locat"] and paper.attentions == ["softmax"]
    assert (quick.depth, quick.dim, quick.heads) == (2, 64, 4)  # the main job's small ViT
    assert (paper.depth, paper.dim, paper.heads, paper.mlp_ratio) == (8, 192, 8, 2.0)  # the study's
    assert quick.first_layers == 1 and paper.first_layers == 2 and paper.epochs == 200 and quick.epochs < 20
    assert make_config("quick", epochs=7, depth=4).first_layers == 1
    assert quick.batch_size == 64 and quick.hflip is False and quick.scenes_version == 3  # scenes
    assert quick.init == "mimetic" and quick.pos_embed_std == 1.0  # the main job's start (docs/study.md)
    assert paper.init == "timm" and paper.pos_embed_std == 0.02
    assert quick.probe and quick.probe_layer == -1
    digits = make_config("paper", dataset="digits")
    assert digits.batch_size == 32 and digits.pos_embed_std == 1.0 and digits.hflip is False
    cifar = make_config("paper", dataset="cifar100")
    assert cifar.batch_size == 128 and cifar.pos_embed_std == 0.02 and cifar.hflip is True
    assert cifar.spec.grid_size == (8, 8) and make_config(dataset="tinyimagenet").spec.grid_size == (8, 8)
    assert quick.spec.grid_size == (8, 8) and quick.spec.has_masks and not cifar.spec.has_masks
    assert StudyConfig.from_dict(cifar.to_dict()) == cifar
    assert make_config("quick", data_dir="elsewhere", threads=1).digest() == quick.digest()
    assert make_config("quick", epochs=4).digest() != quick.digest()
    with pytest.raises(ValueError, match="divisible"):
        make_config(dim=30, heads=8)
    with pytest.raises(ValueError, match="probe_layer 5"):
        make_config(probe_layer=5)


def test_a_config_written_before_a_field_existed_means_its_old_value() -> None:
    """A study folder from before ``window`` / ``window_dilation`` (or ``gaug_lr_scale``) existed
    resumes: a missing key means the field's default; a missing ``scenes_version`` means version 2."""
    from vitattn.study.config import config_diff

    new = make_config("quick").to_dict()
    old = {k: v for k, v in new.items() if k not in ("window", "window_dilation", "gaug_lr_scale")}
    assert config_diff(old, new) == []
    assert config_diff(old, make_config("quick", attentions=["window"], window=3).to_dict()) == [
        "attentions: ['softmax', 'entmax15', 'locat'] -> ['window']",
        "window: None -> 3",
    ]
    older = {k: v for k, v in new.items() if k != "scenes_version"}
    assert config_diff(older, new) == ["scenes_version: 2 -> 3"]
    assert StudyConfig.from_dict(older).scenes_version == 2


def test_scenes_normalization_matches_the_dataset() -> None:
    from vitattn.datasets.scenes import STATISTICS

    spec = DATASETS["scenes"]
    assert (spec.mean, spec.std) == STATISTICS[3]  # the study's scenes: version 3
    assert (spec.img_size, spec.patch_size, spec.channels, spec.num_classes) == (32, 4, 3, 10)


def test_study_model_has_the_papers_size() -> None:
    from vitattn.study import build_model

    model = build_model(make_config("paper", dataset="digits"), "softmax")
    assert 2.3e6 < sum(p.numel() for p in model.parameters()) < 2.5e6
    assert tuple(model.patch_embed.grid_size) == (8, 8) and model.num_prefix_tokens == 1
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    scenes = build_model(make_config("paper"), "softmax")
    assert tuple(scenes.patch_embed.grid_size) == (8, 8)
    assert scenes(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    cifar = build_model(make_config(dataset="cifar10", depth=1), "locat")
    assert (
        tuple(cifar.patch_embed.grid_size) == (8, 8)
        and type(cifar.blocks[0].attn).__name__ == "LocAtAttention"
    )


def test_summary_aggregates_seeds() -> None:
    def run(protocol: str, seed: int, acc: float, mad: float) -> dict:
        layers = [{"layer": 0, "mad": [mad, 0.3], "entropy": [0.5, 0.7]}]
        return dict(
            name=f"{protocol}-s{seed}", protocol=protocol, components=PROTOCOLS[protocol].components(),
            attention="softmax", seed=seed, test_acc=acc, layers=layers, first_layers=[0],
            min_mad_first=mad, mean_entropy=[0.6],
        )  # fmt: skip

    rows = summary_rows(
        [run("baseline", 0, 0.9, 0.3), run("baseline", 1, 0.8, 0.2), run("modern", 0, 0.95, 0.01)]
    )
    assert [r["protocol"] for r in rows] == ["baseline", "modern"]
    assert rows[0]["seeds"] == 2 and rows[0]["acc_mean"] == pytest.approx(85.0)
    assert rows[0]["acc_std"] == pytest.approx(math.sqrt(50.0))
    assert (rows[0]["min_mad_lo"], rows[0]["min_mad_hi"]) == (0.2, 0.3)
    table = summary_table([run("baseline", 0, 0.9, 0.3), run("baseline", 1, 0.8, 0.2)])
    assert "85.0 ± 7.1" in table and "0.250 [0.200–0.300]" in table and "| 0.60 |" in table
    assert "| – | – | – | – |" in table  # runs without sparsity or a probe
    probed = [run("baseline", 0, 0.9, 0.3), run("baseline", 1, 0.8, 0.2)]
    for r, (lin, knn, sp) in zip(probed, [(0.2, 0.3, 0.5), (0.4, 0.1, 0.3)], strict=True):
        r.update(probe={"linear_miou": lin, "knn_miou": knn, "layer": 0, "alignment": sp}, mean_sparsity=sp)
    row = summary_rows(probed)[0]
    assert row["linear_miou_mean"] == pytest.approx(30.0)
    assert row["knn_miou_std"] == pytest.approx(math.sqrt(200))
    assert row["sparsity"] == pytest.approx(0.4)
    assert "| 0.40 | 30.0 ± 14.1 | 20.0 ± 14.1 | 0.400 ± 0.141 |" in summary_table(probed)


# --- missing data -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dataset, expected",
    [("cifar100", ["cifar-100-python", "--download"]), ("cifar10", ["cifar-10-batches-py", "--download"]),
     ("tinyimagenet", ["tiny-imagenet-200", "train/<wnid>"])],
)  # fmt: skip
def test_missing_dataset_says_what_to_put_where(tmp_path: Path, capsys, dataset: str, expected) -> None:
    code = main(["study", "--dataset", dataset, "--data-dir", str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("vitattn study: ")
    for text in [str(tmp_path), *expected]:
        assert text in err, (text, err)


# --- torchrun ---------------------------------------------------------------------------------


@pytest.mark.slow  # two torchrun processes (~15 s)
def test_torchrun_two_cpu_ranks(tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*torchrun, "-m", "vitattn", "study", *TINY, *SOFTMAX, "--protocol", "baseline", "--device", "cpu"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    validate_results(data)
    assert data["status"] == "complete" and data["runs"][0]["world_size"] == 2
    assert proc.stdout.count("baseline-softmax-s0: test acc") == 1  # rank 0 alone prints
    assert "DDP over 2 ranks" in proc.stdout


def test_tinyimagenet_layout_end_to_end(tmp_path: Path) -> None:
    """A fake Tiny-ImageNet (200 classes, 64 px, the unzipped val layout) trains through the CLI,
    with ColorJitter in place of AutoAugment on the 3-channel path."""
    from PIL import Image

    root = tmp_path / "data" / "tiny-imagenet-200"
    gen = torch.Generator().manual_seed(0)
    wnids = [f"n{i:08d}" for i in range(200)]
    for wnid in wnids:
        (root / "train" / wnid / "images").mkdir(parents=True)
        pixels = torch.randint(0, 256, (64, 64, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(root / "train" / wnid / "images" / f"{wnid}_0.JPEG")
    (root / "val" / "images").mkdir(parents=True)
    lines = []
    for i, wnid in enumerate(wnids[:8]):
        pixels = torch.randint(0, 256, (64, 64, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(root / "val" / "images" / f"val_{i}.JPEG")
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")

    out = tmp_path / "out"
    args = ["--dataset", "tinyimagenet", "--data-dir", str(tmp_path / "data"), "--workers", "0"]
    assert study(out, *args, *SOFTMAX, "--protocol", "aa") == 0
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["autoaugment_op"] == "colorjitter" and data["config"]["patch_size"] == 8
    run = data["runs"][0]
    assert run["components"]["autoaugment"] and len(run["layers"][0]["mad"]) == 4
    assert run["num_images"] == 8  # the annotated validation images
