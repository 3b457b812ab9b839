"""``vitattn study``: its options, made from :class:`~vitattn.study.config.StudyConfig`'s fields (each
field states its flag: :mod:`vitattn.study.flags`), and the glue from them to
:func:`vitattn.study.run_study`."""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

from ..study.config import RUNTIME_KEYS, ConfigError, StudyConfig, make_config
from ..study.flags import Flag, flag_name, flag_of
from ..study.protocols import PROTOCOLS
from .options import USAGE_ERRORS, parse_model_args, report_error

__all__ = ["HELP", "NAME", "add_arguments", "config_of", "field_values", "option_of", "run"]

NAME = "study"
HELP = "train and compare attentions: the locality study, fine-tuning timm backbones (default: quick, scenes)"

# the fields that have an option, by name
_FLAGGED: dict[str, tuple[Field[Any], Flag]] = {
    f.name: (f, flag) for f in fields(StudyConfig) if (flag := flag_of(f)) is not None
}
# the fields' types (the annotations are strings)
_HINTS = typing.get_type_hints(StudyConfig)


def _item_type(f: Field[Any]) -> Any:
    """The type one command-line word of a field converts to: ``int | None`` -> int, ``list[str]`` -> str."""
    hint = _HINTS[f.name]
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    return inner[0] if inner else hint


def _keywords(f: Field[Any], flag: Flag) -> dict[str, Any]:
    """``add_argument``'s keywords for a field's flag; an absent flag parses to None (the preset's value,
    else the field's default)."""
    kw: dict[str, Any] = dict(dest=f.name, default=None, help=flag.help)
    if flag.metavar is not None:
        kw["metavar"] = flag.metavar
    if flag.choices is not None:
        kw["choices"] = flag.choices
    if flag.kind in ("on", "off", "switch"):
        kw.update(action="store_const", const=flag.kind != "off")
    elif flag.kind == "pairs":
        kw["action"] = "append"
    else:
        kw["type"] = int if flag.kind == "count" else _item_type(f)
        if flag.kind == "list":
            kw["nargs"] = "+"
    return kw


