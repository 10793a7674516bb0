"""The ranks of one instance: rank 0 (the scheduler's process) and, for TP/PP, one child
process per other rank.

Control goes over ZMQ: rank 0 sends each step's commands (msgspec) to every other rank and
collects their replies, each with a timeout. Tensors go over torch.distributed with the gloo
backend: the all-reduce inside a TP group and the hidden states between PP stages. Rank 0
starts the other ranks itself (``kvxfer serve CONFIG --rank R ...``) with a parent-death
signal, so they never outlive it; a rank that hears nothing from rank 0 for
``SILENCE_S`` exits too.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
import zmq

from kvxfer.config import InstanceConfig
from kvxfer.engine.worker import (
    AnyCommand,
    Reply,
    Step,
    StepReply,
    Stop,
    Worker,
    reply_decoder,
    step_decoder,
    step_encoder,
)

logger = logging.getLogger(__name__)

STEP_TIMEOUT_S = 120.0  # the longest one step may take on any rank
START_TIMEOUT_S = 120.0  # the longest the other ranks may take to come up
SILENCE_S = 60.0  # a rank that hears nothing from rank 0 this long exits (rank 0 heartbeats)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in a child between fork and exec: SIGTERM it when its parent dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class RankError(RuntimeError):
    pass


def _init_distributed(cfg: InstanceConfig, rank: int, store: dist.TCPStore) -> dist.ProcessGroup | None:
    """gloo over loopback; one group per PP stage for the TP all-reduce (every rank makes every
    group, as torch requires); returns this rank's TP group (None when tp = 1)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank of an instance runs on this host
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.world_size,
                            timeout=timedelta(seconds=STEP_TIMEOUT_S))
    tp = cfg.parallel.tp
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) if tp > 1 else None for s in range(cfg.parallel.pp)]
    return groups[rank // tp]


def _make_worker(cfg: InstanceConfig, rank: int, tp_group: dist.ProcessGroup | None) -> Worker:
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=tp_group)
        return x

    return Worker(cfg, rank, all_reduce if tp_group is not None else None,
                  send=lambda t, dst: dist.send(t, dst), recv=lambda t, src: dist.recv(t, src))


class Ranks:
    """Rank 0's handle on every rank of its instance: ``run`` executes a step on all of them."""

    def __init__(self, cfg: InstanceConfig, config_path: str | None = None) -> None:
        self.cfg = cfg
        self.size = cfg.world_size
        self.seq = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sock: zmq.Socket | None = None
        if self.size == 1:
            self.worker = Worker(cfg, 0)
            return
        if config_path is None:
            raise ValueError("a TP/PP instance needs its config file to start its other ranks")
        store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, timeout=timedelta(seconds=START_TIMEOUT_S),
                              wait_for_workers=False)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        control_port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        try:
            for r in range(1, self.size):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvxfer", "serve", config_path, "--rank", str(r),
                     "--store-port", str(store.port), "--control-port", str(control_port)],
                    stdin=subprocess.DEVNULL, preexec_fn=die_with_parent))
            self._wait_ready()
            tp_group = _init_distributed(cfg, 0, store)
            self.worker = _make_worker(cfg, 0, tp_group)
            self.run([])  # every rank is past its own set-up
        except BaseException:
            self.close()
            raise
        logger.info("instance %s: %d ranks up (tp=%d pp=%d)", cfg.engine_id, self.size, cfg.parallel.tp,
                    cfg.parallel.pp)

    def _wait_ready(self) -> None:
        assert self.sock is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        self.idents: dict[int, bytes] = {}
        while len(self.idents) < self.size - 1:
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    raise RankError(f"rank {r} of {self.cfg.engine_id} exited with status {p.returncode} while "
                                    f"starting (its error is above)")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.size)) - set(self.idents))
                raise RankError(f"ranks {missing} of {self.cfg.engine_id} did not come up in {START_TIMEOUT_S:g}s")
            if self.sock.poll(100):
                ident, frame = self.sock.recv_multipart()
                hello = msgspec.msgpack.decode(frame, type=StepReply)
                self.idents[hello.rank] = ident

    def run(self, commands: list[AnyCommand]) -> list[list[Reply]]:
        """Run ``commands`` on every rank; the replies, indexed by rank."""
        if self.size == 1:
            return [self.worker.run(commands)]
        assert self.sock is not None
        self.seq += 1
        frame = step_encoder.encode(Step(self.seq, commands))
        for r in range(1, self.size):
            self.sock.send_multipart([self.idents[r], frame])
        out: list[list[Reply]] = [[] for _ in range(self.size)]
        out[0] = self.worker.run(commands)
        got = {0}
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while len(got) < self.size:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(min(left, 1.0) * 1000)):
                dead = {r: p.returncode for r, p in enumerate(self.procs, start=1) if p.poll() is not None}
                if dead:
                    raise RankError(f"{self.cfg.engine_id}: rank(s) exited (rank: status) {dead}")
                if left <= 0:
                    raise RankError(f"{self.cfg.engine_id}: rank(s) {sorted(set(range(self.size)) - got)} did not "
                                    f"answer step {self.seq} in {STEP_TIMEOUT_S:g}s")
                continue
            _, frame = self.sock.recv_multipart()
            reply = reply_decoder.decode(frame)
            if reply.error:
                raise RankError(f"{self.cfg.engine_id}: rank {reply.rank} failed step {reply.seq}: {reply.error}")
            if reply.seq == self.seq:
                out[reply.rank] = reply.replies
                got.add(reply.rank)
        return out

    def close(self) -> None:
        if self.size > 1 and self.sock is not None:
            with contextlib.suppress(Exception):
                for ident in getattr(self, "idents", {}).values():
                    self.sock.send_multipart([ident, step_encoder.encode(Step(-1, [Stop()]))])
            for p in self.procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
            self.sock.close(linger=0)
            self.sock = None
        if hasattr(self, "worker"):
            self.worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_rank(cfg: InstanceConfig, rank: int, store_port: int, control_port: int) -> None:
    """Rank ``rank`` > 0: build its worker, then run rank 0's steps until told to stop."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    store = dist.TCPStore("127.0.0.1", store_port, cfg.world_size, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{control_port}")
    worker: Worker | None = None
    try:
        sock.send(msgspec.msgpack.encode(StepReply(0, rank, [])))
        tp_group = _init_distributed(cfg, rank, store)
        worker = _make_worker(cfg, rank, tp_group)
        while True:
            if not sock.poll(int(SILENCE_S * 1000)):
                logger.error("rank %d: nothing from rank 0 for %gs; exiting", rank, SILENCE_S)
                return
            step = step_decoder.decode(sock.recv())
            if any(isinstance(c, Stop) for c in step.commands):
                return
            try:
                reply = StepReply(step.seq, rank, worker.run(step.commands))
            except Exception as e:
                logger.exception("rank %d: step %d failed", rank, step.seq)
                reply = StepReply(step.seq, rank, [], error=f"{type(e).__name__}: {e}")
            sock.send(msgspec.msgpack.encode(reply))
            if reply.error:
                return
    finally:
        if worker is not None:
            worker.close()
        sock.close(linger=0)
        if dist.is_initialized():
            dist.destroy_process_group()
