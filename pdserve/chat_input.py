"""The turns of `pdserve chat`: read from a terminal with line editing and history, or line
by line from a pipe.

- On a terminal (stdin a tty) input goes through GNU readline (stdlib `readline`): the
  arrow keys move in the line, Up and Down walk the history, which persists in the history
  file (`--history`; single-line turns: readline's file has one entry a line, so a turn of
  several lines is kept for the session only).
- A turn may span lines: a line that starts with `\"\"\"` opens a block that runs to a line
  that ends with `\"\"\"`. On a terminal a paste is one turn, whether the terminal brackets
  pastes (readline's bracketed paste, which Python turns off and this turns back on) or not
  (then the lines already waiting on stdin when the first one ends join the same turn).
- From a pipe every line is a turn, so a script can pipe turns in, and no prompt shows.
- At the prompt Ctrl-C is a key readline reads (`CtrlC`), not the terminal's SIGINT: a
  signal that lands after Python last looked for one and before readline waits on the
  terminal is only seen at the next key, so a Ctrl-C pressed as an answer ends was lost.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
from dataclasses import dataclass
from pathlib import Path

PROMPT = "> "
MORE = "... "  # inside a \"\"\" block
BLOCK = '"""'
CTRL_C_LINE = "\x03"  # the line readline gives back for Ctrl-C (see _readline)
PASTE_GAP_S = 0.05  # lines waiting on stdin within this are the rest of a paste, not typing
HISTORY_LINES = 1000


class CtrlC(KeyboardInterrupt):
    """Ctrl-C read as a key at the prompt."""

    line_ended = True  # readline ended the line: the terminal is on a new one


@dataclass(frozen=True)
class Turn:
    text: str  # stripped
    command: str | None = None  # a typed line that starts with "/" (a block never is one)


def default_history() -> Path:
    from pdserve.models.catalogue import cache_root

    return cache_root() / "chat_history"


class TurnReader:
    def __init__(self, interactive: bool, history: Path | None) -> None:
        """`interactive`: stdin is a terminal (readline, prompts, pastes as one turn);
        `history`: the file that keeps turns across sessions (None: none)."""
        self.interactive = interactive
        self.readline = _readline() if interactive else None
        self.history = self._load(history) if self.readline else None
        self.ctrl_c_key = self.readline is not None and _gnu(self.readline)

    def read(self) -> Turn:
        """The next turn. Raises EOFError at the end of input (Ctrl-D) and
        KeyboardInterrupt on Ctrl-C."""
        first = self._line(PROMPT)
        if first.lstrip().startswith(BLOCK):
            turn = Turn(self._block(first.lstrip()[len(BLOCK):]).strip())
        else:
            text = "\n".join([first, *self._rest_of_paste()]).strip()
            command = text.startswith("/") and "\n" not in text
            turn = Turn(text, text if command else None)
        self._remember(turn.text)
        return turn

    def _line(self, prompt: str) -> str:
        if not self.ctrl_c_key:
            return input(prompt if self.interactive else "")
        with _intr_char_off():
            line = input(prompt)
        if line == CTRL_C_LINE:
            raise CtrlC
        return line

    def _block(self, opening: str) -> str:
        lines = [opening]
        while not lines[-1].rstrip().endswith(BLOCK):
            try:
                lines.append(self._line(MORE))
            except EOFError:
                return "\n".join(lines)  # an unclosed block ends with the input
        lines[-1] = lines[-1].rstrip()[:-len(BLOCK)]
        return "\n".join(lines)

    def _rest_of_paste(self) -> list[str]:
        """The lines already waiting on the terminal: a paste the terminal did not bracket
        arrives at once, faster than anyone types. (readline reads the terminal itself, so
        nothing waits in Python's own buffer.)"""
        lines: list[str] = []
        while self.readline and select.select([sys.stdin], [], [], PASTE_GAP_S)[0]:
            try:
                lines.append(self._line(""))
            except EOFError:
                break
        return lines

    def _load(self, path: Path | None) -> Path | None:
        if path is None:
            return None
        self.readline.set_history_length(HISTORY_LINES)  # the file keeps the last ones
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()  # readline appends only to a file that exists
            self.readline.read_history_file(str(path))
        except OSError as err:
            print(f"pdserve chat: no saved history ({err})", file=sys.stderr)
            return None
        return path

    def _remember(self, text: str) -> None:
        if not self.readline or not text:
            return
        self.readline.add_history(text)  # in the session whole, as one entry
        if self.history is not None and "\n" not in text:
            try:
                self.readline.append_history_file(1, str(self.history))
            except OSError:
                pass  # the file went away or became read-only: the session keeps its own


def _readline():
    """The readline module set up for chat turns, or None where Python has none."""
    try:
        import readline
    except ImportError:
        return None
    readline.set_auto_history(False)  # a turn goes into the history whole, by _remember
    if _gnu(readline):
        readline.parse_and_bind("set enable-bracketed-paste on")
        # Ctrl-C empties the line (into the kill ring: Ctrl-Y brings it back), and ends it
        # with a literal ^C: the line CTRL_C_LINE.
        readline.parse_and_bind(r'"\C-c": "\C-e\C-u\C-v\C-c\C-j"')
    return readline


def _gnu(readline) -> bool:
    return "libedit" not in (readline.__doc__ or "")


@contextlib.contextmanager
def _intr_char_off():
    """The terminal's interrupt character (Ctrl-C) off, so it reaches readline as a key;
    Ctrl-Z and Ctrl-\\ keep their signals."""
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    quiet = [*saved[:6], list(saved[6])]
    quiet[6][termios.VINTR] = bytes([os.fpathconf(fd, "PC_VDISABLE")])
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
