"""What this machine offers a run, read without torch (the command line reads it before it loads torch)."""

from __future__ import annotations

from typing import Optional


def host_available_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None
