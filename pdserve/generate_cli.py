"""`pdserve generate`: one request to a router or colocated node, from the terminal.

The prompt is `--prompt TEXT`, `--prompt-file PATH` (`-`: standard input), or a
conversation of `--message ROLE:CONTENT` (repeatable; rendered with the model's chat
template on the server). One choice streams as it comes; with `--n` > 1 every choice is
printed once complete, each under its index and finish reason. `--logprobs N` prints each
token (its id and its text, which the server fills in) with its log-probability and its N
most likely alternatives; `--prompt-logprobs N` prints the same of the prompt's tokens
first (scoring a text); `--presence-penalty`, `--frequency-penalty`, `--repetition-penalty`
and `--logit-bias ID:BIAS` hold what the text has said against it; `--min-tokens N` and
`--bad-word WORD` ban tokens (a stop before N tokens, a word); `--json-schema`,
`--json-object`, `--regex` and `--choice` hold the answer to a structure; `--json` prints the whole `Completion` (every choice, logprobs,
usage with timings and route) as one JSON object.
"""

from __future__ import annotations

import argparse
import sys

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop",
                  "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "bad_words",
                  "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids")


def add_generate_parser(sub) -> None:
    from pdserve.runtime.auth import APIKeyConfig
    from pdserve.runtime.options import add_options
    from pdserve.runtime.tls import TLSConfig

    p = sub.add_parser("generate", help="send one prompt to a router or colocated node")
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT (default: %(default)s)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", metavar="PATH", help="read the prompt from PATH (- : stdin)")
    prompt.add_argument("--message", action="append", metavar="ROLE:CONTENT",
                        help="a chat turn, e.g. --message 'user:Hi' (repeat for a conversation)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (server default 16)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default off)")
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than this share of the most likely (default 0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible output")
    p.add_argument("--n", type=int, default=None, help="choices to generate (default 1)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop before this text (repeatable)")
    p.add_argument("--stop-token-ids", type=_ids, default=None, metavar="ID,ID",
                   help="stop after any of these token ids")
    p.add_argument("--include-stop-str-in-output", action="store_true", default=None,
                   help="keep the stop string that ended the text at its end")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=None,
                   help="leave special tokens such as <|im_start|> out of the text (default: yes)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each token's id, text and log-probability, and its N most "
                        "likely alternatives")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="print the same of each prompt token after the first, before the choices")
    p.add_argument("--presence-penalty", type=float, default=None, metavar="P",
                   help="lower each token the output has used by P, in [-2, 2] (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=None, metavar="F",
                   help="lower each token by F times its count in the output, in [-2, 2] (default 0)")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="divide the logit of each token of the prompt or output by R (> 1 "
                        "discourages repeats; default 1, off)")
    p.add_argument("--logit-bias", type=_bias, action="append", default=None, metavar="ID:BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit (repeatable; -100 bans it)")
    p.add_argument("--min-tokens", type=int, default=None, metavar="N",
                   help="no stop token or stop string ends the answer before N tokens (default 0)")
    p.add_argument("--bad-word", dest="bad_words", action="append", default=None, metavar="WORD",
                   help="never write WORD (repeatable)")
    p.add_argument("--allowed-token-ids", type=_ids, default=None, metavar="ID,ID",
                   help="sample only these token ids (an EOS not listed is never sampled)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA|@FILE",
                       help="the answer is JSON matching this JSON Schema (text, or @ and a file)")
    shape.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    shape.add_argument("--regex", metavar="PATTERN", help="the answer matches this regular expression")
    shape.add_argument("--choice", action="append", metavar="TEXT",
                       help="the answer is one of these texts (repeat for each)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (every choice, logprobs, usage) at the end")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--priority", type=int, default=0,
                   help="lower waits less where requests queue (default 0; vLLM's priority)")
    p.add_argument("--prompt-cache-key", default="", metavar="KEY",
                   help="requests with the same key go to the same nodes, where their shared "
                        "prefixes are cached (OpenAI's prompt_cache_key)")
    add_options(p.add_argument_group("TLS (runtime/tls.py)"), TLSConfig)
    add_options(p.add_argument_group("authentication (runtime/auth.py)"), APIKeyConfig)
    p.set_defaults(func=cmd_generate)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be integers separated by commas, "
                                         f"got {text!r}") from None


def _bias(text: str) -> tuple[int, float]:
    token, _, bias = text.partition(":")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a logit bias must be TOKEN_ID:BIAS, e.g. 13:-100, "
                                         f"got {text!r}") from None


def structure_of(args) -> dict | None:
    """The request's `structured_output` from --json-schema, --json-object, --regex or --choice."""
    if args.json_schema is not None:
        if not args.json_schema.startswith("@"):
            return {"json_schema": args.json_schema}
        with open(args.json_schema[1:], encoding="utf-8") as f:
            return {"json_schema": f.read()}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    return {"choice": {"choices": args.choice}} if args.choice else None


def prompt_of(args) -> dict:
    """The request's prompt keyword: `prompt` (text) or `messages`."""
    if args.message:
        messages = []
        for turn in args.message:
            role, sep, content = turn.partition(":")
            if not sep or not role:
                raise SystemExit(f"pdserve generate: --message must be ROLE:CONTENT, got {turn!r}")
            messages.append({"role": role, "content": content})
        return {"messages": messages}
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            return {"prompt": sys.stdin.read()}
        with open(args.prompt_file, encoding="utf-8") as f:
            return {"prompt": f.read()}
    return {"prompt": args.prompt}


def cmd_generate(args) -> int:
    import json

    from pdserve.client import Client, PdserveError
    from pdserve.credentials import client_api_key, configure_tls

    configure_tls(args)
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    if args.logit_bias is not None:
        sampling["logit_bias"] = dict(args.logit_bias)
    sampling["structured_output"] = structure_of(args)
    request = {**prompt_of(args), "priority": args.priority, "prompt_cache_key": args.prompt_cache_key}
    try:
        with Client(args.server, api_key=client_api_key(args), timeout=args.timeout) as client:
            if args.json or (args.n or 1) > 1 or args.logprobs is not None \
                    or args.prompt_logprobs is not None:
                out = client.generate(**request, **sampling)
                print(json.dumps(out.to_dict()) if args.json else show(out, args.logprobs is not None))
                return 0
            for delta in client.stream(**request, **sampling):
                print(delta.text, end="", flush=True)
            print()
            return 0
    except PdserveError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def show(out, with_logprobs: bool) -> str:
    """Every choice under its index and finish reason, and its tokens' logprobs if asked."""
    lines = []
    if out.prompt_logprobs is not None:
        lines.append("--- prompt")
        lines += map(_entry_line, out.prompt_logprobs)
    for choice in out.choices:
        lines.append(f"--- choice {choice.index} ({choice.finish_reason})")
        lines.append(choice.text)
        if with_logprobs:
            lines += map(_entry_line, choice.logprobs or [])
    return "\n".join(lines)


def _entry_line(entry) -> str:
    top = "  ".join(f"{t.token_id} {t.token!r} {t.logprob:.4f}" for t in entry.top)
    return f"  token {entry.token_id:>6} {entry.token!r:<14} logprob {entry.logprob:9.4f}   {top}"
