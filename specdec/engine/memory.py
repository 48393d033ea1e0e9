"""The default cap of a replica's KV pool: a share of the memory it has once its model is loaded.

A KV cache grows with every session's context (one full-context SmolLM2 session is hundreds of
MB), so an uncapped pool is an out-of-memory kill waiting for enough long requests. ``auto``
takes a fraction of what is left after loading: on a GPU its free device memory, on a CPU the
smaller of the host's available memory and the container's cgroup headroom (what a Kubernetes
memory limit leaves), shared by the ranks of a tensor-parallel group on one host."""

from __future__ import annotations

import os
from pathlib import Path

AUTO = "auto"
DEFAULT_KV_FRACTION = 0.5  # the rest: activations of a batched pass, the runtime, the allocator's slack
CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_kv_bytes(value: str) -> int | str:
    """``--max-kv-bytes``: ``auto``, or a byte count (0 = no cap) with an optional K/M/G[i]B unit."""
    text = value.strip()
    if text.lower() == AUTO:
        return AUTO
    return parse_bytes(text, also="'auto' or ")


def parse_bytes(value: str, also: str = "") -> int:
    """A byte count with an optional K/M/G[i]B unit: 2000000000, 2G, 2GiB, 256MiB."""
    text = value.strip()
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30}
    number = text.rstrip("bB")
    suffix = ""
    while number and number[-1].isalpha():
        suffix = number[-1].lower() + suffix
        number = number[:-1]
    if suffix not in units or not number.isdigit():
        raise ValueError(f"expected {also}a byte count like 2000000000, 2G or 2GiB, got {value!r}")
    return int(number) * units[suffix]


def kv_cap(available_bytes: int, fraction: float = DEFAULT_KV_FRACTION, sharers: int = 1) -> int:
    """The pool cap for ``available_bytes`` of free memory shared by ``sharers`` processes."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the KV memory fraction must be in (0, 1], got {fraction}")
    return max(0, int(available_bytes * fraction) // max(1, sharers))


def meminfo_available(text: str) -> int | None:
    """MemAvailable from /proc/meminfo's text, in bytes."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def cgroup_headroom(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process's cgroup may still use (limit - usage), or None without a limit.
    cgroup v2 (memory.max / memory.current) or v1 (memory.limit_in_bytes / usage_in_bytes)."""
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:  # v1's "no limit"
            return None
        return max(0, int(limit_text) - usage)
    return None


def available_memory(device) -> int:
    """Free memory for KV caches on ``device`` (a torch.device or string), now."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    candidates = []
    try:
        host = meminfo_available(Path("/proc/meminfo").read_text())
    except OSError:
        host = None
    if host is not None:
        candidates.append(host)
    headroom = cgroup_headroom()
    if headroom is not None:
        candidates.append(headroom)
    if not candidates:  # not Linux: the physical memory, as the last resort
        candidates.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return min(candidates)


def resolve_kv_cap(setting: int | str, device, fraction: float = DEFAULT_KV_FRACTION, ranks_on_host: int = 1) -> int:
    """The byte cap a replica runs with: ``setting`` itself, or with ``auto`` a share of what
    ``device`` has free (call it after the model is loaded)."""
    if setting != AUTO:
        return int(setting)
    import torch

    sharers = 1 if torch.device(device).type == "cuda" else ranks_on_host
    return kv_cap(available_memory(device), fraction, sharers)
