"""`pdserve chat` on a pseudo-terminal, as a person runs it, against the real `cluster`:
Ctrl-C stops an answer (the router logs it cancelled) and the same session answers the
next question; /help, an unknown command and /reset get their replies on stderr; the arrow
keys edit the line; a paste of two lines and a triple-quoted block are one turn each; the
history file keeps the one-line turns; and against a closed port the chat says so in one
line and exits 1."""

from __future__ import annotations

import codecs
import fcntl
import os
import re
import select
import subprocess
import sys
import termios
import time

from pdserve.procs import free_port
from pdserve.router.tokenizer import PromptTokenizer
from tests.cluster.nodes import wait_until
from tests.cluster.test_chat import greedy_answers, pdserve_chat, router_requests, user


class Terminal:
    """`pdserve chat ARGS` on a pseudo-terminal, as a person runs it: the terminal is its
    stdin, stdout, stderr and controlling terminal, so readline edits its lines and Ctrl-C
    (\\x03) reaches it as SIGINT from the terminal. `text` is everything it printed, escape
    sequences dropped and line ends as "\\n"; `expect` reads on from where it last stopped.
    Like a person, a test types at the prompt."""

    ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
    ARRIVING = re.compile(r"\x1b[^A-Za-z]*$")  # an escape sequence not yet complete

    def __init__(self, *args: str, home) -> None:
        master, slave = os.openpty()
        env = {**os.environ, "TERM": "xterm", "INPUTRC": os.devnull, "HOME": str(home)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "chat", *args], stdin=slave, stdout=slave,
            stderr=slave, env=env, start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.master, self.read_to = master, 0
        self.decoder, self.printed = codecs.getincrementaldecoder("utf-8")("replace"), ""
        self.ended = False  # the chat closed the terminal: nothing more will come

    @property
    def text(self) -> str:
        """What was printed so far; it only grows (sequences still arriving wait)."""
        return self.ESCAPES.sub("", self.ARRIVING.sub("", self.printed))

    def _read(self, timeout_s: float) -> None:
        if select.select([self.master], [], [], timeout_s)[0]:
            try:
                self.printed += self.decoder.decode(os.read(self.master, 65536))
            except OSError:  # the chat ended and closed the terminal
                self.ended = True

    def expect(self, pattern: str, timeout_s: float = 120) -> re.Match:
        """The first match of regex `pattern` past what was read before; fails after
        `timeout_s` showing what came."""
        deadline = time.monotonic() + timeout_s
        while not (found := re.compile(pattern).search(self.text, self.read_to)):
            assert not self.ended and time.monotonic() < deadline, \
                f"no {pattern!r} in {self.text[self.read_to:]!r}"
            self._read(0.05)
        self.read_to = found.end()
        return found

    def prompt(self) -> None:
        """Wait for the prompt: readline has the terminal then. (Keys sent before it meet
        the terminal's own line editing, where a Ctrl-D is no end of input to readline.)"""
        self.expect(r"(?m)^> ")

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        """Its exit status; it must end on its own (after /exit or Ctrl-D)."""
        return self.proc.wait(timeout=60)

    def __enter__(self) -> "Terminal":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # a test that failed half-way
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def chat_on_a_terminal(cluster, tmp_path, *flags: str) -> Terminal:
    return Terminal("--server", cluster.grpc, "--temperature", "0",
                    "--history", str(tmp_path / "history"), *flags, home=tmp_path)


def expect_the_banner(terminal: Terminal, cluster) -> None:
    found = terminal.expect(r"pdserve chat: (.*) at (.*) \((.*)\)\. /help")
    assert found.groups() == (cluster.model, cluster.grpc, "router")
    terminal.prompt()


def requests_after(cluster, seen: int, count: int) -> list[dict]:
    return wait_until(lambda: router_requests(cluster)[seen:] if
                      len(router_requests(cluster)) >= seen + count else None,
                      f"{count} requests of the chat")


CUT = r"\[answer cut at --max-tokens \d+\]"
AT_THE_PROMPT = r"\(Ctrl-C again, Ctrl-D or /exit ends the chat\)"


