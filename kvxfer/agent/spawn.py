"""Starting a transfer agent process (its three channels to the engine, and its environment), and reaping one.

The engine keeps one end of each socket pair; the agent gets the other by file descriptor, with
the cache's shared memory files (``share_tensors``), and is told the rest by the ``Start``
command its connector sends next.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

from kvxfer.agent.channel import Channel
from kvxfer.agent.messages import Event, Reply, SharedTensor
from kvxfer.config import InstanceConfig

logger = logging.getLogger(__name__)

# an engine's OpenMP binding (vLLM's CPU workers set it): the agent's own OpenMP runtime would pin
# the agent's main thread to the first place; the agent keeps the engine thread's CPU mask instead
OPENMP_BINDING = frozenset({"OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"})
COPIED_BUFFER = 4 << 20  # the copied channel's send buffer: loads told between two of the agent's reads


def spawn_agent(config: InstanceConfig, shared: list[SharedTensor]
                ) -> tuple[subprocess.Popen[bytes], Channel, Channel, Channel]:
    """A new agent process, and the engine's ends of its command, event and copied channels
    (``EngineCopied`` is sent only: messages.py). OSError: it cannot be started (nothing is left
    open)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(3):
            socks.extend(socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
        engine_cmd, agent_cmd, engine_evt, agent_evt, engine_cp, agent_cp = socks
        engine_cp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, COPIED_BUFFER)  # a burst, between its reads
        fds = [agent_cmd.fileno(), agent_evt.fileno(), agent_cp.fileno(), *(t.fd for t in shared)]
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_BINDING}
        env["KVXFER_AGENT_LOG_LEVEL"] = str(logging.getLogger("kvxfer").getEffectiveLevel())
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # kvxfer and plugins as the engine finds them
        any_cpu = ["--any-cpu"] if config.connector.agent_cpus == "any" else []
        process = subprocess.Popen(
            [sys.executable, "-m", "kvxfer.agent", str(agent_cmd.fileno()), str(agent_evt.fileno()),
             str(agent_cp.fileno()), *any_cpu],
            pass_fds=fds, env=env, close_fds=True)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    for sock in (agent_cmd, agent_evt, agent_cp):  # the agent's own now
        sock.close()
    return process, Channel(engine_cmd, Reply), Channel(engine_evt, Event), Channel(engine_cp, Reply)


def reap_agent(p: subprocess.Popen[bytes] | None, wait_s: float, rank: int) -> None:
    """Wait ``wait_s`` for an agent to exit, then kill it (and wait for that, 10 s at most)."""
    if p is None:
        return
    try:
        p.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        p.kill()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel; the loads are reported all the same
            logger.error("rank %d: transfer agent pid %d did not exit after SIGKILL", rank, p.pid)
