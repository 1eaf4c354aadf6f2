"""A Ctrl-C at the chat's prompt is never lost, whenever it comes: here it comes while
readline, inside `input`, is still writing the prompt (held there by a terminal whose
output nobody reads yet), the window where the terminal's SIGINT was only seen at the next
key. The chat's `TurnReader` runs in a child on a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

from tests.cluster.nodes import wait_until

CHILD = textwrap.dedent("""
    import os, sys
    from pdserve.chat_input import TurnReader

    reader, said = TurnReader(True, None), int(sys.argv[1])
    os.set_blocking(1, False)
    try:  # fill the terminal's output: the prompt's write will wait for the reader
        while True:
            os.write(1, b"." * 512)
    except BlockingIOError:
        pass
    os.set_blocking(1, True)
    os.write(said, b"full;")
    try:
        os.write(said, f"line {reader.read().text!r};".encode())
    except KeyboardInterrupt as err:
        os.write(said, f"{type(err).__name__};".encode())
""")


def _in_readline(pid: int) -> bool:
    """The child sleeps in a write or an ioctl (the prompt, or readline setting up the
    terminal, waiting for its output to drain): inside `input`."""
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    call = Path(f"/proc/{pid}/syscall").read_text().split()[0]
    return state == "S" and call in ("1", "16")


def test_a_ctrl_c_while_readline_writes_the_prompt_interrupts_the_prompt():
    master, slave = os.openpty()
    said_r, said_w = os.pipe()
    env = {**os.environ, "TERM": "xterm", "INPUTRC": os.devnull}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(said_w)], stdin=slave, stdout=slave, stderr=slave,
        env=env, pass_fds=(said_w,), start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    os.close(said_w)
    try:
        assert os.read(said_r, 100) == b"full;"
        wait_until(lambda: _in_readline(child.pid), "the child waiting on its terminal", timeout_s=60)
        os.write(master, b"\x03")
        said, printed = b"", b""
        deadline = time.monotonic() + 60  # only a failure waits this long
        while not said.endswith(b";") and time.monotonic() < deadline:
            ready = select.select([master, said_r], [], [], 0.1)[0]
            if master in ready:  # read what it printed: its writes go on
                try:
                    printed += os.read(master, 65536)
                except OSError:  # it ended
                    pass
            if said_r in ready:
                said += os.read(said_r, 100)
        assert said == b"CtrlC;", f"the Ctrl-C was lost: {said!r}, " \
            f"last printed {printed.replace(b'.', b'')[-200:]!r}"
    finally:
        child.kill()
        child.wait()
        os.close(master)
        os.close(said_r)
