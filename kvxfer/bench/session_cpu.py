"""CPU time used by a process session (a server and everything it started), read from /proc.

Why: a transfer library can buy latency with CPU (NixlConnector's UCX progress thread polls
without sleeping in every vLLM worker, idle or not), so a fair comparison of transfer times
shows what each side spends to get them. ``kvxfer bench vllm`` starts each server in a session
of its own (``start_new_session``): its vLLM processes and kvxfer's agents all carry that
session id. Linux only; threads are counted in their process's times; a process that exits
inside a window loses its time since the window began (none does while a server serves).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def session_cpu_s(sid: int) -> float:
    """User plus system CPU seconds of the live processes whose session id is ``sid``."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # the command name is in parentheses and may hold spaces: fields count from after it
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid:  # field 6, session
            total += int(fields[11]) + int(fields[12])  # fields 14 and 15, utime and stime
    return total * _TICK_S


@dataclass
class CpuWindow:
    """Cores used by some sessions over a stretch of wall time: ``start``, then ``cores``."""

    sids: tuple[int, ...]
    began: float = 0.0
    cpu0: float = 0.0

    def start(self) -> CpuWindow:
        self.began, self.cpu0 = time.monotonic(), sum(session_cpu_s(s) for s in self.sids)
        return self

    def cores(self) -> float:
        """Mean cores in use since ``start`` (CPU seconds over wall seconds)."""
        wall = time.monotonic() - self.began
        return (sum(session_cpu_s(s) for s in self.sids) - self.cpu0) / wall if wall > 0 else float("nan")


__all__ = ["CpuWindow", "session_cpu_s"]
