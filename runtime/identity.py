"""A node's model identity: what must agree before two nodes may share a request's KV.

A prefill node's KV can fill a decode node's pages only if both run the same weights
(`model_hash`), in the same dtype, with the same attention geometry (layers, KV heads,
head dim). Page size, pool size and memory layout may differ (kvtransfer plans across
them). Workers publish their identity (discovery records, `GetTransferInfo`); the router
admits a node only if `differences` with the nodes it already pairs is empty, and names
what differs otherwise.

`model_hash` is cheap to compute for any checkpoint size: it covers config.json, every
weight file's name and size, and the first and last MiB of each weight file (safetensors
files start with their header: tensor names, dtypes, shapes). Two checkpoints that differ
only in the middle of a large weight file would hash alike; any change of architecture,
shapes, dtype or seed of a generated checkpoint does not.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

_EDGE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
# Fields that must be equal for KV to move between two nodes, in the order reported.
COMPATIBILITY_FIELDS = ("model_hash", "dtype", "num_layers", "num_kv_heads", "head_dim")


def pdserve_version() -> str:
    """The installed `pdserve` distribution's version (pyproject.toml's, as pip installed it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def host_id() -> str:
    """Which KV "host" this process is on: two nodes with equal ids move KV through shared
    memory, different ids over a network link (`--kv-send auto` sends layer by layer then).
    UCX shares memory between processes of one machine (its boot id) that share an IPC
    namespace (containers of one compose project do); a process whose UCX_TLS leaves only
    network transports talks over its network namespace whatever it shares."""
    _, tls = _ucx_tls()
    network_only = bool(tls) and not tls & _UCX_MEMORY_TRANSPORTS
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ns = Path("/proc/self/ns/net" if network_only else "/proc/self/ns/ipc").stat().st_ino
    except OSError:
        return ""  # unknown: treated as another host
    return f"{boot}/{'net' if network_only else 'ipc'}:{ns}"


def ucx_moves_gpu_memory() -> bool:
    """Whether UCX_TLS (unset: every transport) leaves UCX a way to copy GPU memory."""
    tls, names = _ucx_tls()
    if tls.startswith("^"):  # all but those named
        return not names & {"cuda", "cuda_copy"}
    return not tls or bool(names & {"all", "cuda", "cuda_copy"})


def _ucx_tls() -> tuple[str, set[str]]:
    """UCX_TLS, and the transport names it lists (without a leading "^")."""
    tls = os.environ.get("UCX_TLS", "").lower().strip()
    return tls, {t.strip().lstrip("^") for t in tls.split(",") if t.strip()}


_UCX_MEMORY_TRANSPORTS = {"all", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "cuda_ipc"}


def model_hash(model_dir: str | Path, lora_modules=()) -> str:
    """A short hex digest of the checkpoint in `model_dir` (see the module docstring), then,
    with LoRA adapters (`--lora-modules NAME=DIR`), `+` and one of the adapters: nodes that
    exchange KV must run the same adapters under the same names, and two whose checkpoints
    agree are told that it is their adapters that differ."""
    digest = hashlib.sha256()
    _digest_dir(digest, Path(model_dir), "config.json")
    if not lora_modules:
        return digest.hexdigest()[:16]
    adapters = hashlib.sha256()
    for entry in lora_modules:
        name, _, path = str(entry).partition("=")
        adapters.update(f"lora {name}".encode())
        _digest_dir(adapters, Path(path), "adapter_config.json")
    return f"{digest.hexdigest()[:16]}+{adapters.hexdigest()[:8]}"


def _digest_dir(digest, root: Path, config_name: str) -> None:
    config = root / config_name
    if config.exists():
        digest.update(config.read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_EDGE_BYTES))
            if size > 2 * _EDGE_BYTES:
                f.seek(size - _EDGE_BYTES)
                digest.update(f.read())


@dataclass(frozen=True)
class NodeIdentity:
    """What a worker is: its model, KV geometry and role (no addresses, no load)."""

    model: str
    model_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    role: str = ""

    def differences(self, other: "NodeIdentity") -> list[str]:
        """Why KV cannot move between `self` and `other` ("dtype: float32 vs bfloat16");
        empty when it can. An unknown (empty) model hash is not compared."""
        problems = []
        for name in COMPATIBILITY_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if name == "model_hash" and (not a or not b):
                continue
            if a != b and name == "model_hash" and a.partition("+")[0] == b.partition("+")[0]:
                problems.append(f"LoRA adapters: {a} vs {b} (the same checkpoint, other adapters): start both "
                                f"nodes with the same --lora-modules, the same names for the same directories")
            elif a != b:
                label = f"model ({self.model} vs {other.model})" if name == "model_hash" else name
                problems.append(f"{label}: {a} vs {b}")
        return problems

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NodeIdentity":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @classmethod
    def from_transfer_info(cls, info) -> "NodeIdentity":
        """From a `TransferInfo` message (duck-typed: no proto import here)."""
        layout = info.layout
        # A tensor-parallel node's `layout` is rank 0's pool: the model's heads are the total.
        kv_heads = getattr(info, "total_kv_heads", 0) or layout.num_kv_heads
        return cls(model=info.model, model_hash=info.model_hash, dtype=layout.dtype,
                   num_layers=layout.num_layers, num_kv_heads=kv_heads,
                   head_dim=layout.head_dim, page_size=layout.page_size, role=info.role)
