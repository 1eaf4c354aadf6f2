"""How many KV pages the pool gets: `--num-pages`, else what `--kv-cache-mb` holds, else
`--kv-cache-memory-fraction` of the memory free once the weights are loaded (like vLLM's
share of device memory for its KV space). Free memory is the system's MemAvailable, or
less where a container's cgroup limit leaves less.

On a GPU the fraction is of the device's total memory, and at most nine tenths of what is
free: a GPU pool is allocated at once (a CPU one is mapped lazily), so processes sharing a
device (`pdserve up`'s two workers) must not each size against what the other left,
which would depend on which started first; the tenth kept free is for activations and
CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def free_memory_bytes(device: str = "cpu") -> int:
    """Memory this process could still take without swapping or hitting its limit."""
    if device.startswith("cuda"):
        import torch

        # Blocks this process's allocator keeps cached (the weights' pieces, freed once
        # fused) count as used to the device: hand them back first.
        torch.cuda.empty_cache()
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
    free, fraction = free_memory_bytes(config.device), config.kv_cache_memory_fraction
    if config.device.startswith("cuda"):
        total = device_total_bytes(config.device)
        budget = min(int(fraction * total), int(0.9 * free))
        return max(1, budget // bytes_per_page), \
            f"--kv-cache-memory-fraction {fraction} of {total >> 20} MiB ({free >> 20} MiB free)"
    return max(1, int(fraction * free) // bytes_per_page), \
        f"--kv-cache-memory-fraction {fraction} of {free >> 20} MiB free"


def device_total_bytes(device: str) -> int:
    import torch

    return torch.cuda.mem_get_info(torch.device(device))[1]


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
