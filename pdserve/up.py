"""`pdserve up`: a router, one prefill and one decode node on localhost, as three processes.

All three start at once, so their start-up (mostly imports) overlaps: worker ports are
picked up front (a free port each unless given), and the router connects lazily, so it may
come up before the workers. Each node reports the port it bound on its first stdout line.
Whether the engine can serve the model is checked here (from its config) while they start,
their stderr held meanwhile: a model refused is `up`'s one line, the nodes' dropped unread.
Ctrl-C or SIGTERM stops all three (SIGTERM, then SIGKILL after a grace period), and if any
child dies the others are stopped too: `up` never leaves a process behind.

KV cache: both workers start at once, each sizing its pool against the same memory (on a
CPU pools are mapped lazily, so neither sees the other's; on a GPU the share is of the
device's total, engine/memory.py), so `up` splits `--kv-cache-memory-fraction` (default
0.25) between them, a third to prefill (its pages are held only until the window is sent)
and two thirds to decode; `--kv-cache-mb` or `--num-pages` given to `up` goes to both as given.

Worker flags: `up` takes the ones users reach for (`--dtype`, `--device`, `--page-size`,
`--num-pages`, `--kv-cache-mb`, `--kv-cache-memory-fraction`, `--max-num-seqs`) and
`--served-model-name` itself (and `--chat-template` and `--tool-call-parser`, which only
the router uses);
every other worker flag goes after `--`, to both workers.
The OpenAI API is on port 8000 by default (as vLLM's), and the ready line names it.

Device: both workers run their engine, and keep their KV pool, on `--device` (cpu, cuda or
cuda:N); by default on "cuda" when this machine has one torch can use, else on the CPU.
The check runs here, in `up`, before the workers start: on a machine with no NVIDIA driver
or no CUDA build of torch it reads a few files and imports nothing (`default_device`). On
a GPU the workers run in bfloat16 unless `--dtype` says otherwise.

Credentials: `up` makes a fresh random cluster key for its three nodes, so Worker calls
are authenticated with no set-up; with `--api-key`/`--api-key-file` its router requires
those keys (one per tenant) from clients. Keys reach the children only as files readable by this user alone
(mode 0600), never on a command line, and the files are removed when `up` exits. The
children get no key variables from our environment: their flags say it all.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.config import DEFAULT_KV_CACHE_MEMORY_FRACTION, DTYPES
from pdserve.procs import HeldLines, NodeProcess, free_port, stop_all
from pdserve.runtime.auth import APIKeyConfig
from pdserve.runtime.devices import default_device
from pdserve.runtime.logs import LOG_FORMATS
from pdserve.runtime.options import option

SIZING_FLAGS = ("--kv-cache-mb", "--num-pages", "--kv-cache-memory-fraction")
WORKER_OPTIONS = ("dtype", "page_size", "num_pages", "kv_cache_mb",
                  "max_num_seqs")  # UpConfig fields passed to both workers as their flags
KV_SHARES = {"prefill": 1 / 3, "decode": 2 / 3}  # of the KV fraction, see the docstring
KEY_VARIABLES = ("PDSERVE_CLUSTER_KEY", "PDSERVE_CLUSTER_KEY_FILE", "PDSERVE_API_KEY",
                 "PDSERVE_API_KEY_FILE")


@dataclass
class UpConfig:
    model: str
    host: str = option("127.0.0.1", "router bind address")
    port: int = option(50051, "router port")
    prefill_port: int = option(0, "prefill port; 0 = any free one")
    decode_port: int = option(0, "decode port; 0 = any free one")
    num_threads: int = option(1, "torch threads per worker")
    device: str | None = option(None, "torch device of both workers' engines and KV pools: cpu, "
                                      "cuda or cuda:N (default: cuda if torch can use one here, "
                                      "else cpu)", type=str)
    http_port: int = option(8000, "router's OpenAI API and /metrics port; 0 = any free one "
                                  "(printed either way)")
    # Worker flags `up` takes itself (WORKER_OPTIONS), for both workers; None: theirs.
    dtype: str | None = option(None, "both workers' weights and KV dtype (default: float32; "
                                     "bfloat16 on a GPU)", type=str, choices=DTYPES)
    page_size: int | None = option(None, "both workers' tokens per KV page (default: 16)",
                                   type=int)
    num_pages: int | None = option(None, "KV pages in each worker's pool (default: sized by "
                                         "memory, see above)", type=int)
    kv_cache_mb: int | None = option(None, "memory for each worker's KV pool, in MiB", type=int)
    kv_cache_memory_fraction: float | None = option(
        None, "share of the memory the two workers' KV pools take together, a third to "
              "prefill and two thirds to decode (default: 0.25; on a GPU, of its total)", type=float)
    max_num_seqs: int | None = option(None, "sequences each worker runs at once (default: 64)",
                                      type=int)
    prefill_tp: int = option(1, "tensor-parallel ranks of the prefill worker (its "
                                "--tensor-parallel-size)")
    decode_tp: int = option(1, "tensor-parallel ranks of the decode worker")
    prefill_metrics_port: int | None = option(None, "prefill worker's /metrics port (default: "
                                                    "none)", type=int)
    decode_metrics_port: int | None = option(None, "decode worker's /metrics port (default: "
                                                   "none)", type=int)
    log_format: str = option("text", "log lines of every node", choices=LOG_FORMATS)
    allowed_origins: list[str] = option(
        help="browser pages from this origin (https://host[:port]; * for any) may call the "
             "router's HTTP port (CORS; repeat for several; default: none)",
        metavar="ORIGIN", default_factory=list)
    responses_store_mb: float = option(64.0, "MiB of /v1/responses answers the router keeps for "
                                             "previous_response_id (0: none)")
    responses_store_dir: str | None = option(None, "the router keeps its stored responses in this "
                                                   "directory too, so a restart keeps them",
                                             type=str, metavar="DIR")
    sse_keepalive_s: float = option(15.0, "a streamed answer with nothing to send for this long "
                                          "sends a keep-alive (0: none)")
    lora_modules: list[str] = option(
        help="LoRA adapters served beside the model, on every node: NAME=DIR, a PEFT adapter "
             "directory; a request names the adapter as its model", metavar="NAME=DIR", nargs="+",
        default_factory=list)
    extra: list[str] = field(default_factory=list)  # more flags for both workers
    served_model_name: list[str] | None = None  # --served-model-name, to every node
    chat_template: str | None = None  # --chat-template as given, to the router
    tool_call_parser: str = "auto"  # --tool-call-parser, to the router
    api: APIKeyConfig = field(default_factory=APIKeyConfig)  # the router's, if any
    start_timeout_s: float = 120.0
    stop_grace_s: float = 10.0


class UpParser(argparse.ArgumentParser):
    """`pdserve up`'s parser: a worker flag given before `--` that `up` does not take, or a
    word that is no flag, is refused with the way to pass it. `worker_flags`: every flag of
    the worker commands (set when the CLI builds them)."""

    worker_flags: frozenset[str] = frozenset()

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        for word in rest:
            flag = word.split("=", 1)[0]
            if flag in self.worker_flags:
                self.error(f"{flag} is a worker flag that `pdserve up` does not take itself; "
                           f"the flags after `--` go to both workers: pdserve up -- {flag} ...")
        if namespace.worker_args[:1] not in ([], ["--"]):
            self.error(f"unrecognized arguments: {' '.join(namespace.worker_args)} (flags "
                       "for both workers go after `--`)")
        return namespace, rest


def _metrics_flag(port: int | None) -> list[str]:
    return [] if port is None else ["--metrics-port", str(port)]


def _secret_file(value: str, keys: list[str]) -> str:
    """`value` in a new file only this user may read (mkstemp makes it 0600); its path is
    added to `keys`, the files removed at exit."""
    fd, path = tempfile.mkstemp(prefix="pdserve-up-", suffix=".key")
    keys.append(path)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return path


def up(config: UpConfig, check: Callable[[], None] = lambda: None) -> int:
    """Serve until Ctrl-C, SIGTERM or a child's death; `check()` runs as the nodes start and
    may refuse the model with a ValueError (its text is then our one line)."""
    keys: list[str] = []
    api_keys = config.api.tenants()  # a bad key file fails here, before anything starts
    cluster = ["--cluster-key-file", _secret_file(secrets.token_hex(32), keys)]
    api = ["--api-key-file", _secret_file("\n".join(f"{t}:{k}" for t, k in api_keys.items()),
                                          keys)] if api_keys else []
    procs: list[NodeProcess] = []
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
        args = node_args(config, prefill_port, decode_port, http_port, cluster, api)
        held = HeldLines()
        procs += [_start(args[role], held) for role in ("prefill", "decode", "router")]
        try:
            check()
        except ValueError as err:
            print(f"pdserve up: {err}", file=sys.stderr)
            return 1
        if stopping:  # Ctrl-C while checking: the nodes' lines (they got it too) stay dropped
            return 0
        held.release()
        for proc in procs:
            proc.wait_ready(config.start_timeout_s)
        # Both front doors on one line; its start is what procs.LISTENING reads.
        print(f"pdserve up: router on {config.host}:{procs[2].port} (gRPC), OpenAI API on "
              f"http://{config.host}:{http_port}/v1 (/metrics beside it); prefill 127.0.0.1:"
              f"{prefill_port}, decode 127.0.0.1:{decode_port}; Ctrl-C stops all", flush=True)
        while not stopping and all(p.alive() for p in procs):
            time.sleep(0.2)
        dead = [p for p in procs if not p.alive()]
        return 0 if stopping or not dead else 1
    except RuntimeError as err:
        print(f"pdserve up: {err}", file=sys.stderr)
        return 1
    finally:
        stop_all(procs, config.stop_grace_s)
        for path in keys:
            os.unlink(path)


def node_args(config: UpConfig, prefill_port: int, decode_port: int, http_port: int,
              cluster: list[str], api: list[str]) -> dict[str, list[str]]:
    """The `pdserve` arguments of each child, by role. `cluster`, `api`: the flags naming
    the key files (every node gets the cluster key, only the router the API key)."""
    extra = [*worker_flags(config), *(a for a in config.extra if a != "--")]
    name = ["--served-model-name", *config.served_model_name] if config.served_model_name else []
    loras = ["--lora-modules", *config.lora_modules] if config.lora_modules else []
    common = ["--model", config.model, *name, *loras, "--log-format", config.log_format]
    device = device_flag(config.device, extra)
    worker = [*common, "--host", "127.0.0.1", "--num-threads", str(config.num_threads), *device,
              *gpu_dtype(device, extra), *cluster, *extra]
    return {
        "prefill": ["prefill", "--port", str(prefill_port), *tp_flag(config.prefill_tp), *worker,
                    *kv_share("prefill", extra, config.kv_cache_memory_fraction),
                    *_metrics_flag(config.prefill_metrics_port)],
        "decode": ["decode", "--port", str(decode_port), *tp_flag(config.decode_tp), *worker,
                   *kv_share("decode", extra, config.kv_cache_memory_fraction),
                   *_metrics_flag(config.decode_metrics_port)],
        "router": ["router", *common, "--host", config.host, "--port", str(config.port),
                   "--http-port", str(http_port), *cluster, *api,
                   *([] if config.chat_template is None else ["--chat-template", config.chat_template]),
                   "--tool-call-parser", config.tool_call_parser,
                   *(a for origin in config.allowed_origins for a in ("--allowed-origins", origin)),
                   "--responses-store-mb", f"{config.responses_store_mb:g}",
                   "--sse-keepalive-s", f"{config.sse_keepalive_s:g}",
                   *(["--responses-store-dir", config.responses_store_dir] if config.responses_store_dir else []),
                   "--prefill", f"127.0.0.1:{prefill_port}", "--decode", f"127.0.0.1:{decode_port}"],
    }


def worker_flags(config: UpConfig) -> list[str]:
    """The worker flags given to `up` itself (WORKER_OPTIONS), as both workers' arguments;
    they come before the flags after `--`, so those win."""
    flags = []
    for name in WORKER_OPTIONS:
        value = getattr(config, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def tp_flag(size: int) -> list[str]:
    """A worker's `--tensor-parallel-size` (before the flags after `--`, which win)."""
    return [] if size == 1 else ["--tensor-parallel-size", str(size)]


