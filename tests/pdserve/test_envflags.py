"""Every `pdserve` flag `--foo-bar` also reads PDSERVE_FOO_BAR; the command line wins."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli import build_parser


def parse(argv, monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(argv)


def test_environment_sets_flags_of_every_type(monkeypatch):
    args = parse(["decode"], monkeypatch, PDSERVE_PORT="7000", PDSERVE_MODEL="/m",
                 PDSERVE_NOTIFICATION_TIMEOUT_S="2.5", PDSERVE_DTYPE="bfloat16",
                 PDSERVE_NO_PREFIX_CACHE="true")
    assert (args.port, args.model, args.notification_timeout_s) == (7000, "/m", 2.5)
    assert args.dtype == "bfloat16" and args.enable_prefix_cache is False


def test_command_line_wins_over_environment(monkeypatch):
    args = parse(["prefill", "--port", "8000"], monkeypatch, PDSERVE_PORT="7000")
    assert args.port == 8000


def test_environment_satisfies_a_required_repeatable_flag(monkeypatch):
    args = parse(["router"], monkeypatch, PDSERVE_DECODE="a:1,b:2", PDSERVE_PREFILL="p:3")
    assert args.decode == ["a:1", "b:2"] and args.prefill == ["p:3"]


def test_unset_environment_leaves_defaults_and_required_flags(monkeypatch):
    for name in ("PDSERVE_PORT", "PDSERVE_DECODE"):
        monkeypatch.delenv(name, raising=False)
    assert build_parser().parse_args(["prefill"]).port == 50061
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router"])


def test_an_empty_variable_is_as_if_unset(monkeypatch):
    # deploy/docker-compose.cuda.yml clears the CPU's KV size so the GPU's fraction sizes the pool
    args = parse(["decode"], monkeypatch, PDSERVE_KV_CACHE_MB="", PDSERVE_PORT="", PDSERVE_DTYPE="")
    assert (args.kv_cache_mb, args.port, args.dtype) == (None, 50062, "float32")
    with pytest.raises(SystemExit):
        parse(["router"], monkeypatch, PDSERVE_DECODE="")  # a required flag stays required


@pytest.mark.parametrize("name,value", [("PDSERVE_PORT", "eighty"),
                                        ("PDSERVE_DTYPE", "int3"),
                                        ("PDSERVE_NO_PREFIX_CACHE", "maybe")])
def test_a_bad_value_names_the_variable(monkeypatch, capsys, name, value):
    with pytest.raises(SystemExit):
        parse(["serve"], monkeypatch, **{name: value})
    assert name in capsys.readouterr().err


def test_help_names_the_variable_of_every_flag():
    text = build_parser().format_help()
    assert "PDSERVE_" not in text  # the top level has no flags of its own
    sub = build_parser()._subparsers._group_actions[0].choices
    for name, p in sub.items():
        for action in p._actions:
            longs = [s for s in action.option_strings if s.startswith("--") and s != "--help"]
            if longs and action.help != argparse.SUPPRESS:  # hidden flags stay hidden
                expected = "PDSERVE_" + longs[0][2:].replace("-", "_").upper()
                assert f"[env: {expected}]" in action.help, f"{name} {longs[0]}"


def test_command_line_replaces_a_repeatable_flag_from_environment(monkeypatch):
    args = parse(["router", "--decode", "c:3", "--decode", "d:4"], monkeypatch,
                 PDSERVE_DECODE="a:1,b:2")
    assert args.decode == ["c:3", "d:4"]


def test_command_line_replaces_a_several_valued_flag_from_environment(monkeypatch):
    env = {"PDSERVE_LORA_MODULES": "a=/x,b=/y"}
    assert parse(["decode"], monkeypatch, **env).lora_modules == ["a=/x", "b=/y"]
    args = parse(["decode", "--lora-modules", "c=/z", "d=/w", "--lora-modules", "e=/v"], monkeypatch, **env)
    assert args.lora_modules == ["c=/z", "d=/w", "e=/v"]
