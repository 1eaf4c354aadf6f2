"""Command-line flags from configuration dataclasses: each flag's default and help are
written once, on the field they set.

A field whose metadata has `help` is a flag (`option()` writes that metadata; `engine`,
which imports nothing of ours, writes it with `dataclasses.field` directly). `--foo-bar`
sets field `foo_bar`; `flag` in the metadata names it otherwise. A bool field is a switch:
`--foo` when its default is False, `--no-foo` when it is True. The value type is the
default's, or `type` in the metadata (a field whose default is None needs it).
`add_options` puts a dataclass's flags on a parser; `from_args` builds the dataclass back
from the parsed flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def option(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
           type=None, choices=None, metavar: str | None = None,
           default_factory: Any = dataclasses.MISSING, nargs: str | None = None) -> Any:
    """A dataclass field that is also a command-line flag (`nargs`: a list field's flag
    takes several values at once)."""
    meta = {"help": help, "flag": flag, "type": type, "choices": choices, "metavar": metavar, "nargs": nargs}
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={k: v for k, v in meta.items() if v is not None})


def flag_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_name(f: dataclasses.Field, default: Any = dataclasses.MISSING) -> str:
    """The flag that sets field `f` (see the module docstring), under `default` if a
    parser gives it another."""
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    default = default_of(f) if default is dataclasses.MISSING else default
    if isinstance(default, bool) and "type" not in f.metadata:
        return ("--no-" if default else "--") + f.name.replace("_", "-")
    return "--" + f.name.replace("_", "-")


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_options(parser, cls, *, defaults: dict | None = None) -> None:
    """Add a flag for every option field of `cls`; `defaults` replaces a field's default
    for this parser (a port that depends on the command)."""
    defaults = defaults or {}
    for f in flag_fields(cls):
        meta = f.metadata
        default = defaults.get(f.name, default_of(f))
        name = flag_name(f, default)
        if isinstance(default, bool) and "type" not in meta:
            parser.add_argument(name, dest=f.name, default=default, help=meta["help"],
                                action="store_false" if default else "store_true")
            continue
        kind = meta.get("type") or type(default)
        text = meta["help"] + ("" if default is None else " (default: %(default)s)")
        extra = {k: meta[k] for k in ("choices", "metavar") if k in meta}
        if isinstance(default, list) and "nargs" in meta:  # several values, the flag given once or more
            parser.add_argument(name, dest=f.name, action="extend", nargs=meta["nargs"], default=default,
                                type=meta.get("type", str), help=meta["help"], **extra)
        elif isinstance(default, list):
            parser.add_argument(name, dest=f.name, action="append", default=default,
                                type=meta.get("type", str), help=meta["help"], **extra)
        else:
            parser.add_argument(name, dest=f.name, type=kind, default=default, help=text, **extra)


def from_args(cls, args: argparse.Namespace, **given):
    """`cls` from the parsed flags of its option fields, plus `given` fields."""
    values = {f.name: getattr(args, f.name) for f in flag_fields(cls)
              if hasattr(args, f.name) and f.name not in given}
    return cls(**values, **given)
