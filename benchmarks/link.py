"""Two hosts on one machine: two network namespaces joined by a shaped veth link.

`with Link("1gbit") as link:` gives `link.hosts`, two `Host`s (namespace, address, device
`pd0`), so a prefill and a decode process can talk over a real TCP path with a known rate
(and, where the kernel has netem, a delay) instead of loopback and shared memory. Tests
and `pdserve bench transfer --link` use it. Needs root, `ip` and `tc`; `Link.unavailable()`
says why not otherwise. Invariants:
- A Link only ever creates and deletes its own namespaces, named `pdslink-<pid>-<n>-a|b`.
  Leaving the `with` (normally, by an exception, or a failure half-way through entering)
  stops its relays, deletes both namespaces (which destroys the veth pair inside them) and
  checks that no task still holds either namespace; otherwise it raises `LinkError`
  naming them (it never kills what it did not start). Namespaces left by a crashed run
  (their pid is gone) are deleted by the next Link (`cleanup_stale`).
- The veth is created directly inside the two namespaces (never in ours), with IPv6
  address generation off, so its byte counters count only what the hosts send each other.
- Shaping is on the egress of both ends: a token bucket (tbf) at the rate, as the child
  of a netem delay when a delay is asked for. netem could not be measured here: this
  kernel has no netem (CONFIG_NET_SCH_NETEM unset), so a delay raises `LinkError` and
  `Link.unavailable(delay_ms=...)` gives that reason (tests skip rather than lie). tbf
  counts whole frames (headers included), so one TCP stream's payload tops out at
  1448/1514 = 0.956 of the rate; `SHAPING` has the sizes that reach it (measured below).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from pdserve import launch, netns
from pdserve.procs import pid_alive

PREFIX = "pdslink"
DEVICE = "pd0"
_COUNTER = itertools.count()
_COUNTER_LOCK = threading.Lock()
_NAME = re.compile(rf"{PREFIX}-(\d+)-(\d+)-[ab]")
_RATE = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit|tbit)", re.IGNORECASE)
_DELAY = re.compile(r"(\d+(?:\.\d+)?)(ms|us)", re.IGNORECASE)
_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_LINK_HELP = "expected RATE[,DELAY] such as 1gbit, 1gbit,1ms or 25gbit,0.5ms " \
             "(rate in kbit/mbit/gbit, delay in ms/us)"

# tbf sizing, measured with one Python TCP stream (BBR) between the namespaces on this
# 2-core VM (unshaped veth: 24.8 Gbit/s). The bucket must hold a whole GSO super-packet
# (64 KiB of payload plus headers on veth), or tbf splits each one into MTU frames in
# software: at 10gbit a 16 KiB bucket gave 0.48 of the rate, 64 KiB 0.82, 256 KiB 0.95,
# 1 MiB 0.96 (at 1gbit all gave 0.955-0.961). A bigger bucket only lets a burst through
# at memory speed, so: 256 KiB or 1 ms at the rate (a transfer of a few buckets mostly
# measures the bucket: 256 KiB at 200mbit crossed at 1.01 of the rate). The queue holds
# 5 ms at the rate (1 ms gave 0.950 vs 0.954 at 10gbit, 14.5 vs 18.5 Gbit/s at 25gbit,
# where the CPUs, not tc, are the limit): TCP finds the bottleneck without losing a window.
SHAPING = {"burst_bytes_min": 256 * 1024, "burst_ms": 1.0, "queue_ms": 5.0, "queue_bytes_min": 1 << 20}


class LinkError(RuntimeError):
    """The link could not be made, shaped, or completely removed."""


def parse_link(text: str) -> tuple[str, float]:
    """`"RATE[,DELAY]"` -> `(rate, delay_ms)`: `"25gbit,0.5ms"` -> `("25gbit", 0.5)`."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) not in (1, 2) or not _RATE.fullmatch(parts[0]):
        raise ValueError(f"bad link {text!r}: {_LINK_HELP}")
    rate = parts[0].lower()
    if rate_bits(rate) <= 0:
        raise ValueError(f"bad link {text!r}: the rate must be positive")
    delay_ms = 0.0
    if len(parts) == 2:
        m = _DELAY.fullmatch(parts[1])
        if not m:
            raise ValueError(f"bad link {text!r}: bad delay {parts[1]!r}; {_LINK_HELP}")
        delay_ms = float(m[1]) / (1000.0 if m[2].lower() == "us" else 1.0)
    return rate, delay_ms


def rate_bits(rate: str) -> float:
    """A tc rate (`"200mbit"`, `"25gbit"`) in bits per second."""
    m = _RATE.fullmatch(rate.strip())
    if not m:
        raise ValueError(f"bad rate {rate!r}: expected a number with kbit, mbit or gbit")
    return float(m[1]) * _RATE_UNITS[m[2].lower()]


