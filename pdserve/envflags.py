"""Every command-line flag can also be set by an environment variable.

`--foo-bar` reads `PDSERVE_FOO_BAR` as its default, so containers are configured with
environment variables alone (docker-compose `environment:`, a Kubernetes ConfigMap) while
a flag on the command line still wins. The rule is applied to a finished parser, every
subcommand included, so a flag added later gets its variable without any extra code;
`--help` names each variable.

Values are read the way the flag reads them: through the flag's `type` and checked
against its `choices`; a switch (`store_true`) takes 1/true/yes/on or 0/false/no/off; a
repeatable flag (`append`, or one of several values at once: `extend`) takes a
comma-separated list, which the flag's values on the command line replace. A variable that sets a required flag makes the flag optional. An
empty variable is as if unset (a compose override file can clear one that way).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

PREFIX = "PDSERVE_"
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}


def env_name(action: argparse.Action) -> str | None:
    """`--foo-bar` -> `PDSERVE_FOO_BAR`; None for positionals and `--help`."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    if not longs or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    return PREFIX + longs[0][2:].replace("-", "_").upper()


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str):
    if isinstance(action, (argparse._StoreConstAction, argparse._StoreTrueAction)):
        word = raw.strip().lower()
        if word not in TRUE | FALSE:
            parser.error(f"{name}={raw!r}: expected one of {sorted(TRUE | FALSE - {''})}")
        return action.const if word in TRUE else action.default

    def one(text: str):
        try:
            value = action.type(text) if action.type else text
        except (TypeError, ValueError) as err:
            parser.error(f"{name}={raw!r}: {err}")
        if action.choices is not None and value not in action.choices:
            parser.error(f"{name}={raw!r}: must be one of {list(action.choices)}")
        return value

    if isinstance(action, argparse._AppendAction):
        return [one(part) for part in raw.split(",") if part]
    return one(raw)


class _AppendReplacingEnv(argparse._AppendAction):
    """argparse appends to a list default; a list that came from the environment is
    replaced instead, so the command line wins here too."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


class _ExtendReplacingEnv(argparse._ExtendAction):
    """As `_AppendReplacingEnv`, for a flag that takes several values at once."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


def apply_env_defaults(parser: argparse.ArgumentParser,
                       environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Give every `--flag` of `parser` and its subcommands a `PDSERVE_FLAG` default."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                apply_env_defaults(sub, environ)
            continue
        name = env_name(action)
        if name is None:
            continue
        if action.help is not argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env: {name}]".lstrip()
        if environ.get(name, "") != "":
            action.default = _convert(parser, action, name, environ[name])
            action.required = False
            if type(action) is argparse._AppendAction:
                action.__class__ = _AppendReplacingEnv
            elif type(action) is argparse._ExtendAction:
                action.__class__ = _ExtendReplacingEnv
    return parser
