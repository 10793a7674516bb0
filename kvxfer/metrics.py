"""Per-connector counters and histograms: what ``Connector.stats()`` returns and what an
instance exports for Prometheus on its optional metrics port.

Updated from the connector's threads (consumer worker, side channel), read from any thread;
one lock. Throughput is bytes over *busy* wall time: the time during which at least one load
was in flight, so overlapping loads are not counted twice (summed durations would understate
GB/s by the overlap factor).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from kvxfer.protocol import ErrorCode
from kvxfer.supervise import loop_errors

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """Fixed buckets (upper bounds, seconds), as Prometheus exports them."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class BusyClock:
    """Wall time during which at least one interval was open (the union of the intervals)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.open = 0
        self.since = 0.0
        self.total = 0.0

    def start(self) -> None:
        if self.open == 0:
            self.since = self.clock()
        self.open += 1

    def stop(self) -> None:
        if self.open <= 0:
            raise RuntimeError("BusyClock.stop without a start")
        self.open -= 1
        if self.open == 0:
            self.total += self.clock() - self.since

    def busy_s(self) -> float:
        return self.total + (self.clock() - self.since if self.open else 0.0)


class ConnectorMetrics:
    """One rank's connector: loads, bytes, descriptors, failures, handshakes, held blocks."""

    def __init__(self, engine_id: str, rank: int, plane: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.labels = {"engine": engine_id, "rank": str(rank), "plane": plane}
        self._lock = threading.Lock()
        self.loads_started = 0
        self.loads_ok = 0
        self.loads_failed = 0
        self.timeouts = 0
        self.bytes = 0
        self.descriptors = 0
        self.handshakes = 0
        self.handshake_s = 0.0
        self.handshake_latency = Histogram()
        self.transfer_latency = Histogram()
        self.busy = BusyClock(clock)
        self.producer: Callable[[], dict[str, float]] = dict  # held blocks, refused reads: read when asked
        self.failed_by_code: Counter[str] = Counter()
        self.broken: str | None = None  # why this rank's loading cannot go on (every load fails at once)
        # where a successful load's time went, summed over ``stage_loads`` loads (seconds):
        # queue, plan, transfer, complete (see Consumer); handoff (finished by the worker until
        # ``poll`` gave it to the engine) over ``stage_handoffs`` loads
        self.stages = [0.0, 0.0, 0.0, 0.0]
        self.stage_loads = 0
        self.stage_handoff_s = 0.0
        self.stage_handoffs = 0

    # -------------------------------------------------------------- updates
    def load_started(self) -> None:
        with self._lock:
            self.loads_started += 1
            self.busy.start()

    def load_finished(self, seconds: float, nbytes: int = 0, error: str | None = None,
                      timed_out: bool = False, code: ErrorCode | None = None,
                      stages: tuple[float, float, float, float] | None = None) -> None:
        """``stages``: a successful load's queue, plan, transfer and complete seconds."""
        with self._lock:
            self.busy.stop()
            self.transfer_latency.observe(seconds)
            if error is None:
                self.loads_ok += 1
                self.bytes += nbytes
                if stages is not None:
                    st = self.stages
                    st[0] += stages[0]
                    st[1] += stages[1]
                    st[2] += stages[2]
                    st[3] += stages[3]
                    self.stage_loads += 1
            else:
                self.loads_failed += 1
                self.timeouts += timed_out
                self.failed_by_code[(code or ErrorCode.INTERNAL).value] += 1

    def handed_off(self, loads: int, seconds: float) -> None:
        """``loads`` finished loads reached the engine (``poll``), ``seconds`` after the worker
        finished them (summed)."""
        with self._lock:
            self.stage_handoffs += loads
            self.stage_handoff_s += seconds

    def set_broken(self, why: str) -> None:
        with self._lock:
            self.broken = why

    def planned(self, descriptors: int) -> None:
        with self._lock:
            self.descriptors += descriptors

    def handshook(self, seconds: float) -> None:
        with self._lock:
            self.handshakes += 1
            self.handshake_s += seconds
            self.handshake_latency.observe(seconds)

    # -------------------------------------------------------------- reads
    def snapshot(self) -> dict[str, float]:
        """Plain numbers, for ``Connector.stats()``."""
        with self._lock:
            busy = self.busy.busy_s()
            out = {"loads_started": self.loads_started, "loads_ok": self.loads_ok, "loads_failed": self.loads_failed,
                   "load_timeouts": self.timeouts, "bytes_received": self.bytes, "descriptors": self.descriptors,
                   "handshakes": self.handshakes, "handshake_s": self.handshake_s, "busy_s": busy,
                   "throughput_gbps": self.bytes / busy / 1e9 if busy > 0 else 0.0,
                   "broken": int(self.broken is not None), "loop_errors": loop_errors(),
                   "stage_loads": self.stage_loads, "stage_queue_s": self.stages[0], "stage_plan_s": self.stages[1],
                   "stage_transfer_s": self.stages[2], "stage_complete_s": self.stages[3],
                   "stage_handoffs": self.stage_handoffs, "stage_handoff_s": self.stage_handoff_s}
            out.update({f"loads_failed_{code}": n for code, n in self.failed_by_code.items()})
        out.update(self.producer())
        return {k: float(v) for k, v in out.items()}

    def families(self) -> Iterator[Any]:
        """Prometheus metric families (prometheus_client is imported only here)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        names, values = list(self.labels), list(self.labels.values())
        snap = self.snapshot()
        counters = [("loads_started", "KV loads started"), ("loads_ok", "KV loads completed"),
                    ("loads_failed", "KV loads failed (blocks recycled)"), ("load_timeouts", "KV loads timed out"),
                    ("bytes_received", "KV bytes loaded"), ("descriptors", "read descriptors after coalescing"),
                    ("handshakes", "side-channel handshakes"), ("refused_reads", "reads refused by the producer"),
                    ("holds_done", "holds released because every reader said done"),
                    ("holds_abandoned", "holds released because the consumer abandoned the request (a failed load)"),
                    ("holds_expired", "holds released because their lease (or abort limit) ran out"),
                    ("holds_engine", "holds released by the engine"),
                    ("loop_errors", "exceptions caught at the top of kvxfer's loops in this process (each logged)"),
                    ("stage_loads", "loads the stage_*_s sums cover (successful loads)"),
                    ("stage_queue_s", "seconds from start_load until the consumer worker took the load, summed"),
                    ("stage_plan_s", "seconds planning a load's reads (incl. a first handshake), summed"),
                    ("stage_transfer_s", "seconds from a load's first read issued to its last read back, summed"),
                    ("stage_complete_s", "seconds from a load's last read back to finished (repack, notices), summed"),
                    ("stage_handoffs", "finished loads handed to the engine by poll"),
                    ("stage_handoff_s", "seconds from a load finished until poll handed it to the engine, summed")]
        for key, doc in counters:
            if key in snap:
                c = CounterMetricFamily(f"kvxfer_{key}", doc, labels=names)
                c.add_metric(values, snap[key])
                yield c
        for key, doc in [("held_blocks", "blocks held for readers"), ("held_requests", "requests held for readers"),
                         ("busy_s", "wall seconds with a load in flight (non-overlapping)"),
                         ("throughput_gbps", "bytes_received / busy_s, GB/s"),
                         ("broken", "1 once this rank cannot load any more (its data plane is broken): every load "
                                    "fails at once")]:
            if key in snap:
                g = GaugeMetricFamily(f"kvxfer_{key}", doc, labels=names)
                g.add_metric(values, snap[key])
                yield g
        by_code = CounterMetricFamily("kvxfer_loads_failed_by_code", "KV loads failed, by error code",
                                      labels=[*names, "code"])
        with self._lock:
            for code, n in sorted(self.failed_by_code.items()):
                by_code.add_metric([*values, code], n)
        yield by_code
        with self._lock:
            hists = [("handshake_seconds", "handshake latency", self.handshake_latency),
                     ("transfer_seconds", "load latency, start to finished or failed", self.transfer_latency)]
            for name, doc, h in hists:
                f = HistogramMetricFamily(f"kvxfer_{name}", doc, labels=names)
                f.add_metric(values, h.cumulative(), sum_value=h.sum)
                yield f


class _Collector:
    def __init__(self) -> None:
        self.sources: list[ConnectorMetrics] = []

    def collect(self) -> Iterator[Any]:
        for s in list(self.sources):
            yield from s.families()


class MetricsServer:
    """An HTTP endpoint (``/metrics``) for Prometheus, serving the metrics added to it."""

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.collector = _Collector()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise ValueError(f"server.metrics_port: cannot listen on {host}:{port}: {e}") from None
        self.port = self.server.server_port
        logger.info("metrics on http://%s:%d/metrics", host, self.port)

    def add(self, metrics: ConnectorMetrics) -> None:
        self.collector.sources.append(metrics)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
