"""Entering a named Linux network namespace (`ip netns add NAME`) from Python.

`NodeProcess(netns=...)`, the benchmarks' two-host link (`benchmarks/link.py`) and its
relays use this to put a child, or one thread, "on another host". Python 3.11 has no
`os.setns`, so it goes through libc with ctypes. Invariants:
- A network namespace is per thread: `setns(CLONE_NEWNET)` moves only the calling thread
  (and whatever it later forks or spawns). `pdserve.launch` therefore moves a whole child,
  entering before it execs the child's command.
- With `remount_sys` the thread also gets its own mount namespace, a slave of ours, with a
  fresh sysfs on /sys, exactly what `ip netns exec` does: sysfs shows the devices of the
  namespace that mounted it, and UCX finds its TCP devices by listing /sys/class/net, so
  without the remount a process in the namespace would look for `pd0` among ours. Nothing
  is unmounted in our own mount namespace.
"""

from __future__ import annotations

import ctypes
import os

NETNS_DIR = "/run/netns"
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_REC = 0x4000
MS_SLAVE = 1 << 19
MNT_DETACH = 2


def _libc() -> dict:
    """The libc calls this module makes."""
    libc = ctypes.CDLL(None, use_errno=True)
    return {name: getattr(libc, name) for name in ("setns", "unshare", "mount", "umount2")}


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter(name: str, *, remount_sys: bool = True) -> None:
    """Move the calling thread into network namespace `name` (a file in /run/netns);
    with `remount_sys`, also into a private mount namespace whose /sys is that namespace's."""
    libc = _libc()
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc["setns"](fd, CLONE_NEWNET), f"setns into network namespace {name!r}")
    finally:
        os.close(fd)
    if not remount_sys:
        return
    _check(libc["unshare"](CLONE_NEWNS), "unshare the mount namespace")
    # our mounts still reach the new namespace, but nothing done here reaches back
    _check(libc["mount"](b"none", b"/", None, MS_REC | MS_SLAVE, None), "make / a slave mount")
    libc["umount2"](b"/sys", MNT_DETACH)  # fails harmlessly when /sys was not mounted
    _check(libc["mount"](name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs on /sys")