def test_ctrl_c_stops_an_answer_on_the_server_and_the_chat_answers_the_next_question(
        cluster, tmp_path):
    """A Ctrl-C that reaches the server after the whole answer (the tiny model writes its
    480 tokens in a fraction of a second, and a loaded machine can starve the test that
    long) tests nothing: then the test asks again, up to three times."""
    with chat_on_a_terminal(cluster, tmp_path, "--max-tokens", "480") as terminal:
        expect_the_banner(terminal, cluster)
        stopped, answered = stop_an_answer_then_ask_again(cluster, terminal)
    assert stopped["outcome"] == "cancelled", f"every answer ended before its Ctrl-C: {stopped}"
    assert stopped["completion_tokens"] < 480
    assert answered["outcome"] == "length" and answered["completion_tokens"] == 480
    # The stopped turn was forgotten: the next request is a conversation of one turn.
    assert answered["prompt_tokens"] == len(PromptTokenizer(cluster.model).chat_ids(
        [user("name a fox")]))


def stop_an_answer_then_ask_again(cluster, terminal: Terminal) -> tuple[dict, dict]:
    """The router's log of the answer that Ctrl-C stopped (the last try's), and of the
    next question's."""
    for _ in range(3):
        seen = len(router_requests(cluster))
        terminal.send("hello\n")
        terminal.expect("hello\n")
        terminal.expect("(?s).")  # the answer has begun
        terminal.send("\x03")
        ended = terminal.expect(rf"\[answer stopped\]|{CUT}|{AT_THE_PROMPT}").group()
        if ended != "[answer stopped]" and not re.fullmatch(AT_THE_PROMPT, ended):
            terminal.expect(AT_THE_PROMPT)  # the Ctrl-C came after the answer
        terminal.prompt()
        (asked,) = requests_after(cluster, seen, 1)
        if ended == "[answer stopped]" and asked["outcome"] == "cancelled":
            break
        terminal.send("/reset\n")  # an answer in full would fill the context of the next
        terminal.expect("conversation forgotten\n")
        terminal.prompt()
    seen = len(router_requests(cluster))
    terminal.send("name a fox\n")
    terminal.expect(CUT)  # answered in full, in the same session
    terminal.prompt()
    terminal.send("\x04")
    assert terminal.close() == 0
    return asked, requests_after(cluster, seen, 1)[0]


def test_a_terminal_chat_answers_commands_edits_lines_and_sends_a_paste_as_one_turn(
        cluster, tmp_path):
    tokenizer = PromptTokenizer(cluster.model)
    seen = len(router_requests(cluster))
    with chat_on_a_terminal(cluster, tmp_path, "--max-tokens", "4") as terminal:
        expect_the_banner(terminal, cluster)
        for keys, reply in [
                ("/help\n", r"/reset +forget the conversation"),
                ("/nonsense\n", r"unknown command /nonsense; commands: /help, /reset, /exit\n"),
                ("name a fx\x1b[Do\n", CUT),  # the left arrow moves back: "name a fox"
                ("/reset\n", "conversation forgotten\n"),
                ("first line\nsecond line\n", CUT),  # a paste: both lines at once
                ('"""\n', r"\.\.\. "), ("alpha\n", r"\.\.\. "), ('beta"""\n', CUT)]:
            terminal.send(keys)
            terminal.expect(reply)
            if reply != r"\.\.\. ":
                terminal.prompt()
        terminal.send("/exit\n")
        assert terminal.close() == 0

    fox, paste, block = requests_after(cluster, seen, 3)
    assert len(router_requests(cluster)) == seen + 3  # no turn of its own for a pasted line
    assert fox["prompt_tokens"] == len(tokenizer.chat_ids([user("name a fox")]))
    pasted = [user("first line\nsecond line")]
    assert paste["prompt_tokens"] == len(tokenizer.chat_ids(pasted))
    (paste_answer,) = greedy_answers(cluster, pasted, max_tokens=4)
    assert block["prompt_tokens"] == len(tokenizer.chat_ids(
        [*pasted, {"role": "assistant", "content": paste_answer}, user("alpha\nbeta")]))
    # The history keeps each turn of one line for the next chat.
    assert (tmp_path / "history").read_text().splitlines() == [
        "/help", "/nonsense", "name a fox", "/reset", "/exit"]


def test_pdserve_chat_against_a_closed_port_says_so_in_one_line_and_exits_1():
    address = f"127.0.0.1:{free_port()}"
    out = pdserve_chat(address, ["never sent"])
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(f"pdserve chat: cannot reach {address} (UNAVAILABLE: ")
    assert out.stderr.count("\n") == 1, out.stderr
