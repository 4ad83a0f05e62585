"""How many threads the CPU path runs torch with: the cores free to this process.

PyTorch's default is one thread per core of the machine. On a shared host that is far too
many: threads that wait for a core another process holds stall every parallel region, and a
step runs many times slower than with fewer threads. So the default counts the cores this
process may run on (its affinity, a cgroup quota), less what other processes keep busy on
them, sampled from /proc/stat for a moment at start-up.
"""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SAMPLE_S = 0.1  # how long start-up watches the cores (this process idles meanwhile)


def parse_proc_stat(text: str) -> dict[int, tuple[int, int]]:
    """Per CPU, (busy, total) jiffies since boot from /proc/stat's ``cpuN`` lines."""
    times = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle = ticks[3] + ticks[4]
        times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return times


def busy_cores(before: str, after: str, cpus: set[int]) -> float:
    """How many of ``cpus`` were busy between two /proc/stat readings (0.5: half a core)."""
    first, second = parse_proc_stat(before), parse_proc_stat(after)
    busy = 0.0
    for cpu in cpus & first.keys() & second.keys():
        total = second[cpu][1] - first[cpu][1]
        if total > 0:
            busy += (second[cpu][0] - first[cpu][0]) / total
    return busy


def cgroup_quota(cpu_max: str | None) -> float | None:
    """Cores a cgroup v2 ``cpu.max`` (``"200000 100000"``, or ``"max 100000"``) allows."""
    parts = (cpu_max or "").split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return int(parts[0]) / int(parts[1])


def choose_cpu_threads(cpus: set[int], busy: float, quota: float | None = None,
                       ceiling: int | None = None) -> int:
    """Threads for ``cpus`` (the affinity set) when ``busy`` of them are taken by others,
    within a cgroup ``quota`` (cores) and a ``ceiling`` (the thread count torch was already
    told, by OMP_NUM_THREADS or the application); at least 1. A core more than half free
    counts: load sampled for a moment is noisy, and one thread too few costs less than
    one too many."""
    threads = math.ceil(len(cpus) - busy - 0.5)
    if quota is not None:
        threads = min(threads, math.floor(quota))
    if ceiling is not None:
        threads = min(threads, ceiling)
    return max(1, threads)


def per_rank_threads(threads: int, world_size: int) -> int:
    """One rank's share when ``world_size`` CPU ranks split ``threads`` (at least 1)."""
    return max(1, threads // world_size)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def default_cpu_threads() -> int:
    """The cores free to this process now (affinity, cgroup quota, less what other
    processes keep busy), never above torch's current thread count; logged."""
    import torch

    ceiling = torch.get_num_threads()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else \
        set(range(os.cpu_count() or 1))
    quota = cgroup_quota(_read("/sys/fs/cgroup/cpu.max"))
    busy = 0.0
    if ceiling > 1:  # one thread needs no sample: it cannot go lower
        before = _read("/proc/stat")
        time.sleep(SAMPLE_S)
        after = _read("/proc/stat")
        if before is not None and after is not None:
            busy = busy_cores(before, after, set(cpus))
    threads = choose_cpu_threads(set(cpus), busy, quota, ceiling)
    logger.info("CPU threads: %d (%d cores allowed%s, %.1f busy with other work, torch had "
                "%d)", threads, len(cpus), "" if quota is None else f", quota {quota:g}",
                busy, ceiling)
    return threads