def kv_share(role: str, extra: list[str], fraction: float | None = None) -> list[str]:
    """The KV sizing flag of `role`'s worker: its share of `fraction` (default 0.25), unless
    the worker flags size its pool."""
    if any(a.split("=", 1)[0] in SIZING_FLAGS for a in extra):
        return []
    whole = DEFAULT_KV_CACHE_MEMORY_FRACTION if fraction is None else fraction
    return ["--kv-cache-memory-fraction", f"{whole * KV_SHARES[role]:.4f}"]


def device_flag(device: str | None, extra: list[str]) -> list[str]:
    """The workers' `--device`: as given, else the default here, unless the flags after `--`
    name one."""
    if any(a.split("=", 1)[0] == "--device" for a in extra):
        return []
    return ["--device", device or default_device()]


def gpu_dtype(device: list[str], extra: list[str]) -> list[str]:
    """bfloat16 for workers `up` puts on a GPU, unless a dtype is given: float32 there keeps
    torch's unfused ops and IEEE attention (the exactness oracle's), at a fraction of the speed."""
    if device[-1:] and device[-1].startswith("cuda") and not any(a.split("=", 1)[0] == "--dtype" for a in extra):
        return ["--dtype", "bfloat16"]
    return []


def _start(args: list[str], held: HeldLines) -> NodeProcess:
    # Logs (stderr) go to the terminal, once `held` is released; stdout is read only for the
    # port. The nodes share our process group, so a terminal's Ctrl-C reaches them too.
    env = {k: v for k, v in os.environ.items() if k not in KEY_VARIABLES}
    return NodeProcess(args, session=False, death_signal=signal.SIGTERM, echo=True, env=env, held=held)