def _run(cmd: list[str], what: str) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise LinkError(f"{what}: `{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")
    return out.stdout


@dataclass(frozen=True)
class Host:
    """One end of a link: its namespace, its address on the link, its device."""

    ns: str
    address: str
    device: str = DEVICE

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host (network and /sys, as `ip netns exec` does), moved
        there by `pdserve.launch` before it execs (after Popen has returned: a child whose
        host is gone by then exits without running)."""
        return launch.command(argv, netns=self.ns)

    def enter(self) -> None:
        """Move the calling thread (and what it starts later) into this host."""
        netns.enter(self.ns)

    def run(self, cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """`subprocess.run` of `cmd` inside this host (`ip netns exec`)."""
        return subprocess.run(["ip", "netns", "exec", self.ns, *cmd], **kwargs)

    def ucx_env(self) -> dict[str, str]:
        """Environment for a process here whose NIXL agent must use the link: UCX's TCP
        transport only, on this host's device only. Namespaces split the network, not
        memory: measured with the transfer benchmark, two agents in two namespaces with
        no UCX settings (or only UCX_NET_DEVICES=pd0) wrote 10 MB through shared memory
        or CMA while 2 KB crossed the veth. UCX_NET_DEVICES keeps TCP off `lo`, whose
        127.0.0.1 is a different host on each side. (UCX finds `pd0` by listing
        /sys/class/net, hence the sysfs remount in `command`.)"""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.device}

    def counters(self) -> dict[str, int]:
        """The device's byte and packet counters, as this host sees them."""
        out = json.loads(_run(["ip", "-n", self.ns, "-j", "-s", "link", "show", "dev", self.device],
                              f"read the counters of {self.ns}"))[0]["stats64"]
        return {f"{d}_{k}": int(out[d][k]) for d in ("rx", "tx") for k in ("bytes", "packets")}


def _addresses(pid: int, n: int) -> tuple[str, str]:
    """Two addresses of one /30 in 10.200.0.0-10.255.255.255, from the pid and counter."""
    block = ((pid << 4) + (n & 15)) % (56 << 14) * 4
    prefix = f"10.{200 + (block >> 16)}.{(block >> 8) & 255}"
    return f"{prefix}.{(block & 255) + 1}", f"{prefix}.{(block & 255) + 2}"


def shaping_commands(rate: str | None, delay_ms: float) -> list[list[str]]:
    """The `tc qdisc add dev pd0 ...` argument lists for one end's egress."""
    cmds: list[list[str]] = []
    parent = ["root"]
    if delay_ms > 0:
        # netem holds a queue of its own: size it for the delay at the rate (and then some)
        bits = rate_bits(rate) if rate else 100e9
        limit = max(1000, int(bits / 8 * (delay_ms + SHAPING["queue_ms"]) / 1e3 / 1500) * 2)
        cmds.append(["root", "handle", "1:", "netem", "delay", f"{round(delay_ms * 1000)}us",
                     "limit", str(limit)])
        parent = ["parent", "1:1"]
    if rate:
        byte_rate = rate_bits(rate) / 8
        burst = max(SHAPING["burst_bytes_min"], int(byte_rate * SHAPING["burst_ms"] / 1e3))
        limit = max(SHAPING["queue_bytes_min"], int(byte_rate * SHAPING["queue_ms"] / 1e3)) + burst
        cmds.append([*parent, "handle", "10:", "tbf", "rate", rate, "burst", str(burst), "limit", str(limit)])
    return cmds


def cleanup_stale() -> list[str]:
    """Delete `pdslink-<pid>-...` namespaces whose process is gone; returns their names."""
    try:
        names = os.listdir(netns.NETNS_DIR)
    except OSError:
        return []
    gone = [n for n in names if (m := _NAME.fullmatch(n)) and not pid_alive(int(m[1]))]
    for name in gone:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return gone


def _holders(inodes: set[int]) -> list[int]:
    """Pids with a thread in a network namespace whose inode is in `inodes`."""
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                if os.stat(f"/proc/{pid}/task/{tid}/ns/net").st_ino in inodes:
                    pids.add(int(pid))
            except OSError:
                pass
    return sorted(pids)


