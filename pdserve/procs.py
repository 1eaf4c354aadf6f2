"""pdserve nodes as child processes: start one, learn its port, stop it, whatever happened.

The one helper behind `pdserve up`, the benchmarks' clusters and the multi-process tests.
A node prints `pdserve <role> listening on HOST:PORT` as its first stdout line, with the
port it bound, so `--port 0` works everywhere. Invariants:
- A child never outlives the process that started it: it gets a death signal when its
  parent dies (Linux `PR_SET_PDEATHSIG`), so a SIGKILLed test run or `pdserve up` leaves no
  node holding ports and memory.
- `stop()` always ends the child: SIGTERM (a node then drains), SIGKILL after the grace
  period; with `session=True` (the default) the signal goes to the child's whole process
  group.
- A node that exits or stays silent before listening raises RuntimeError naming it, with
  the tail of its log when there is one.
- `address` is the host the node says it listens on, with its port; a wildcard host
  (0.0.0.0, ::) is dialled as 127.0.0.1. With `netns` the node runs in that network
  namespace ("another host", see `netns.py`), so its address is dialled from there.
"""

from __future__ import annotations

import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve import launch

LISTENING = re.compile(r"pdserve (\w+)(?: listening on|: router on) (\S+):(\d+)")


_PICKED: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a node started next.

    Picked below the kernel's ephemeral range: a port the kernel hands out for `bind(0)`
    (another node's `--port 0`, UCX's listeners) or an outgoing connection could be taken
    between this check and the node's bind, and that race failed CI once. No port is
    returned twice by one process."""
    low = max(2048, min(_ephemeral_low(), 65536))
    for _ in range(200):
        port = random.randrange(1024 if low <= 2048 else low // 2, low)
        if port in _PICKED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PICKED.add(port)
        return port
    with socket.socket() as s:  # the low range is full: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dial_address(host: str, port: int) -> str:
    """`HOST:PORT` to connect to a server that says it listens on `host`."""
    if host in ("", "*", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # a bare IPv6 literal
    return f"{host}:{port}"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HeldLines:
    """Where nodes' stderr lines wait until `release()`, which writes them to our stderr and
    lets the later ones straight through; never released, they are dropped. `pdserve up`
    holds its nodes' lines while it checks the model beside their start, so a model it
    refuses is its one line, not theirs too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[str] | None = []  # None once released

    def write(self, line: str) -> None:
        with self._lock:
            if self._held is None:
                sys.stderr.write(line)
                sys.stderr.flush()
            else:
                self._held.append(line)

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held or [], None
            sys.stderr.writelines(held)
            sys.stderr.flush()


