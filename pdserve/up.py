"""`pdserve up`: a router, one prefill and one decode node on localhost, as three processes.

All three start at once, so their start-up (mostly imports) overlaps: worker ports are
picked up front (a free port each unless given), and the router connects lazily, so it may
come up before the workers. Each node reports the port it bound on its first stdout line.
Ctrl-C or SIGTERM stops all three (SIGTERM, then SIGKILL after a grace period), and if any
child dies the others are stopped too: `up` never leaves a process behind.
"""

from __future__ import annotations

import ctypes
import re
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

LISTENING = re.compile(r"pdserve (\w+) listening on (\S+):(\d+)")


@dataclass
class UpConfig:
    model: str
    port: int = 50051
    host: str = "127.0.0.1"
    prefill_port: int = 0
    decode_port: int = 0
    num_threads: int = 1
    extra: list[str] = field(default_factory=list)  # more flags for both workers
    http_port: int = 0  # router's OpenAI API and /metrics; 0 = a free port
    prefill_metrics_port: int | None = None
    decode_metrics_port: int | None = None
    log_format: str = "text"
    start_timeout_s: float = 120.0
    stop_grace_s: float = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_with_parent(sig: int = signal.SIGTERM):
    """A `preexec_fn` that has the child sent `sig` when the process that started it dies
    (Linux `PR_SET_PDEATHSIG`), so a SIGKILLed `pdserve up` (or test run) never leaves
    nodes behind holding ports and memory. Elsewhere it does nothing."""
    def set_death_signal() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
        except (AttributeError, OSError):
            pass
    return set_death_signal


def _spawn(args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.cli", *args]
    # stdout is a pipe only to learn the port; stderr (logs) goes straight to the terminal.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1,
                            preexec_fn=exit_with_parent())


def wait_listening(proc: subprocess.Popen, timeout_s: float) -> int:
    """The port `proc` reports on stdout; raises RuntimeError if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            match = LISTENING.search(line)
            if match:
                return int(match.group(3))
            sys.stdout.write(line)
        elif proc.poll() is not None:
            break
    raise RuntimeError(f"{' '.join(proc.args[3:5])} did not start (exit code {proc.poll()})")


def _metrics_flag(port: int | None) -> list[str]:
    return [] if port is None else ["--metrics-port", str(port)]


def stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def up(config: UpConfig) -> int:
    extra = [a for a in config.extra if a != "--"]
    logs = ["--log-format", config.log_format]
    worker = ["--model", config.model, "--host", "127.0.0.1",
              "--num-threads", str(config.num_threads), *logs, *extra]
    procs: list[subprocess.Popen] = []
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        prefill_port = config.prefill_port or free_port()
        decode_port = config.decode_port or free_port()
        http_port = config.http_port or free_port()
        procs.append(_spawn(["prefill", "--port", str(prefill_port), *worker,
                             *_metrics_flag(config.prefill_metrics_port)]))
        procs.append(_spawn(["decode", "--port", str(decode_port), *worker,
                             *_metrics_flag(config.decode_metrics_port)]))
        procs.append(_spawn(["router", "--model", config.model, "--host", config.host,
                             "--port", str(config.port), "--http-port", str(http_port), *logs,
                             "--prefill", f"127.0.0.1:{prefill_port}",
                             "--decode", f"127.0.0.1:{decode_port}"]))
        for proc in procs[:2]:
            wait_listening(proc, config.start_timeout_s)
        router_port = wait_listening(procs[2], config.start_timeout_s)
        print(f"pdserve up: router on {config.host}:{router_port} (prefill 127.0.0.1:"
              f"{prefill_port}, decode 127.0.0.1:{decode_port}); OpenAI API and /metrics on "
              f"http://{config.host}:{http_port}; Ctrl-C stops all", flush=True)
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        dead = [p for p in procs if p.poll() is not None]
        return 0 if stopping or not dead else 1
    except RuntimeError as err:
        print(f"pdserve up: {err}", file=sys.stderr)
        return 1
    finally:
        stop_all(procs, config.stop_grace_s)
        for p in procs:
            if p.stdout:
                p.stdout.close()