@dataclass
class Link:
    """Two namespaces joined by a veth, each end shaped to `rate` (None: unshaped) and
    delayed by `delay_ms`; usable once, as a context manager."""

    rate: str | None
    delay_ms: float = 0.0
    release_timeout_s: float = 5.0  # how long exiting tasks get to leave the namespaces
    hosts: tuple[Host, Host] = field(default=(), init=False)
    _made: list[str] = field(default_factory=list, init=False, repr=False)
    _inodes: set[int] = field(default_factory=set, init=False, repr=False)
    _relays: list[Any] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rate is not None:  # a rate alone: the delay is `delay_ms`
            self.rate = self.rate.strip().lower()
            if rate_bits(self.rate) <= 0:
                raise ValueError(f"the rate must be positive, got {self.rate!r}")
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")

    @staticmethod
    def unavailable(delay_ms: float = 0.0) -> str | None:
        """Why a Link (with this delay) cannot be made here, or None if it can."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"`{tool}` (iproute2) is not installed"
        with _COUNTER_LOCK:  # named like a link's, so a crash mid-probe is cleaned up too
            probe = f"{PREFIX}-{os.getpid()}-{next(_COUNTER)}-a"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
        try:
            # what a host's children go through: setns, a private mount namespace, sysfs
            moved = subprocess.run(launch.command(["true"], netns=probe), capture_output=True, text=True)
            if moved.returncode != 0:
                return f"cannot move a process into a namespace here: {moved.stderr.strip()[-300:]}"
            checks = [(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit",
                        "burst", "64k", "limit", "1m"], "tc's tbf qdisc")]
            if delay_ms > 0:
                checks.append((["tc", "-n", probe, "qdisc", "replace", "dev", "lo", "root", "netem", "delay",
                                "1ms"], "tc's netem qdisc (CONFIG_NET_SCH_NETEM), needed for a delay"))
            for cmd, what in checks:
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    return f"{what} is not available here: {out.stderr.strip()}"
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def __enter__(self) -> "Link":
        if self.hosts or self._made:
            raise LinkError("a Link is entered once")
        cleanup_stale()
        with _COUNTER_LOCK:
            n = next(_COUNTER)
        pid = os.getpid()
        names = (f"{PREFIX}-{pid}-{n}-a", f"{PREFIX}-{pid}-{n}-b")
        addrs = _addresses(pid, n)
        try:
            for ns in names:
                _run(["ip", "netns", "add", ns], "create a namespace")
                self._made.append(ns)
                self._inodes.add(os.stat(os.path.join(netns.NETNS_DIR, ns)).st_ino)
            _run(["ip", "link", "add", DEVICE, "netns", names[0], "type", "veth", "peer", "name", DEVICE,
                  "netns", names[1]], "create the veth pair")
            for ns, addr in zip(names, addrs):
                ip = ["ip", "-n", ns]
                _run([*ip, "link", "set", "lo", "up"], f"bring up lo in {ns}")
                _run([*ip, "link", "set", DEVICE, "addrgenmode", "none"], f"turn off IPv6 on {ns}")
                _run([*ip, "addr", "add", f"{addr}/30", "dev", DEVICE], f"address {ns}")
                for args in shaping_commands(self.rate, self.delay_ms):
                    _run(["tc", "-n", ns, "qdisc", "add", "dev", DEVICE, *args], f"shape {ns}")
                _run([*ip, "link", "set", DEVICE, "up"], f"bring up {DEVICE} in {ns}")
            self.hosts = tuple(Host(ns, addr) for ns, addr in zip(names, addrs))
        except BaseException:
            self.__exit__(*sys.exc_info())  # a failed clean-up warns: the first error is the one to see
            raise
        return self

    def forward(self, host: Host, port: int) -> int:
        """A port on 127.0.0.1 here that relays each connection to `host.address:port`."""
        from pdserve.benchmarks.relay import Relay

        if host not in self.hosts:
            raise LinkError(f"{host} is not a host of this link")
        relay = Relay(functools.partial(netns.enter, host.ns, remount_sys=False), (host.address, port))
        self._relays.append(relay)
        return relay.port

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._teardown()
        except LinkError as err:
            if exc_type is None:
                raise
            warnings.warn(f"{err} (while handling {exc_type.__name__})", RuntimeWarning, stacklevel=2)

    def _teardown(self) -> None:
        for relay in self._relays:
            relay.close()
        self._relays.clear()
        failed = []
        for ns in self._made:
            out = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=30)
            if out.returncode != 0 or os.path.exists(os.path.join(netns.NETNS_DIR, ns)):
                failed.append(f"{ns}: {out.stderr.strip()}")
        made, self._made = self._made, []
        inodes, self._inodes = self._inodes, set()
        if failed:
            raise LinkError(f"could not delete namespaces {failed}")
        # a namespace (and its veth) outlives its name while a task is still inside it;
        # tasks that are exiting let go within moments
        deadline = time.monotonic() + self.release_timeout_s
        while (holders := _holders(inodes)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if holders:
            raise LinkError(f"namespaces {made} are deleted but processes {holders} are still in them")
