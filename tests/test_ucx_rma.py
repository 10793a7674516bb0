"""One-sided UCX gets through connectors/ucx/rma.py between two real processes (real UCX, the
ucx plane's transports): bytes arrive exactly, the producer's Python takes no part, an idle
producer's native progress thread costs no core, a producer killed mid-read fails the read as a
lost peer, and a region of no bytes is refused."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import ucxx  # noqa: F401  (the README's test install has the ucx extra: a missing ucxx is a failure, not a skip)
from kvxfer.connectors.ucx.rma import Getter, RemoteKey, UcxRmaError, map_region
from kvxfer.connectors.ucx.rma_progress import AdaptiveRmaProgress
from kvxfer.connectors.ucx.runtime import RMA_EPOLL_TIMEOUT_MS

SIZE = 8 << 20
TLS = "^cma,cuda_ipc,cuda_copy,gdr_copy"  # the ucx plane's default: gets are emulated on the producer's worker


def _content() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _thread_cpu(tid: int) -> float:
    """CPU seconds (user + system) of this process's thread ``tid``, from /proc."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve(worker: Any, adaptive: bool) -> Callable[[], None]:
    """Progress ``worker`` as a plane's producer does (adaptive: as in a transfer agent); returns the stop."""
    if adaptive:
        progress = AdaptiveRmaProgress(wake_s=RMA_EPOLL_TIMEOUT_MS / 1000)
        progress.add(worker)
        return progress.stop
    worker.start_progress_thread(polling_mode=False, epoll_timeout=RMA_EPOLL_TIMEOUT_MS)
    return worker.stop_progress_thread  # type: ignore[no-any-return]


def _producer(conn: Any, adaptive: bool) -> None:
    os.environ["UCX_TLS"] = TLS
    from ucxx._lib import libucxx as ux

    ctx = ux.UCXContext()
    worker = ux.UCXWorker(ctx)
    cache = _content()
    key = map_region(ctx.handle, cache.ctypes.data, SIZE)
    stop = _serve(worker, adaptive)
    spinning = threading.Event()
    spinning.set()

    def spin() -> None:  # this process's Python stays busy: the gets must not need it
        while spinning.is_set():
            pass

    threading.Thread(target=spin, daemon=True).start()
    conn.send((worker.address.tobytes(), key.rkey, cache.ctypes.data))
    if conn.poll(120) and conn.recv() == "idle":
        spinning.clear()
        time.sleep(0.5)
        t0, c0 = time.monotonic(), _cpu()
        time.sleep(2.0)
        conn.send((_cpu() - c0) / (time.monotonic() - t0))
        conn.poll(60)
    stop()
    key.close()


@pytest.fixture(params=["native", "adaptive"])
def producer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("UCX_TLS", TLS)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(theirs, request.param == "adaptive"), daemon=True)
    proc.start()
    assert ours.poll(120), "the producer did not start"
    yield ours, *ours.recv()
    ours.send("stop")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def _endpoint(address: bytes) -> tuple[Any, Any]:
    from ucxx._lib import libucxx as ux

    worker = ux.UCXWorker(ux.UCXContext())
    ep = ux.UCXEndpoint.create_from_worker_address(worker, ux.UCXAddress.create_from_buffer(address), False)
    return worker, ep


def _close(ep: Any) -> None:
    """Close without waiting for the peer (as the plane does, runtime.close_now): ucxx's finalizer
    would otherwise flush towards it, for ever if it is dead."""
    ep.close()
    ep.remove_close_callback()


def _wait(getter: Getter, req: int | None, worker: Any) -> None:
    end = time.monotonic() + 30
    while not getter.done(req):
        worker.progress()
        assert time.monotonic() < end, "the gets did not land within 30 s"


def test_gets_deliver_the_producers_bytes_while_its_python_spins_and_cost_nothing_idle(producer: Any) -> None:
    conn, address, rkey, base = producer
    worker, ep = _endpoint(address)
    key = RemoteKey(ep.handle, rkey)
    getter = Getter(ep.handle)
    rng = np.random.default_rng(0)
    n = 300  # pieces of 1 byte to 64 KiB from random places, to random places of a local buffer
    lengths = rng.integers(1, 64 << 10, n).astype(np.uint64)
    src = rng.integers(0, SIZE - (64 << 10), n).astype(np.uint64)
    dst = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
    local = np.zeros(int(lengths.sum()), dtype=np.uint8)
    getter.get_pieces(np.full(n, key.handle, dtype=np.uint64), dst + np.uint64(local.ctypes.data),
                      src + np.uint64(base), lengths)
    _wait(getter, getter.flush(), worker)
    want = _content()
    expected = np.concatenate([want[s : s + ln] for s, ln in zip(src.tolist(), lengths.tolist(), strict=True)])
    assert np.array_equal(local, expected)
    conn.send("idle")
    assert conn.poll(60)
    share = conn.recv()
    assert share < 0.2, f"an idle producer's progress thread used {share:.2f} of a core"
    key.close()
    _close(ep)


