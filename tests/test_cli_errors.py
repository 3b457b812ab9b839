"""Every ``vitattn`` command refuses bad input the same way: exit status 2, one line on stderr that names
the option (or the file), and nothing written. Run in-process, one short call per case: most fail while
parsing or checking, the rest after building a tiny model on the meta device or on the CPU.

Each case runs in an empty working folder with ``--out out`` (or the command's own output options) and
the folder must still be empty afterwards; the input files (a corrupt safetensors file, a pickled
model, a checkpoint of another model, ...) live in a separate folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vitattn.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

TIMM = "vit_tiny_patch16_224"
# a tiny timm ViT: 32 px, 4-px patches (8x8 grid), 2 blocks of width 32
TIMM_ARGS = ["--model-arg", "img_size=32", "--model-arg", "patch_size=4", "--model-arg", "embed_dim=32",
             "--model-arg", "depth=2", "--model-arg", "num_heads=2"]  # fmt: skip
# the study on a budget of seconds, should a case not be refused
STUDY = ["--depth", "2", "--dim", "32", "--heads", "4", "--epochs", "1", "--limit-train", "32",
         "--limit-test", "16", "--analysis-images", "8", "--no-probe", "--no-progress"]  # fmt: skip
PROBE = [TIMM, *TIMM_ARGS, "--limit-train", "8", "--limit-test", "4", "--epochs", "1", "--no-progress"]
ANALYZE = [TIMM, *TIMM_ARGS, "--max-images", "4", "--no-progress"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Input files of the bad invocations: a corrupt safetensors file, a pickled model, a checkpoint
    of another model (a 3-block study ViT), a file where a folder belongs, a folder where a file does."""
    import timm

    folder = tmp_path_factory.mktemp("inputs")
    (folder / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    torch.save(
        timm.create_model(TIMM, depth=1, embed_dim=32, num_heads=2, img_size=32), folder / "pickled.pt"
    )
    save_file({"blocks.0.attn.qkv.weight": torch.zeros(3, 3)}, str(folder / "other.safetensors"))
    (folder / "a_file").write_text("not a folder")
    (folder / "a_folder").mkdir()
    (folder / "broken_study").mkdir()
    (folder / "broken_study" / "results.json").write_text("{not json")
    return folder


def _case(command: str, argv: list[str], names: str, out: bool = True):
    return pytest.param(command, argv, names, out, id=f"{command} {' '.join(argv)}"[:90])


CASES = [
    # --- study: the values of StudyConfig, named by their options ---
    _case("study", ["--epochs", "-1"], "--epochs"),
    _case("study", ["--epochs", "0"], "--epochs"),
    _case("study", ["--epochs", "two"], "--epochs"),
    _case("study", ["--batch-size", "0"], "--batch-size"),
    _case("study", ["--lr", "0"], "--lr"),
    _case("study", ["--lr", "nan"], "--lr"),
    _case("study", ["--weight-decay", "-1"], "--weight-decay"),
    _case("study", ["--warmup-epochs", "-0.5"], "--warmup-epochs"),
    _case("study", ["--seeds", "0"], "--seeds"),
    _case("study", ["--depth", "0"], "--depth"),
    _case("study", ["--heads", "0"], "--heads"),
    _case("study", ["--dim", "30"], "--dim"),
    _case("study", ["--attention", "sparse"], "--attention"),
    _case("study", ["--protocol", "mixup"], "--protocol"),
    _case("study", ["--dataset", "mnist"], "--dataset"),
    _case("study", ["--scenes-version", "1"], "--scenes-version"),
    _case("study", ["--gaug-init", "zeros"], "--gaug-init"),
    _case("study", ["--img-size", "0"], "--img-size"),
    _case("study", ["--img-size", "30"], "--img-size"),
    _case("study", ["--model", TIMM, "--model-arg", "depth=1", "--img-size", "40"], "--img-size 40"),
    _case("study", ["--model", "no_such_model_xyz"], "--model"),
    _case("study", ["--model", TIMM, "--model-arg", "no_such_arg=1"], "no_such_arg"),
    _case("study", ["--model-arg", "depth"], "--model-arg"),
    _case("study", ["--pretrained"], "--pretrained"),
    _case("study", ["--drop-path", "1"], "--drop-path"),
    _case("study", ["--layer-decay", "0"], "--layer-decay"),
    _case("study", ["--gaug-lr-scale", "0"], "--gaug-lr-scale"),
    _case("study", ["--mixup", "-1"], "--mixup"),
    _case("study", ["--cutmix", "-1"], "--cutmix"),
    _case("study", ["--smoothing", "1"], "--smoothing"),
    _case("study", ["--probe-layer", "5"], "--probe-layer"),
    _case("study", ["--first-layers", "3"], "--first-layers"),
    _case("study", ["--limit-train", "0"], "--limit-train"),
    _case("study", ["--analysis-images", "0"], "--analysis-images"),
    _case("study", ["--probe-epochs", "0"], "--probe-epochs"),
    _case("study", ["--workers", "-1"], "--workers"),
    _case("study", ["--threads", "0"], "--threads"),
    _case("study", ["--device", "gpu0"], "--device"),
    _case("study", ["--window", "3"], "--window"),
    _case("study", ["--attention", "window", "--window", "0"], "--window"),
    _case("study", ["--attention", "window", "--window-dilation", "0"], "--window-dilation"),
    # --- study: paths, all checked before the output folder is made ---
    _case("study", ["--checkpoint", "{inputs}/missing.safetensors"], "missing.safetensors"),
    _case("study", ["--checkpoint", "{inputs}/corrupt.safetensors"], "corrupt.safetensors"),
    _case("study", ["--checkpoint", "{inputs}/pickled.pt"], "pickled.pt"),
    _case("study", ["--checkpoint", "{inputs}/other.safetensors"], "other.safetensors"),
    _case("study", ["--checkpoint", "{inputs}/a_folder"], "a_folder"),
    _case("study", ["--dataset", "cifar10", "--data-dir", "{inputs}/a_folder"], "--data-dir"),
    _case("study", ["--dataset", "tinyimagenet", "--data-dir", "{inputs}/a_folder"], "--data-dir"),
    _case("study", ["--dataset", "imagefolder", "--data-dir", "{inputs}/a_folder"], "a_folder"),
    _case("study", ["--out", "{inputs}/a_file"], "--out", out=False),
    _case("study", ["--resume", "--out", "nothing"], "nothing to resume", out=False),
    _case("study", ["--resume"], "--resume needs --out", out=False),
    _case("study", ["--resume", "--out", "{inputs}/broken_study"], "results.json", out=False),
    _case(
        "study",
        [
            "--model",
            TIMM,
            "--model-arg",
            "depth=1",
            "--pretrained",
            "--model-arg",
            "pretrained_cfg_overlay={'file': 'none.safetensors'}",
        ],
        "none.safetensors",
    ),  # fmt: skip
    # --- probe ---
    _case("probe", ["--batch-size", "0"], "--batch-size"),
    _case("probe", ["--epochs", "0"], "--epochs"),
    _case("probe", ["--k", "0"], "--k"),
    _case("probe", ["--limit-train", "0"], "--limit-train"),
    _case("probe", ["--limit-test", "-1"], "--limit-test"),
    _case("probe", ["--image-size", "0"], "--image-size"),
    _case(
        "probe",
        ["--model-arg", "img_size=40", "--model-arg", "depth=1", "--image-size", "40"],
        "--image-size 40",
    ),
    _case("probe", ["--layers", "first"], "--layers"),
    _case("probe", ["--layers", "5"], "--layer"),
    _case("probe", ["--method", "svm"], "--method"),
    _case("probe", ["--dataset", "voc"], "--data-dir"),
    _case("probe", ["--model-arg", "depth"], "--model-arg"),
    _case("probe", ["--model-arg", "no_such_arg=1"], "no_such_arg"),
    _case("probe", ["--checkpoint", "{inputs}/missing.safetensors"], "missing.safetensors"),
    _case("probe", ["--checkpoint", "{inputs}/corrupt.safetensors"], "corrupt.safetensors"),
    _case("probe", ["--checkpoint", "{inputs}/pickled.pt"], "pickled.pt"),
    _case("probe", ["--checkpoint", "{inputs}/other.safetensors"], "other.safetensors"),
    _case("probe", ["--device", "gpu0"], "--device"),
    _case("probe", ["--json", "{inputs}/a_folder"], "--json"),
    _case("probe", ["--out", "{inputs}/a_file"], "--out", out=False),
    # --- analyze ---
    _case("analyze", ["--max-images", "0"], "--max-images"),
    _case("analyze", ["--batch-size", "0"], "--batch-size"),
    _case("analyze", ["--rollout", "--rollout-images", "0"], "--rollout-images"),
    _case("analyze", ["--discard-ratio", "1"], "--discard-ratio"),
    _case("analyze", ["--discard-ratio", "-0.1"], "--discard-ratio"),
    _case("analyze", ["--head-fusion", "median"], "--head-fusion"),
    _case("analyze", ["--attention", "sparse"], "--attention"),
    _case("analyze", ["--query", "centre"], "--query"),
    _case("analyze", ["--query", "99"], "--query"),
    _case("analyze", ["--layers", "9"], "--layer"),
    _case("analyze", ["--map-layer", "9"], "--map-layer"),
    _case("analyze", ["--gradient-rollout"], "--gradient-rollout"),
    _case("analyze", ["--checkpoint", "{inputs}/missing.safetensors"], "missing.safetensors"),
    _case("analyze", ["--checkpoint", "{inputs}/corrupt.safetensors"], "corrupt.safetensors"),
    _case("analyze", ["--checkpoint", "{inputs}/pickled.pt"], "pickled.pt"),
    _case("analyze", ["--checkpoint", "{inputs}/other.safetensors"], "other.safetensors"),
    _case("analyze", ["--compare", "{inputs}/missing.json"], "--compare"),
    _case("analyze", ["--images", "{inputs}/missing"], "--images"),
    _case("analyze", ["--device", "gpu0"], "--device"),
    _case("analyze", ["--model-arg", "img_size=40", "--model-arg", "patch_size=16"], "input size 40"),
    _case("analyze", ["--out", "{inputs}/a_file"], "--out", out=False),
    # --- bench and info ---
    _case("bench", ["no_such_suite"], "no_such_suite", out=False),
    _case("bench", ["--processes", "0"], "--processes", out=False),
    _case("bench", ["--threads", "0"], "--threads", out=False),
    _case("bench", ["--json", "{inputs}/a_folder"], "--json", out=False),
    _case("bench", ["--import-module", "no_such_module_xyz"], "no_such_module_xyz", out=False),
    _case("info", ["--verbose"], "--verbose", out=False),
]

_BASE = {"study": STUDY, "probe": PROBE, "analyze": ANALYZE, "bench": [], "info": []}


@pytest.mark.parametrize(("command", "argv", "names", "out"), CASES)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    command: str, argv: list[str], names: str, out: bool, inputs: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = [a.replace("{inputs}", str(inputs)) for a in argv]
    if command == "probe" and args[0] in ("--model-arg",):  # a model-arg of its own: drop the tiny ones
        base = [TIMM, "--limit-train", "8", "--limit-test", "4", "--no-progress"]
    else:
        base = _BASE[command]
    code = main([command, *base, *args, *(["--out", "out"] if out else [])])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err[-2000:]
    assert len(lines) == 1, captured.err
    prefix = "vitattn" if command == "info" else f"vitattn {command}"
    assert lines[0].startswith(prefix + ": ") and names in lines[0], lines[0]
    assert "\x1b[" not in lines[0]
    assert sorted(p.name for p in work.iterdir()) == [], "files written before the error"


def test_a_bad_checkpoint_writes_nothing_and_the_fixed_rerun_needs_no_overwrite(
    tmp_path: Path, capsys
) -> None:
    """A missing --checkpoint used to fail after --out was made, leaving results.json "running" and the
    rerun refused without --overwrite; now the folder is not made, and the same command with the file
    in place runs. --overwrite with a bad input keeps the earlier study."""
    from vitattn.study import make_config
    from vitattn.study.model import build_model

    ckpt, out = tmp_path / "start.safetensors", tmp_path / "out"
    argv = ["study", *STUDY, "--attention", "softmax", "--checkpoint", str(ckpt), "--out", str(out)]
    assert main(argv) == 2 and not out.exists()
    assert "start.safetensors' does not exist" in capsys.readouterr().err
    model = build_model(make_config("quick", depth=2, dim=32, heads=4, attentions=["softmax"]), "softmax")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt))
    assert main(argv) == 0 and (out / "results.json").is_file()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    ckpt.write_bytes(b"not a safetensors file")
    assert main([*argv, "--overwrite", "--epochs", "2"]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing cleared or touched


def test_checkpoint_read_errors_are_one_line_naming_the_file(inputs: Path, tmp_path: Path) -> None:
    """Corrupt safetensors, a damaged torch file, a pickled model (torch's 8-line message with terminal
    colour codes), a folder: each a one-line ValueError that names the file."""
    import re

    from vitattn.analysis import read_state_dict

    (tmp_path / "damaged.pt").write_bytes((inputs / "pickled.pt").read_bytes()[:500])
    for path, says in [
        (inputs / "corrupt.safetensors", "is not a readable safetensors file"),
        (tmp_path / "damaged.pt", "neither a safetensors file nor a readable torch state dict"),
        (inputs / "pickled.pt", "holds a pickled object of timm.models.vision_transformer.VisionTransformer"),
        (inputs / "a_folder", "is a folder"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)) as info:
            read_state_dict(path)
        text = str(info.value)
        assert str(path) in text and "\n" not in text and "\x1b" not in text and len(text) < 400, text
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_state_dict(tmp_path / "none.safetensors")
