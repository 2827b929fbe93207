"""Memory of a process from /proc/PID/status (Linux), for the benchmarks.

VmRSS is the resident set now; VmHWM its peak since the process's exec (unlike `ru_maxrss`, which starts from
the parent's high-water mark when a child is forked before its exec).
"""

from __future__ import annotations


def status_gb(field: str = "VmRSS", pid: int | str = "self") -> float:
    """`field` of /proc/PID/status (a size in kB) in GB; NaN when absent."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("nan")
