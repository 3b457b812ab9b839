"""`vitattn study`'s options are made from :class:`StudyConfig`'s fields: every field states its flag
or that it has none, every flag reaches its field (each kind: value, list, pairs, count, on, off,
switch), and an absent flag leaves the preset's value."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

import pytest

from vitattn.cli import build_parser
from vitattn.cli.study import config_of, field_values, option_of
from vitattn.study import StudyConfig, make_config
from vitattn.study.config import RUNTIME_KEYS
from vitattn.study.flags import flag_name, flag_of

FLAGLESS = {"num_classes", "mlp_ratio", "_model_depth"}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["study", *argv])


def study_actions() -> dict[str, argparse.Action]:
    """The ``study`` subparser's actions by option string."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices["study"]._option_string_actions)


def test_every_field_has_a_flag_or_is_stated_flagless() -> None:
    for f in fields(StudyConfig):
        assert "flag" in f.metadata, f"{f.name}: neither option(...) nor no_option(...)"
    assert {f.name for f in fields(StudyConfig) if flag_of(f) is None} == FLAGLESS


def test_every_flag_is_an_option_of_the_command_that_sets_its_field() -> None:
    actions = study_actions()
    names = [flag_name(f) for f in fields(StudyConfig) if flag_of(f) is not None]
    assert len(names) == len(set(names))
    for f in fields(StudyConfig):
        flag = flag_of(f)
        if flag is None:
            assert option_of(f.name) == f.name  # errors name a flagless field by its name
            continue
        action = actions[flag_name(f)]
        assert action.dest == f.name and action.help == flag.help and action.default is None
        assert option_of(f.name) == flag_name(f)
        if flag.choices is not None:
            assert list(action.choices or ()) == list(flag.choices)
        if flag.kind == "switch":
            assert actions[str(flag.negative)].dest == f.name


def test_runtime_keys_are_the_fields_marked_runtime() -> None:
    expected = ("data_dir", "download", "workers", "threads", "progress", "device", "compile", "check_images")
    assert RUNTIME_KEYS == expected


def _sample(name: str) -> tuple[list[str], Any]:
    """Command-line words that set field ``name``, and the field value they give."""
    f = next(f for f in fields(StudyConfig) if f.name == name)
    flag = flag_of(f)
    assert flag is not None
    option, kind = flag_name(f), flag.kind
    if kind in ("on", "off", "switch"):
        return [option], kind != "off"
    if kind == "pairs":
        return [option, "depth=3", option, "act='gelu'", option, "tag=abc"], dict(
            depth=3, act="gelu", tag="abc"
        )
    if kind == "count":
        return [option, "3", "--first-seed", "4"], [4, 5, 6]
    item = type(f.default) if f.default is not None and kind == "value" else None
    if flag.choices is not None:
        word, value = str(flag.choices[-1]), flag.choices[-1]
    elif item is float or name in ("drop_path", "layer_decay", "pos_embed_std"):
        word, value = "0.25", 0.25
    elif item is str or name in ("model", "checkpoint", "device", "protocols"):
        word, value = "some-text", "some-text"
    else:
        word, value = "7", 7
    return ([option, word], [value]) if kind == "list" else ([option, word], value)


@pytest.mark.parametrize("name", [f.name for f in fields(StudyConfig) if flag_of(f) is not None])
def test_each_flag_round_trips_to_its_field_value(name: str) -> None:
    argv, value = _sample(name)
    values = field_values(parse(*argv))
    assert values[name] == value
    assert all(v is None for k, v in values.items() if k != name)  # nothing else is set


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--epochs", "7"], "epochs", 7),  # value: int
        (["--lr", "0.01"], "lr", 0.01),  # value: float
        (["--auto-augment", "rand-m7"], "auto_augment", "rand-m7"),  # value: str
        (["--scenes-version", "2"], "scenes_version", 2),  # value: int with choices
        (["--dataset", "digits"], "dataset", "digits"),
        (["--attention", "softmax", "window"], "attentions", ["softmax", "window"]),  # list
        (["--protocol", "baseline", "modern"], "protocols", ["baseline", "modern"]),
        (["--ablation"], "protocols", ["baseline", "aa", "cm", "ls", "aa+cm", "aa+ls", "cm+ls", "modern"]),
        (["--seeds", "2"], "seeds", [0, 1]),  # count
        (["--seeds", "2", "--first-seed", "5"], "seeds", [5, 6]),
        (["--first-seed", "3"], "seeds", [3]),
        (["--prr"], "prr", True),  # on
        (["--no-probe"], "probe", False),  # off
        (["--no-progress"], "progress", False),
        (["--hflip"], "hflip", True),  # switch
        (["--no-hflip"], "hflip", False),
        (["--no-check-images"], "check_images", False),
        (["--smoothing", "0.2"], "label_smoothing", 0.2),  # a flag named otherwise
        ([], "epochs", 5),  # absent: the preset's value
        (["--preset", "paper"], "epochs", 200),
        ([], "mlp_ratio", 2.0),  # flagless: the field's default
        ([], "workers", 0),  # in-memory data: no loader workers
        (["--dataset", "cifar10"], "workers", 2),
        (["--dataset", "cifar10", "--workers", "1"], "workers", 1),
    ],
)
def test_the_command_line_gives_the_config(argv: list[str], field: str, value: Any) -> None:
    assert getattr(config_of(parse(*argv)), field) == value


def test_no_flags_give_the_preset() -> None:
    assert config_of(parse()) == make_config("quick")
    assert config_of(parse("--preset", "paper")) == make_config("paper")


def test_pairs_reach_the_config_through_a_timm_backbone() -> None:
    argv = ["--model", "vit_tiny_patch16_224", "--img-size", "16", "--attention", "softmax"]
    argv += [
        f"--model-arg={k}={v}" for k, v in dict(patch_size=4, embed_dim=32, depth=2, num_heads=2).items()
    ]
    config = config_of(parse(*argv))
    assert config.model_args == dict(patch_size=4, embed_dim=32, depth=2, num_heads=2)
    assert config.model_depth == 2