class NodeProcess:
    """`python -m pdserve.cli ARGS` (or another module) as a child process.

    `log`: a file for its stderr (None: this process's stderr). `cores`: CPU cores it is
    pinned to before it starts (its threads inherit them). `threads`: OpenMP/MKL threads.
    `session`: its own process group, signalled as a whole (else it shares ours, so a
    terminal's Ctrl-C reaches it too). `echo`: copy its other stdout lines to ours.
    `program`: run this command instead of `python -m MODULE` (etcd in the tests).
    `env`: its whole environment (default: ours). `netns`: a network namespace (`ip netns`)
    it is moved into before it execs, with that namespace's /sys (as `ip netns exec`).
    `held`: without `log`, its stderr lines go there (HeldLines) rather than to ours.
    """

    def __init__(self, args: list[str], *, log: Path | None = None, cores: set[int] | None = None,
                 threads: int | None = None, module: str = "pdserve.cli", session: bool = True,
                 death_signal: int = signal.SIGKILL, echo: bool = False,
                 program: list[str] | None = None, env: dict[str, str] | None = None,
                 netns: str | None = None, held: HeldLines | None = None) -> None:
        self.args = list(args)
        self.name = " ".join(self.args[:1]) or module
        self.log_path = Path(log) if log is not None else None
        self.echo = echo
        self.session = session
        self.port = 0
        self.address = ""
        self.ready_line = ""  # the node's line that named its address (`pdserve up`'s names more)
        self.netns = netns
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1",
                   TOKENIZERS_PARALLELISM="false")
        if threads is not None:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self._log = open(self.log_path, "w") if self.log_path is not None else None
        self._stdout_copier: threading.Thread | None = None
        self._start_error = ""
        command = program or [sys.executable, "-m", module]  # `program`: another binary
        # Set up by pdserve.launch in the child, not by a preexec_fn: see there why.
        argv = launch.command([*command, *self.args], parent_death=death_signal, netns=netns, cores=cores)
        stderr = subprocess.PIPE if held is not None and self._log is None else self._log
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     errors="replace", bufsize=1, start_new_session=session)
        if stderr is subprocess.PIPE:
            threading.Thread(target=self._relay_stderr, args=(held,), name=f"stderr-{self.name}",
                             daemon=True).start()

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        """The node's `HOST:PORT` once it listens (see `dial_address`); raises RuntimeError
        if it exits or does not listen within `timeout_s` (and stops it). Called again, it
        answers the same."""
        if self.address or self._start_error:
            if self._start_error:
                raise RuntimeError(self._start_error)
            return self.address
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.2)[0]:
                line = self.proc.stdout.readline()
                match = LISTENING.search(line)
                if match:
                    self.ready_line = line.strip()
                    self.port = int(match.group(3))
                    self.address = dial_address(match.group(2), self.port)
                    self._copy_stdout()
                    return self.address
                if not line and self.proc.poll() is not None:
                    break
                if self.echo:
                    sys.stdout.write(line)
            elif self.proc.poll() is not None:
                break
        code = self.proc.poll()
        self.stop()
        tail = f"; {self.log_path}:\n{self.log_path.read_text()[-3000:]}" if self.log_path else ""
        self._start_error = f"pdserve {self.name} did not start (exit code {code}){tail}"
        raise RuntimeError(self._start_error)

    def _relay_stderr(self, held: HeldLines) -> None:
        with self.proc.stderr:  # until the node and its children have exited
            for line in self.proc.stderr:
                held.write(line)

    def _copy_stdout(self) -> None:
        """Past the ready line nothing else reads the node's stdout, and a library writing
        there (UCX logs to stdout by default) would block the node once the pipe's 64 KiB
        filled: a thread copies it on, to our stdout (`echo`) or the node's log."""
        def copy() -> None:
            try:
                for line in self.proc.stdout:  # until the node and its children have exited
                    out = sys.stdout if self.echo else self._log
                    if out is not None:
                        out.write(line)
                        out.flush()
            except (ValueError, OSError):
                pass  # the log was closed: the node was stopped
            finally:
                self.proc.stdout.close()

        self._stdout_copier = threading.Thread(target=copy, name=f"stdout-{self.name}", daemon=True)
        self._stdout_copier.start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the node (its whole group when it has its own session)."""
        try:
            if self.session:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def pids(self) -> list[int]:
        """This process and all its descendants."""
        return descendants(self.proc.pid)

    def stop(self, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
        """Signal the node and wait; SIGKILL if it has not exited within `grace_s`."""
        if self.alive():
            self.send_signal(sig)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                self.proc.wait()
        self._close()

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
        self.proc.wait()

    def _close(self) -> None:
        if self._stdout_copier is not None:  # it ends, and closes the pipe, at the pipe's end
            self._stdout_copier.join(2.0)  # the node's last lines, into its log
        elif self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()


def stop_all(nodes: list[NodeProcess], grace_s: float = 10.0) -> None:
    """SIGTERM every node at once, then wait for all within one shared grace period."""
    for node in nodes:
        if node.alive():
            node.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for node in nodes:
        node.stop(max(0.0, deadline - time.monotonic()))


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (the children of each of its threads), as /proc has them."""
    out, todo = [], [pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out
