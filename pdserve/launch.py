"""`python -m pdserve.launch [OPTIONS] -- COMMAND...`: set a child up, then exec COMMAND.

Why: a `preexec_fn` makes `subprocess` start the child with fork(), which runs every
`pthread_atfork` handler of the parent, and gRPC's can wait forever for one of the parent's
gRPC threads (grpc/grpc#37259, still open; seen here: a test process hung in fork() for
14 minutes restarting a node it had killed, under load). Without a `preexec_fn`, CPython
starts the child with vfork(), which runs no handler. So what a child needs before its
command runs is done by this small program, already in the child, which then execs the
command; all of it lasts across exec:
- `--parent PID --death-signal SIG`: the child gets SIG when its parent dies (Linux
  `PR_SET_PDEATHSIG`), and exits at once if PID is already gone (it died before this ran);
- `--netns NAME`: the child runs in that network namespace, with its /sys (`netns.enter`);
- `--cores 0,1`: the child and every thread it starts run on those cores.

It imports nothing heavy: it runs before every node, relay and benchmark child starts.
`command(...)` builds the argv prefix.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def command(argv: list[str], *, parent_death: int | None = None, netns: str | None = None,
            cores: set[int] | None = None) -> list[str]:
    """`argv` run through this launcher with the given set-up (argv itself if none)."""
    options: list[str] = []
    if parent_death is not None:
        options += ["--parent", str(os.getpid()), "--death-signal", str(int(parent_death))]
    if netns is not None:
        options += ["--netns", netns]
    if cores:
        options += ["--cores", ",".join(str(c) for c in sorted(cores))]
    return [sys.executable, "-m", "pdserve.launch", *options, "--", *argv] if options else list(argv)


def set_parent_death_signal(sig: int) -> None:
    """Have the calling process sent `sig` when its parent dies (Linux `PR_SET_PDEATHSIG`;
    it lasts across exec); elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    except (AttributeError, OSError):
        pass  # not Linux: nothing to set


def _cores(text: str) -> set[int]:
    try:
        cores = {int(c) for c in text.split(",") if c}
    except ValueError:
        cores = set()
    if not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"expected core numbers like 0,1, got {text!r}")
    return cores


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--parent", type=int, help="the pid whose death ends the child")
    parser.add_argument("--death-signal", type=int, default=int(signal.SIGKILL))
    parser.add_argument("--netns", help="network namespace to run in (a file in /run/netns)")
    parser.add_argument("--cores", type=_cores, help="CPU cores to run on, e.g. 0,1")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        parser.error("no command to run (give it after --)")
    if args.parent is not None:
        set_parent_death_signal(args.death_signal)
        if os.getppid() != args.parent:  # the parent died before the death signal was set
            sys.exit(1)
    if args.netns is not None:
        from pdserve import netns

        netns.enter(args.netns)
    if args.cores:
        os.sched_setaffinity(0, args.cores)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as err:
        sys.exit(f"pdserve.launch: cannot run {cmd[0]!r}: {err.strerror}")


if __name__ == "__main__":
    main()
