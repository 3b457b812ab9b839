"""How a :class:`~vitattn.study.config.StudyConfig` field is set on the command line, stated with the
field: ``field(..., metadata={"flag": Flag(...)})`` through :func:`option`. ``vitattn study`` builds
its flags (help, choices, metavar, groups) from these, and turns the parsed values back into the
field values (:mod:`vitattn.cli.study`); a field made by :func:`no_option` has none, on purpose.

What the flag of each kind takes and gives the field (an absent flag gives None: the preset's value,
else the field's default):

=========  ========================================================================================
``value``  ``--flag X``, converted to the field's type (``int``, ``float``, ``str``)
``list``   ``--flag X [X ...]``, each converted to the list's item type
``pairs``  ``--flag KEY=VALUE``, repeatable: a dict of Python literals (strings otherwise)
``count``  ``--flag N``: N consecutive integers from the value of the option ``start`` names
           (``--seeds N`` from ``--first-seed``; 0 without one)
``on``     ``--flag``: True
``off``    ``--no-thing``: False (``--no-probe``, ``--no-progress``)
``switch`` ``--flag`` True, ``negative`` (``--no-flag``) False; at most one of the two
=========  ========================================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, Field, dataclass, field
from typing import Any, Literal

__all__ = ["Flag", "FlagKind", "flag_name", "flag_of", "no_option", "option"]

FlagKind = Literal["value", "list", "pairs", "count", "on", "off", "switch"]


@dataclass(frozen=True)
class Flag:
    """The command-line form of a field: its ``help``; ``name`` (None: ``--field-name``), ``metavar``,
    ``choices`` and ``kind`` (see the module); ``negative`` and ``negative_help`` (``switch``: the flag
    that gives False, its help; None hides it); the argparse ``group`` title it is listed under and
    the ``exclusive`` set it belongs to (flags of one set exclude each other); ``start`` (``count``):
    the destination of the option that gives the first integer."""

    help: str
    name: str | None = None
    metavar: str | None = None
    choices: Sequence[Any] | None = None
    kind: FlagKind = "value"
    negative: str | None = None
    negative_help: str | None = None
    group: str | None = None
    exclusive: str | None = None
    start: str | None = None


def option(default: Any = MISSING, *, factory: Any = MISSING, runtime: bool = False, **flag: Any) -> Any:
    """A dataclass field with its :class:`Flag` (``flag``: its arguments) in ``metadata["flag"]``;
    ``runtime``: the field does not change what a run computes (it may differ on resume)."""
    metadata = {"flag": Flag(**flag), "runtime": runtime}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def no_option(default: Any = MISSING, *, factory: Any = MISSING, runtime: bool = False) -> Any:
    """A dataclass field that has no command-line option, stated as such (``metadata["flag"]`` None)."""
    metadata = {"flag": None, "runtime": runtime}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_of(f: Field[Any]) -> Flag | None:
    """The :class:`Flag` of a dataclass field, None when it has no option."""
    flag = f.metadata.get("flag")
    return flag if isinstance(flag, Flag) else None


def flag_name(f: Field[Any]) -> str:
    """The option string of a field's flag: its ``name``, else ``--`` + the field name with dashes."""
    flag = flag_of(f)
    if flag is not None and flag.name is not None:
        return flag.name
    return "--" + f.name.replace("_", "-")
