"""How many CPUs this process may really use: its affinity mask, capped by the cgroup CPU quota
(a container with `--cpus 2` on a 64-core host sees 64 CPUs in os.cpu_count()). OpenMP teams
larger than that spin against each other and a step slows down many times over, not in
proportion."""

from __future__ import annotations

import math
import os
from pathlib import Path


def _cgroup_quota(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """CPUs allowed by the cgroup's CFS quota (v2 cpu.max, or v1 cfs_quota_us / cfs_period_us),
    or None when unlimited or unknown."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # cgroup v2
            candidates.append(("v2", root / relative))
            candidates.append(("v2", root))
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu,cpuacct", root / "cpu"):
                candidates.append(("v1", mount / relative))
                candidates.append(("v1", mount))
    for kind, directory in candidates:
        try:
            if kind == "v2":
                quota, period = (directory / "cpu.max").read_text().split()[:2]
                if quota == "max":
                    return None
                return int(quota) / int(period)
            quota = int((directory / "cpu.cfs_quota_us").read_text())
            period = int((directory / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 else quota / period
        except (OSError, ValueError):
            continue
    return None


def available_cpus() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def threads_per_rank(requested: int | None, ranks_on_this_machine: int = 1) -> int:
    """`requested` (the --cpu-threads flag) when given, else this machine's usable CPUs shared
    among its ranks."""
    if requested is not None:
        return requested
    return max(1, available_cpus() // max(1, ranks_on_this_machine))
