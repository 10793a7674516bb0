"""A transfer agent's scheduling priority (``connector.agent_nice``).

Below the engine's nice value an agent's threads preempt the engine's when both want one core:
a transfer keeps its speed beside an engine thread that spins. Linux keeps a nice value per
thread, so the agent sets each of its threads, and the kernel decides whether it may.
"""

from __future__ import annotations

import logging
import os
import resource

logger = logging.getLogger(__name__)

CAP_SYS_NICE = 23  # its bit in /proc/self/status CapEff


def nice_refusal(nice: int) -> str | None:
    """Why the kernel would refuse this process the nice value ``nice``, or None if it allows it.

    A value at or above the current one is always allowed; a lower one needs CAP_SYS_NICE or an
    RLIMIT_NICE of at least ``20 - nice``. The bench asks this before it starts a row.
    """
    if nice >= os.getpriority(os.PRIO_PROCESS, 0):
        return None
    try:
        with open("/proc/self/status") as f:
            caps = next((int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:")), 0)
    except OSError:
        caps = 0
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    if caps >> CAP_SYS_NICE & 1 or soft == resource.RLIM_INFINITY or soft >= 20 - nice:
        return None
    return (f"connector.agent_nice: {nice} is refused by the kernel: a nice value below the engine's needs "
            f"CAP_SYS_NICE or RLIMIT_NICE >= {20 - nice} (this process has {soft}); grant one, or set "
            "agent_nice to 0")


def set_nice(nice: int) -> None:
    """Give every thread of this process the nice value ``nice`` (``connector.agent_nice``).

    Linux keeps a nice value per thread and a new thread takes its creator's, so the threads
    started before this call (imports may start some) are set one by one, the list read again
    until it holds no new one, and every later thread inherits it. Refused (no CAP_SYS_NICE,
    RLIMIT_NICE too low): ValueError naming the option.
    """
    if nice == 0:
        return
    why = nice_refusal(nice)
    if why is not None:
        raise ValueError(why)
    done: set[int] = set()
    while True:
        tids = {int(t) for t in os.listdir("/proc/self/task")} - done
        if not tids:
            break
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:
                pass  # that thread ended meanwhile
            except PermissionError:
                raise ValueError(nice_refusal(nice) or f"connector.agent_nice: {nice} is refused by the kernel") \
                    from None
        done |= tids
    if os.getpriority(os.PRIO_PROCESS, 0) != nice:  # e.g. a /proc of another pid namespace named other threads
        raise RuntimeError(f"connector.agent_nice: {nice} did not take (this thread runs at "
                           f"{os.getpriority(os.PRIO_PROCESS, 0)}; is /proc this process's pid namespace's?)")
    logger.info("transfer agent: nice %d on %d threads", nice, len(done))
