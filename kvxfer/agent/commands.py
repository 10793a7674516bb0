"""Commands from the engine to its transfer agent: one in flight, each with a time limit.

An agent that does not read a command, or does not answer one, within its limit is reported
dead (``on_death``, which kills it): a command left unanswered would pair its reply with the
next command's. So is an agent left mid-command by an interrupt of the engine's thread.

Threads: any engine thread calls in; ``_lock`` orders the commands (one in flight) and is held
across the round trip, never while ``on_death`` waits for the engine's other locks' holders.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from kvxfer.agent.channel import Channel, ChannelClosed
from kvxfer.agent.messages import Command, Refused, Reply

COMMAND_S = 30.0  # an agent answers commands at once; this long without an answer: hung


class AgentCommands:
    """The command channel of one agent. ``dead()``: why the agent is gone, or None;
    ``on_death(how)``: called (under this channel's lock) when a command shows it gone. Both are
    the connector's bound methods, held weakly: a connector its own channel kept alive in a cycle
    would free its agent's process handle and sockets only at the next garbage collection."""

    def __init__(self, channel: Channel, rank: int, dead: Callable[[], str | None],
                 on_death: Callable[[str], None]) -> None:
        self.channel = channel
        self.rank = rank
        self._dead_ref = weakref.WeakMethod(dead)
        self._on_death_ref = weakref.WeakMethod(on_death)
        self._lock = threading.Lock()

    def _dead(self) -> str | None:
        dead = self._dead_ref()
        return "transfer agent closed" if dead is None else dead()

    def _on_death(self, how: str) -> None:
        on_death = self._on_death_ref()
        if on_death is not None:
            on_death(how)

    def call(self, cmd: Command, timeout_s: float = COMMAND_S) -> Reply:
        """Send one command and wait for its answer; a dead or silent agent raises RuntimeError."""
        reply = self._exchange(cmd, timeout_s, answered=True)
        assert reply is not None
        return reply

    def send_only(self, cmd: Command) -> None:
        """Send a command the agent does not answer (in order with the others)."""
        self._exchange(cmd, COMMAND_S, answered=False)

    def _exchange(self, cmd: Command, timeout_s: float, answered: bool) -> Reply | None:
        reply = None
        with self._lock:
            if (why := self._dead()) is not None:
                raise RuntimeError(f"rank {self.rank}: {why}")
            try:
                self.channel.send(cmd, timeout_s)
                if answered:
                    reply = self.channel.recv(timeout_s)
                    if reply is None:
                        self._on_death(f"did not answer {type(cmd).__name__} within {timeout_s:g} s")
            except TimeoutError as e:
                self._on_death(f"did not read {type(cmd).__name__}: {e}")
            except ChannelClosed as e:
                self._on_death(f"exited ({e})")
            except BaseException:
                self._on_death(f"was left mid-command ({type(cmd).__name__}) by an interrupt")
                raise
        if reply is None if answered else self._dead() is not None:
            raise RuntimeError(f"rank {self.rank}: {self._dead()}")
        return reply

    def close(self) -> None:
        self.channel.close()


def checked(reply: Reply) -> Reply:
    """``reply``, or the error its refusal names (ValueError for bad input, else RuntimeError)."""
    if isinstance(reply, Refused):
        raise (ValueError if reply.kind == "value" else RuntimeError)(reply.message)
    return reply
