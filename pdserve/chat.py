"""`pdserve chat --server HOST:PORT`: a conversation in the terminal with a router or a
colocated node.

Every turn sends the whole conversation so far as `messages` (the `--system` message, then
user and assistant turns), so the server applies the model's chat template and stops at its
end of turn; the answer prints as it streams. Every turn carries the session's
`prompt_cache_key`, so the routers send it to the nodes that hold the turns before. Turns
are read by `chat_input.TurnReader`: line editing and history on a terminal, `\"\"\"`
blocks and pastes as one turn, one line a turn from a pipe. Invariants:
- stdout carries the answers and nothing else (`pdserve chat < turns > answers` gives the
  answers); the rest goes to stderr: the banner, replies to commands, errors, and marks
  where an answer ended early (`[answer cut at --max-tokens N]`, `[answer stopped]`).
- The conversation holds only the turns that were answered: a turn that fails (`error:
  CODE: details`) or that Ctrl-C stops is forgotten, and the chat goes on. An answer cut
  at --max-tokens was answered, and stays.
- Ctrl-C during an answer cancels its call, which aborts the request on the server (the
  router's or node's cleanup of a cancelled call), and the chat goes on. At the prompt it
  drops the line (a key there, never lost: chat_input); a second one in a row ends the
  chat, as do `/exit` and end of input (Ctrl-D), with status 0.
- A server that cannot be reached (the first call, GetModelInfo, fails) ends the chat at
  once with one line on stderr and status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path

DEFAULT_TEMPERATURE = 0.7  # a chat samples; --temperature 0 answers greedily
DEFAULT_MAX_TOKENS = 256
CONNECT_TIMEOUT_S = 10.0  # for the first call, which tells whether the server is there
COMMANDS = {
    "/help": "this list",
    "/reset": "forget the conversation (the system message stays)",
    "/exit": "end the chat (also Ctrl-D)",
}
HELP = "\n".join([*(f"{name:<8} {what}" for name, what in COMMANDS.items()),
                  '"""      opens a message of several lines, up to a line that ends with """',
                  "         (a message that starts with / goes in one too)",
                  "Ctrl-C   stops an answer; at the prompt, drops the line (twice: ends the chat)",
                  "Up/Down  earlier turns; a paste of several lines is one turn"])


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


def say(text: str) -> None:
    """What the chat itself says (everything but answers): on stderr."""
    print(text, file=sys.stderr, flush=True)


async def answer(client, messages: list[dict], sampling: dict, timeout: float | None,
                 shown: list[str]) -> str:
    """Stream the reply to `messages` onto stdout, each piece also into `shown`; its
    finish reason."""
    finish = ""
    async for msg in client.responses(messages=messages, timeout=timeout, **sampling):
        if msg.index == 0 and msg.text:
            print(msg.text, end="", flush=True)
            shown.append(msg.text)
        if msg.index == 0 and msg.finish_reason:
            finish = msg.finish_reason
    return finish


class Chat:
    """One session: the conversation, and the client that answers it on `runner`'s loop."""

    def __init__(self, runner: asyncio.Runner, client, args) -> None:
        self.runner, self.client = runner, client
        self.conversation = Conversation(args.system)
        # One key for the session: every turn goes to the nodes that hold the turns before.
        self.sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=args.seed, prompt_cache_key=f"pdserve-chat-{uuid.uuid4().hex}")
        self.timeout = args.timeout

    def ask(self, text: str) -> None:
        from pdserve.client import PdserveError

        shown: list[str] = []
        try:
            finish = self.runner.run(answer(self.client, self.conversation.messages(text),
                                            self.sampling, self.timeout, shown))
        except KeyboardInterrupt:  # the Runner cancelled the answer's task, and so its call
            print(flush=True)
            say("[answer stopped]")
            return
        except PdserveError as err:
            if shown:
                print(flush=True)
            say(f"error: {err.code().name}: {err.details()}")
            return
        print(flush=True)
        if finish == "length":
            say(f"[answer cut at --max-tokens {self.sampling['max_tokens']}]")
        self.conversation.add_turn(text, "".join(shown))

    def command(self, text: str) -> bool:
        """Run a /command; False when it ends the chat."""
        if text == "/exit":
            return False
        if text == "/help":
            say(HELP)
        elif text == "/reset":
            self.conversation.reset()
            say("conversation forgotten" + (" (the system message stays)"
                                            if self.conversation.system else ""))
        else:
            say(f"unknown command {text.split()[0]}; commands: {', '.join(COMMANDS)}")
        return True


def cmd_chat(args) -> int:
    from pdserve.chat_input import TurnReader
    from pdserve.credentials import client_api_key, configure_tls

    configure_tls(args)
    api_key = client_api_key(args)
    interactive = sys.stdin.isatty()
    with asyncio.Runner() as runner:
        client = runner.run(_open(args.server, api_key))
        try:
            model = runner.run(_model(client, args.server))
            if model is None:
                return 1
            chat = Chat(runner, client, args)
            reader = TurnReader(interactive, Path(args.history) if args.history else None)
            if interactive:
                say(f"pdserve chat: {model.id} at {args.server} "
                    f"({'a colocated node' if model.role == 'both' else model.role}). "
                    "/help lists the commands; Ctrl-D ends the chat.")
            converse(chat, reader)
        finally:
            runner.run(client.close())
    return 0


def converse(chat: Chat, reader) -> None:
    """Turns until /exit, the end of input or two Ctrl-C in a row at the prompt."""
    interrupted = False  # the last thing at the prompt was a Ctrl-C
    while True:
        try:
            turn = reader.read()
            if turn.command:
                if not chat.command(turn.command):
                    return
            elif turn.text:
                chat.ask(turn.text)
        except EOFError:
            if reader.interactive:  # the shell's prompt starts on a line of its own
                print()
            return
        except KeyboardInterrupt as err:  # at the prompt (an answer's own is caught in ask)
            if not getattr(err, "line_ended", False):  # a signal: the cursor is after the prompt
                print()
            if interrupted:
                return
            say("(Ctrl-C again, Ctrl-D or /exit ends the chat)")
            interrupted = True
            continue
        interrupted = False


async def _open(server: str, api_key: str | None):
    from pdserve.client import AsyncClient

    return AsyncClient(server, api_key=api_key)  # its channel belongs to the Runner's loop


async def _model(client, server: str):
    """The served model, or None after saying why the server cannot be used."""
    import grpc

    from pdserve.client import PdserveError

    try:
        return (await asyncio.wait_for(client.models(), CONNECT_TIMEOUT_S))[0]
    except TimeoutError:
        say(f"pdserve chat: no answer from {server} within {CONNECT_TIMEOUT_S:g} s")
    except PdserveError as err:
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            say(f"pdserve chat: cannot reach {server} ({err})")
        else:
            say(f"pdserve chat: {server} refused: {err}")
    return None


def add_chat_parser(sub) -> None:
    """`pdserve chat` under the subcommands `sub`."""
    from pdserve.chat_input import default_history
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
    p.add_argument("--history", default=str(default_history()), metavar="FILE",
                   help="where a terminal's turns are kept for the next chat; '' keeps none "
                        "(default: %(default)s)")
    add_options(p.add_argument_group("TLS (runtime/tls.py)"), TLSConfig)
    add_options(p.add_argument_group("authentication (runtime/auth.py)"), APIKeyConfig)
    p.set_defaults(func=cmd_chat)
