"""How many KV pages the pool gets: `--num-pages`, else what `--kv-cache-mb` holds, else
`--kv-cache-memory-fraction` of the memory free once the weights are loaded (like vLLM's
share of device memory for its KV space). Free memory is the system's MemAvailable, or
less where a container's cgroup limit leaves less; on a GPU, what the device has free.
"""

from __future__ import annotations

from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def free_memory_bytes(device: str = "cpu") -> int:
    """Memory this process could still take without swapping or hitting its limit."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    free = _meminfo("MemAvailable")
    limit, used = _read(CGROUP / "memory.max"), _read(CGROUP / "memory.current")
    if limit is not None and used is not None:
        free = min(free, max(0, limit - used))
    return free


def kv_cache_pages(config, bytes_per_page: int) -> tuple[int, str]:
    """(pages, how they were sized): for the start-up line."""
    if config.num_pages:
        return config.num_pages, "--num-pages"
    if config.kv_cache_memory_bytes:
        return max(1, config.kv_cache_memory_bytes // bytes_per_page), \
            f"--kv-cache-mb {config.kv_cache_memory_bytes >> 20}"
    free = free_memory_bytes(config.device)
    budget = int(config.kv_cache_memory_fraction * free)
    return max(1, budget // bytes_per_page), \
        f"--kv-cache-memory-fraction {config.kv_cache_memory_fraction} of {free >> 20} MiB free"


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


def _read(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)