@pytest.mark.parametrize("adaptive", [False, True], ids=["native", "adaptive"])
def test_a_producer_killed_mid_read_fails_the_flush_as_a_lost_peer(adaptive: bool) -> None:
    """512 MiB of gets in flight to a producer that is stopped (SIGSTOP: none is served), then
    SIGKILLed: the flush fails (a ConnectionError with UCX's negative status), it does not report
    the read done, and nothing landed. (Killing it once bytes land races its native thread, which
    can serve all 512 MiB before the kill.)"""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_big_producer, args=(theirs, adaptive), daemon=True)
    proc.start()
    try:
        assert ours.poll(120), "the producer did not start"
        address, rkey, base = ours.recv()
        worker, ep = _endpoint(address)
        key = RemoteKey(ep.handle, rkey)
        getter = Getter(ep.handle)
        _wait(getter, getter.flush(), worker)  # wired up while the producer runs
        os.kill(proc.pid, signal.SIGSTOP)
        n = BIG // (32 << 10)
        local = np.zeros(BIG, dtype=np.uint8)
        at = np.arange(n, dtype=np.uint64)[::-1] * np.uint64(32 << 10)  # backwards: not joined, many gets
        getter.get_pieces(np.full(n, key.handle, dtype=np.uint64), at + np.uint64(local.ctypes.data),
                          at + np.uint64(base), np.full(n, 32 << 10, dtype=np.uint64))
        req = getter.flush()
        for _ in range(100):
            worker.progress()
        os.kill(proc.pid, signal.SIGKILL)
        end = time.monotonic() + 30
        with pytest.raises(UcxRmaError) as e:
            while not getter.done(req):
                worker.progress()
                assert time.monotonic() < end, "the flush neither failed nor completed"
        assert isinstance(e.value, ConnectionError) and e.value.status < 0
        assert not local.any(), "a stopped producer served a get"
        key.close()
        _close(ep)
    finally:
        proc.kill()
        proc.join(10)


BIG = 512 << 20


def _big_producer(conn: Any, adaptive: bool) -> None:
    os.environ["UCX_TLS"] = TLS
    from ucxx._lib import libucxx as ux

    ctx = ux.UCXContext()
    worker = ux.UCXWorker(ctx)
    cache = np.ones(BIG, dtype=np.uint8)
    key = map_region(ctx.handle, cache.ctypes.data, BIG)
    _serve(worker, adaptive)
    conn.send((worker.address.tobytes(), key.rkey, cache.ctypes.data))
    time.sleep(120)


def test_a_region_of_no_bytes_is_refused() -> None:
    from ucxx._lib import libucxx as ux

    ctx = ux.UCXContext()
    with pytest.raises(ValueError, match="positive length"):
        map_region(ctx.handle, 4096, 0)


def test_the_adaptive_progress_thread_sleeps_with_no_worker_and_stops() -> None:
    """With no RMA worker, and again after one was added and removed, the thread sleeps (it does not
    poll on: under 5% of a core); ``stop`` ends it."""
    from ucxx._lib import libucxx as ux

    progress = AdaptiveRmaProgress(wake_s=RMA_EPOLL_TIMEOUT_MS / 1000)
    worker = ux.UCXWorker(ux.UCXContext())
    try:
        tid = progress.thread.native_id
        assert tid is not None
        for step in ("empty", "after a worker came and went"):
            time.sleep(0.2)
            c0 = _thread_cpu(tid)  # its own CPU: the process's other threads (earlier tests' UCX) do not count
            time.sleep(1.0)
            assert _thread_cpu(tid) - c0 < 0.05, f"{step}: the thread used CPU with no worker to progress"
            progress.add(worker)
            time.sleep(0.05)
            progress.remove(worker)
    finally:
        progress.stop()
    assert not progress.thread.is_alive()
