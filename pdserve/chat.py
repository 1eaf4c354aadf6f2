"""`pdserve chat --server HOST:PORT`: a conversation in the terminal with a router or a
colocated node.

Every turn sends the whole conversation so far as `messages` (the `--system` message, then
user and assistant turns), so the server applies the model's chat template and stops at its
end of turn; the answer prints as it streams. Invariants:
- The conversation holds only completed turns: a turn that fails (`error: CODE: details`
  on stderr) is forgotten, and the chat goes on.
- Input is read line by line, one line a user turn, so a script can pipe turns in; the
  `> ` prompt shows only when stdin is a terminal. `/reset` forgets the conversation (the
  system message stays), `/exit`, end of input or Ctrl-C end the chat with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

DEFAULT_TEMPERATURE = 0.7  # a chat samples; --temperature 0 answers greedily
DEFAULT_MAX_TOKENS = 256


class Conversation:
    """The messages sent each turn: the system message, then completed turns."""

    def __init__(self, system: str | None) -> None:
        self.system = system
        self.turns: list[dict] = []

    def messages(self, user_text: str) -> list[dict]:
        opening = [{"role": "system", "content": self.system}] if self.system else []
        return [*opening, *self.turns, {"role": "user", "content": user_text}]

    def add_turn(self, user_text: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": user_text},
                       {"role": "assistant", "content": answer}]

    def reset(self) -> None:
        self.turns.clear()


async def answer(client, messages: list[dict], sampling: dict, timeout: float | None,
                 shown: list[str]) -> None:
    """Stream the reply to `messages` onto stdout, each piece also into `shown`."""
    async for msg in client.responses(messages=messages, timeout=timeout, **sampling):
        if msg.index == 0 and msg.text:
            print(msg.text, end="", flush=True)
            shown.append(msg.text)


def cmd_chat(args) -> int:
    import grpc

    from pdserve.credentials import client_api_key, configure_tls

    configure_tls(args)
    api_key = client_api_key(args)
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    conversation = Conversation(args.system)
    prompt = "> " if sys.stdin.isatty() else ""
    with asyncio.Runner() as runner:
        client = runner.run(_open(args.server, api_key))
        try:
            while True:
                line = input(prompt).strip()
                if line == "/exit":
                    break
                if line == "/reset":
                    conversation.reset()
                    continue
                if not line:
                    continue
                shown: list[str] = []
                try:
                    runner.run(answer(client, conversation.messages(line), sampling,
                                      args.timeout, shown))
                except grpc.aio.AioRpcError as err:
                    if shown:
                        print(flush=True)
                    print(f"error: {err.code().name}: {err.details()}", file=sys.stderr, flush=True)
                    continue
                print(flush=True)
                conversation.add_turn(line, "".join(shown))
        except (EOFError, KeyboardInterrupt):
            if prompt:  # the shell's prompt starts on a line of its own
                print()
        finally:
            runner.run(client.close())
    return 0


async def _open(server: str, api_key: str | None):
    from pdserve.client import AsyncClient

    return AsyncClient(server, api_key=api_key)  # its channel belongs to the Runner's loop


def add_chat_parser(sub) -> None:
    """`pdserve chat` under the subcommands `sub`."""
    from pdserve.runtime.auth import APIKeyConfig
    from pdserve.runtime.options import add_options
    from pdserve.runtime.tls import TLSConfig

    p = sub.add_parser("chat", help="chat with a router or colocated node in the terminal",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT (default: %(default)s)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="system message that opens the conversation (default: none, the "
                        "template's own)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="most tokens of one answer (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    p.add_argument("--timeout", type=float, default=None,
                   help="deadline of one answer in seconds (default: none)")
    add_options(p.add_argument_group("TLS (runtime/tls.py)"), TLSConfig)
    add_options(p.add_argument_group("authentication (runtime/auth.py)"), APIKeyConfig)
    p.set_defaults(func=cmd_chat)
