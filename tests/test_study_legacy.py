"""Outputs of a study written by an earlier version of the trainer stay readable and resumable.

``tests/data/study_v1`` was written by the trainer as it was before it used timm's optimizer factory,
scheduler and loss scaler (hand-written AdamW groups, ``LambdaLR`` warmup-cosine, our own GradScaler
helper), with::

    python -m vitattn study --depth 2 --dim 16 --heads 2 --epochs 2 --batch-size 32 \
        --limit-train 64 --limit-test 32 --analysis-images 8 --no-probe --no-progress \
        --attention locat --protocol baseline --layer-decay 0.75 --gaug-lr-scale 10 \
        --warmup-epochs 1 --amp fp16 --device cpu --workers 0 --out straight

and the same command with ``--out interrupted --stop-after-epochs 1`` (only the JSON and safetensors
files kept). The run has every kind of parameter group (layer decay x weight decay x GAug lr scale)
and the fp16 loss scaler, so its state holds everything a checkpoint can hold.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitattn.cli import main
from vitattn.study import StudyConfig, validate_results
from vitattn.study.checkpoint import STATE_FORMAT
from vitattn.study.distributed import DistEnv
from vitattn.study.model import build_model
from vitattn.study.protocols import PROTOCOLS
from vitattn.study.run_data import run_data
from vitattn.study.train import evaluate

DATA = Path(__file__).parent / "data" / "study_v1"
RUN = "baseline-locat-s0"


def _straight() -> dict:
    return json.loads((DATA / "straight" / "results.json").read_text())


def test_old_results_and_weights_are_read() -> None:
    data = _straight()
    validate_results(data)
    config = StudyConfig.from_dict(data["config"])
    run = data["runs"][0]
    model = build_model(config, run["attention"], seed=run["seed"])
    weights = load_file(str(DATA / "straight" / run["checkpoint"]))
    model.load_state_dict(weights, strict=True)
    test = run_data(config, PROTOCOLS[run["protocol"]]).test
    acc = evaluate(model, test, DistEnv(), amp=run["amp"]).accuracy
    assert acc == pytest.approx(run["test_acc"])


def test_old_interrupted_run_resumes_to_the_old_uninterrupted_result(tmp_path: Path, capsys) -> None:
    """The state written after epoch 1 by the old trainer, resumed by this one, ends where the old
    trainer's uninterrupted run ended: same losses, learning rates, accuracy and weights."""
    out = tmp_path / "interrupted"
    shutil.copytree(DATA / "interrupted", out)
    state = json.loads((out / "checkpoints" / RUN / "state.json").read_text())
    assert state["format"] == STATE_FORMAT and state["epoch"] == 1
    assert main(["study", "--resume", "--out", str(out), "--no-progress"]) == 0
    assert "resumed from epoch 1" in capsys.readouterr().out
    resumed = json.loads((out / "results.json").read_text())
    validate_results(resumed)
    a, b = _straight()["runs"][0], resumed["runs"][0]
    assert b["resumed_from_epoch"] == 1 and [h["epoch"] for h in b["history"]] == [1, 2]
    for key in ("train_loss", "lr", "test_acc"):
        old = [h[key] for h in a["history"]]
        assert [h[key] for h in b["history"]] == pytest.approx(old, rel=1e-6, abs=1e-12), key
    wa = load_file(str(DATA / "straight" / a["checkpoint"]))
    wb = load_file(str(out / b["checkpoint"]))
    assert wa.keys() == wb.keys()
    # The same function: both models' outputs on one batch (3.1e-7 apart on an AMD EPYC host, outputs
    # ~0.2). The weights agree to 1e-7 on the CPU that wrote the data, not on every CPU: float32 sums
    # take other SIMD paths (there a GAug weight is off by 4e-5 relative), and AdamW turns the rounding
    # noise of directions without a gradient (the keys' bias, which softmax ignores) into whole steps
    # (the qkv bias off by 1.5e-4).
    config = StudyConfig.from_dict(_straight()["config"])
    old, new = (build_model(config, a["attention"], seed=a["seed"]) for _ in range(2))
    old.load_state_dict(wa, strict=True)
    new.load_state_dict(wb, strict=True)
    side = config.input_size
    images = torch.randn(4, 3, side, side, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(new.eval()(images), old.eval()(images), rtol=0.0, atol=3e-6)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-3, msg=k)