def add_field_options(
    p: argparse.ArgumentParser, after: dict[str, Callable[[Any], None]] | None = None
) -> None:
    """One option per flagged :class:`StudyConfig` field (two for a ``switch``), in field order, under
    its group's title; ``after[name](container)`` adds options that are not fields right after field
    ``name``'s, to the same group or mutually exclusive set."""
    sections: dict[str | None, Any] = {None: p}
    exclusive: dict[str, Any] = {}
    for f, flag in _FLAGGED.values():
        if flag.group not in sections:
            sections[flag.group] = p.add_argument_group(flag.group)
        target = sections[flag.group]
        if flag.exclusive is not None:
            if flag.exclusive not in exclusive:
                exclusive[flag.exclusive] = target.add_mutually_exclusive_group()
            target = exclusive[flag.exclusive]
        elif flag.kind == "switch":
            target = target.add_mutually_exclusive_group()
        target.add_argument(flag_name(f), **_keywords(f, flag))
        if flag.kind == "switch" and flag.negative is not None:
            help_ = argparse.SUPPRESS if flag.negative_help is None else flag.negative_help
            target.add_argument(flag.negative, dest=f.name, action="store_const", const=False, help=help_)
        if after and f.name in after:
            after[f.name](target)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``study`` subcommand's options: one per :class:`StudyConfig` field with a flag, and those of
    the command itself (``--ablation``, ``--first-seed``, ``--out``, ``--resume``, ``--overwrite``)."""
    ablation = "all 8 combinations of AutoAugment, CutMix and label smoothing"
    first_seed = "seeds are S, S+1, ... (default 0)"
    add_field_options(
        p,
        after={
            "protocols": lambda g: g.add_argument("--ablation", action="store_true", help=ablation),
            "seeds": lambda g: g.add_argument(
                "--first-seed", type=int, default=0, metavar="S", help=first_seed
            ),
        },
    )
    p.add_argument(
        "--out", metavar="DIR", help="output folder (default runs/study-<dataset>-<preset>-<hash>)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the study in --out with its own configuration (other options but runtime "
        "ones are ignored); an unfinished study of the same configuration resumes anyway",
    )
    p.add_argument("--overwrite", action="store_true", help="delete an earlier study in --out first")
    p.add_argument("--stop-after-epochs", type=int, help=argparse.SUPPRESS)  # simulated interruption (tests)


def _count(name: str, n: int | None, first: int) -> list[int] | None:
    """A ``count`` flag's field value: ``n`` consecutive integers from ``first`` (None and ``first`` 0:
    not given)."""
    if n is None:
        return [first] if first else None
    if n < 1:
        raise ConfigError(f"{name} must be >= 1, got {n}", name)
    return list(range(first, first + n))


def field_values(args: argparse.Namespace) -> dict[str, Any]:
    """The value of every flagged :class:`StudyConfig` field on the command line, None where not given
    (``--model-arg`` pairs parsed, ``--seeds N`` counted from ``--first-seed``)."""
    values: dict[str, Any] = {}
    for name, (_, flag) in _FLAGGED.items():
        value = getattr(args, name)
        if flag.kind == "pairs":
            value = parse_model_args(value) or None
        elif flag.kind == "count":
            value = _count(name, value, getattr(args, flag.start) if flag.start else 0)
        values[name] = value
    return values


def _runtime(args: argparse.Namespace, dataset: str | None) -> dict[str, Any]:
    """The runtime fields: as given, else the field's default; loader workers default to 0 on the
    in-memory datasets (scenes, digits), else 2."""
    defaults = {f.name: f.default for f in fields(StudyConfig)}
    values = {k: defaults[k] if getattr(args, k) is None else getattr(args, k) for k in RUNTIME_KEYS}
    if args.workers is None:
        values["workers"] = 0 if dataset in (None, "scenes", "digits") else 2
    return values


def config_of(args: argparse.Namespace) -> StudyConfig:
    """The :class:`StudyConfig` of the command line: the preset and the fields given (for ``--resume``:
    the one stored in ``--out``, with the runtime fields of the command line)."""
    if args.resume:
        if not args.out:
            raise ValueError("--resume needs --out DIR (the folder of the study to continue)")
        from ..study.results import load_results

        path = Path(args.out) / "results.json"
        if not path.is_file():
            raise FileNotFoundError(f"nothing to resume: {str(path)!r} does not exist")
        stored = StudyConfig.from_dict(load_results(path)["config"])
        return stored.with_runtime(**_runtime(args, stored.dataset))
    values = field_values(args)
    if args.ablation:
        values["protocols"] = list(PROTOCOLS)
    values.update(_runtime(args, values["dataset"]))
    return make_config(values.pop("preset") or StudyConfig.preset, **values)


def option_of(field: str) -> str:
    """The ``vitattn study`` option of a :class:`StudyConfig` field (or ``run_study`` argument):
    ``epochs`` -> ``--epochs``, ``label_smoothing`` -> ``--smoothing``; the field's name when no option
    sets it."""
    if field in _FLAGGED:
        return flag_name(_FLAGGED[field][0])
    option = "--" + field.replace("_", "-")
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return option if option in parser._option_string_actions else field


def run(args: argparse.Namespace) -> int:
    """Run ``vitattn study``; 0 on success (also when stopped on purpose), 2 with one line on stderr on a
    usage, data or checkpoint error (found before anything is written), 130 when interrupted with
    Ctrl-C (rerun to resume). Errors in a study's inputs name the option (``--epochs``)."""
    from ..study.runner import run_study

    try:
        config = config_of(args)
        run_study(config, args.out, overwrite=args.overwrite, stop_after_epochs=args.stop_after_epochs)
    except ConfigError as err:
        return report_error(NAME, ValueError(err.render(option_of)))
    except USAGE_ERRORS as err:
        return report_error(NAME, err)
    except KeyboardInterrupt:
        print(
            "\nvitattn study: interrupted; run the same command again (or --resume --out DIR) to continue "
            "from the last finished epoch",
            file=sys.stderr,
        )
        return 130
    return 0
