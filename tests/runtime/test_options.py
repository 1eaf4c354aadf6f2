"""Flags from configuration dataclasses: a field's default and help become its flag's, once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from pdserve.runtime.options import add_options, from_args, option


@dataclass
class Example:
    name: str
    rate: float = option(0.5, "how often")
    count: int | None = option(None, "how many (default: as many as fit)", type=int)
    fast: bool = option(False, "go fast")
    careful: bool = option(True, "do not be careful")
    enabled: bool = option(True, "switch it off", flag="--no-switch")
    kind: str = option("a", "which kind", choices=("a", "b"))
    targets: list[str] = option(help="repeat for several", default_factory=list)
    internal: int = 7  # no help: not a flag


def parser(**defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_options(p, Example, defaults=defaults)
    return p


def test_defaults_come_from_the_fields_and_only_fields_with_help_are_flags():
    args = parser().parse_args([])
    built = from_args(Example, args, name="x")
    assert built == Example(name="x")
    assert not hasattr(args, "internal")
    assert "(default: 0.5)" in parser().format_help()


def test_values_are_typed_and_switches_follow_their_default():
    args = parser().parse_args(["--rate", "2", "--count", "3", "--fast", "--no-careful",
                                "--no-switch", "--kind", "b", "--targets", "p", "--targets", "q"])
    built = from_args(Example, args, name="x")
    assert (built.rate, built.count, built.fast, built.careful, built.enabled) == \
        (2.0, 3, True, False, False)
    assert (built.kind, built.targets) == ("b", ["p", "q"])


def test_a_parser_may_give_a_field_another_default_and_choices_are_enforced():
    assert parser(rate=9.0).parse_args([]).rate == 9.0
    with pytest.raises(SystemExit):
        parser().parse_args(["--kind", "c"])


def test_flag_name_is_the_flag_the_parser_takes():
    from dataclasses import fields

    from pdserve.runtime.options import flag_name

    names = {f.name: flag_name(f) for f in fields(Example) if f.metadata}
    assert names == {"rate": "--rate", "count": "--count", "fast": "--fast", "careful": "--no-careful",
                     "enabled": "--no-switch", "kind": "--kind", "targets": "--targets"}
    for flag in names.values():  # every one parses
        assert flag in parser().format_help()
