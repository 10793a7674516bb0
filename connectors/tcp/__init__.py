"""The ``tcp`` data plane: reads served with scatter-gather ``sendmsg`` over memoryviews of
the registered tensors, received with ``recvmsg_into`` straight into the destination blocks.

No intermediate bytes objects on either end. Each read request is split by bytes over
``streams`` connections per peer, each served by its own thread, which sends the requests of
reads queued on it ahead of their replies (``PIPELINE_DEPTH``; the producer answers a
connection's requests in order). A small read for an idle
stream is done on the calling thread instead, for up to INLINE_WAIT_S (``_Stream.try_inline``).
When both ends run on one host the connection is a Unix domain socket (``transport: auto``),
which measured faster than loopback TCP on these machines (6 vs 3-4.7 GB/s for one stream); its
send buffer is widened (``UNIX_SNDBUF``), and the producer sends on it by splicing its pages in
(``unix_send: splice``, :mod:`.splice`): the consumer's receive is then the only copy.

The wire (frames, scatter-gather sends and receives) is in :mod:`.wire`.

Options (``connector.data_plane``): ``streams`` (default 2), ``transport`` (auto, tcp, unix),
``unix_send`` (splice, copy: how a Unix-socket connection is served),
``timeout_s`` (per read batch; the connector passes ``timeouts.transfer_s``), ``host`` and
``port`` (where the server listens; default the side-channel host and an ephemeral port).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import select
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvxfer.config import DataPlaneValue
from kvxfer.dataplane import (
    BatchResult,
    Descriptors,
    HostRegionPlane,
    ReadRefused,
    check_bounds,
    check_read,
    check_read_parts,
)
from kvxfer.protocol import DataHello, ErrorCode, ReadReply, ReadRequest, Refusal, decode_data, encode
from kvxfer.supervise import code_of, describe, report
from kvxfer.threads import NamedThread

from .splice import Splicer, splice_works
from .wire import UNIX_SNDBUF as UNIX_SNDBUF
from .wire import _Receipt, recv_frame, send_frame, send_pieces, widen_unix_buffer
from .wire import recv_pieces as recv_pieces

logger = logging.getLogger(__name__)

MIN_SPLIT_BYTES = 8 << 20  # below this a batch goes on one stream
MIN_SPLIT_PIECE = 256 << 10  # ... and below this average piece size too
# a read of one part up to this size, for an idle connected stream, is done on the thread that
# calls ``read`` (with an agent: its command thread, on the fast path) for up to INLINE_WAIT_S;
# the stream's thread finishes what is not done by then
INLINE_READ_BYTES = 32 << 20
INLINE_WAIT_S = 0.01
# requests a stream sends ahead of the reply it awaits (``_Stream._run_jobs``), each of at most
# PIPELINE_PIECES pieces (about 24 bytes a piece): a consumer blocked sending a request while the
# producer is blocked sending it a reply would wait for the deadline, so what is sent ahead must fit
# the socket buffers (4 x 12 KiB)
PIPELINE_DEPTH = 4
PIPELINE_PIECES = 512
# a burst's small reads of one producer are sent as one request of up to this many bytes and
# pieces (read_many; the pieces cap keeps the request frame far below the wire's MAX_FRAME)
MERGE_BYTES = 16 << 20
MERGE_PIECES = 1 << 14
OPTIONS = {"streams", "transport", "unix_send", "timeout_s", "host", "port"}


class Address(msgspec.Struct, frozen=True):
    host: str
    port: int
    unix_path: str
    host_id: str  # same value on both ends: the Unix socket is reachable


def _host_id() -> str:
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()  # noqa: SIM115
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass
class _Job:
    batch_id: int
    part: int
    request_id: str
    regions: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    views: list[memoryview]
    deadline: float
    sent: bool = False  # its read request went out
    receipt: _Receipt | None = None  # its reply header arrived: the bytes being received
    # a burst's small reads of one producer as one request (``ReadRequest.parts``): per read, in
    # piece order, (batch id, request id, pieces); empty: the job is one part of ``batch_id``
    members: list[tuple[int, str, int]] = field(default_factory=list)

    def alone(self) -> list[_Job]:
        """A joint job's reads as jobs of their own (the producer refused the whole: each asks alone)."""
        jobs: list[_Job] = []
        a = 0
        for batch_id, request_id, n in self.members:
            jobs.append(_Job(batch_id, 0, request_id, self.regions[a:a + n], self.offsets[a:a + n],
                             self.lengths[a:a + n], self.views[a:a + n], self.deadline))
            a += n
        return jobs


_RESUME = _Job(-1, -1, "", np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), [], 0.0)
"""Queued to wake a stream's thread for a receive ``try_inline`` left unfinished (``_Stream.resume``)."""


@dataclass
class _Batch:
    batch_id: int
    peer_id: str
    request_id: str
    nbytes: int
    parts_left: int
    error: str | None = None
    code: ErrorCode | None = None


class _Stream:
    """One connection to a peer, driven by its own thread from a job queue.

    ``outstanding`` (parts queued or in progress here) is the plane's, under its lock: a part goes
    to the stream with the fewest, so small reads in flight spread over every stream."""

    def __init__(self, plane: TcpDataPlane, peer_id: str, address: Address, token: bytes, index: int) -> None:
        self.plane = plane
        self.peer_id = peer_id
        self.address = address
        self.token = token
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.outstanding = 0
        self.sock: socket.socket | None = None
        # the connection is used by whoever holds this: the stream's thread for each job, or a
        # thread reading inline (``try_inline``), which leaves an unfinished receive in ``resume``
        self._busy = threading.Lock()
        self.resume: _Job | None = None
        self.handed_over = 0  # reads try_inline left to the thread (what a test looks at)
        self.closed = False
        self.thread = NamedThread(target=self._run, name=f"tcp-{peer_id}-{index}", daemon=True)
        self.thread.start()

    def try_inline(self, job: _Job) -> bool:
        """Do ``job`` on the calling thread, if the connection is open and idle, for at most
        INLINE_WAIT_S: a receive not done by then is left to the stream's thread, which goes on
        from the byte it stopped at. False: not taken (the caller queues it)."""
        if not self._busy.acquire(blocking=False):
            return False
        try:
            if self.closed or self.sock is None or self.resume is not None:
                return False
            sock = self.sock
            try:
                self._do(sock, job, min(job.deadline, time.monotonic() + INLINE_WAIT_S))
            except TimeoutError:
                if self.closed:
                    self._failed(job, ConnectionError("the stream closed mid-read"))
                elif time.monotonic() >= job.deadline or not job.sent:  # (a request half sent cannot go on)
                    self._failed(job, TimeoutError("read did not complete within the batch time limit"))
                else:  # slower than the inline wait: the stream's thread finishes it, first
                    self.resume = job
                    self.handed_over += 1
                    self.jobs.put(_RESUME)
                return True
            except ReadRefused as e:
                self._refused(job, e)
                return True
            except Exception as e:
                self._failed(job, e)
                return True
            self.plane._part_done(self, job, None, None)
            return True
        finally:
            self._busy.release()

    def _connect(self) -> socket.socket:
        a = self.address
        use_unix = self.plane.transport == "unix" or (
            self.plane.transport == "auto" and a.unix_path and a.host_id == self.plane.host_id
            and os.path.exists(a.unix_path))
        if use_unix:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.plane.timeout_s)
            s.connect(a.unix_path)
        else:
            s = socket.create_connection((a.host, a.port), timeout=self.plane.timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(s, encode(DataHello(engine_id=self.plane.engine_id, token=self.token)))
        return s

    def _run(self) -> None:
        """Supervised: any exception fails the part whose reply was awaited (the connection is
        dropped, the next job reconnects) and the stream goes on. A receive left by ``try_inline``
        is finished first (its reply comes first on the connection)."""
        closing = False
        while not closing and (job := self.jobs.get()) is not None:
            with self._busy:
                resumed, self.resume = self.resume, None
                closing = self._run_jobs([j for j in (resumed, job) if j is not None and j is not _RESUME])
        self._drop()

    def _run_jobs(self, todo: list[_Job]) -> bool:
        """``todo`` and the jobs queued meanwhile, in order, with up to PIPELINE_DEPTH requests
        out on the connection at once: the producer reads the next request as soon as it has sent
        one reply, so jobs queued together leave no round trip idle between them. A refusal (a whole
        reply) fails its job alone and the connection goes on; any other failure drops the
        connection and fails the job whose reply was awaited, and the requests sent after it, gone
        with the connection, are sent again on the next one. True: the stream closes."""
        closing = False
        while todo:
            while not closing and len(todo) < PIPELINE_DEPTH:
                try:
                    more = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                elif more is not _RESUME:  # (the resume it stood for was taken with the lock)
                    todo.append(more)
            job = todo[0]
            try:
                if self.sock is None:
                    if self.closed:
                        raise ConnectionError("the stream closed")
                    self.sock = self._connect()
                for j in todo[:PIPELINE_DEPTH]:  # (a refused joint request's reads may make todo longer)
                    if j.sent:
                        continue
                    if j is not job and len(j.lengths) > PIPELINE_PIECES:
                        break  # a large request waits its turn, and those after it too (their order)
                    self._request(self.sock, j)
                self._do(self.sock, job, job.deadline)
            except ReadRefused as e:
                todo.pop(0)
                if job.members:  # one of the reads was refused: each asks alone, after those sent
                    alone = job.alone()
                    with self.plane._lock:
                        self.outstanding += len(alone) - 1
                    todo.extend(alone)
                    continue
                self._refused(job, e)
                continue
            except Exception as e:
                todo.pop(0)
                self._failed(job, e)
                for j in todo:
                    j.sent, j.receipt = False, None
                continue
            todo.pop(0)
            self.plane._part_done(self, job, None, None)
        return closing

    def _refused(self, job: _Job, e: ReadRefused) -> None:
        """The producer refused a part: its whole reply was read, so the connection stays in step."""
        self.plane._part_done(self, job, e.code, f"peer {self.peer_id}: {describe(e)}")

    def _failed(self, job: _Job, e: Exception) -> None:
        """A part failed (not refused: ``_refused``): the connection is dropped, its state unknown."""
        self._drop()
        if not isinstance(e, OSError | ReadRefused | ValueError):  # not a peer's doing: a bug
            report("tcp stream", e, f"read for {job.request_id} from {self.peer_id}")
        self.plane._part_done(self, job, code_of(e), f"peer {self.peer_id}: {describe(e)}")

    def _do(self, sock: socket.socket, job: _Job, wait_until: float) -> None:
        """Send the job's request (once), take its reply header, then its bytes; TimeoutError at
        ``wait_until`` leaves the job where it stopped (header awaited, or bytes part received)."""
        if not job.sent:
            self._request(sock, job)
        if job.receipt is None:
            self._header(sock, job, wait_until)
            job.receipt = _Receipt(job.views)
        job.receipt.run(sock, wait_until)

    def _request(self, sock: socket.socket, job: _Job) -> None:
        req = ReadRequest(request_id=job.request_id, batch_id=job.batch_id, regions=job.regions.tobytes(),
                          offsets=job.offsets.tobytes(), lengths=job.lengths.tobytes(), token=self.token,
                          parts=[(rid, n) for _, rid, n in job.members])
        sock.settimeout(max(job.deadline - time.monotonic(), 0.001))
        send_frame(sock, encode(req))
        job.sent = True

    def _header(self, sock: socket.socket, job: _Job, wait_until: float) -> None:
        """The reply's header: waited for until ``wait_until`` with nothing read (so that a wait
        given up leaves the connection where it was), then read whole by the job's deadline."""
        if not select.select([sock], [], [], max(wait_until - time.monotonic(), 0.0))[0]:
            raise TimeoutError("no reply within the wait")
        sock.settimeout(max(job.deadline - time.monotonic(), 0.001))
        reply = decode_data(recv_frame(sock))
        if not isinstance(reply, ReadReply) or reply.batch_id != job.batch_id:
            raise ConnectionError(f"unexpected reply {type(reply).__name__}")
        if reply.error:
            raise ReadRefused(reply.code or ErrorCode.INTERNAL, reply.error)
        if reply.nbytes != int(job.lengths.sum()):
            raise ConnectionError(f"reply announces {reply.nbytes} bytes, expected {int(job.lengths.sum())}")

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def close(self) -> None:
        self.closed = True
        self.jobs.put(None)
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # unblocks a recv in progress
            except OSError:
                pass
        self.thread.join(timeout=5)


class TcpDataPlane(HostRegionPlane):
    """Scatter-gather socket reads between registered host regions of two processes."""

    name = "tcp"
    known_options = frozenset(OPTIONS)

    def __init__(self, options: Mapping[str, DataPlaneValue] | None = None) -> None:
        super().__init__(options)
        self.streams = int(self.options.get("streams", 2))
        self.transport = str(self.options.get("transport", "auto"))
        self.timeout_s = float(self.options.get("timeout_s", 30.0))
        if self.streams < 1 or self.streams > 16:
            raise ValueError(f"connector.data_plane.streams: expected 1..16, got {self.streams}")
        if self.transport not in ("auto", "tcp", "unix"):
            raise ValueError(f"connector.data_plane.transport: expected auto, tcp or unix, got {self.transport!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"connector.data_plane.timeout_s: expected > 0, got {self.timeout_s}")
        self.unix_send = self._unix_send(self.options.get("unix_send"))
        self.engine_id = "kvxfer"  # the Connector sets its engine id; sent in each connection's hello
        self.host_id = _host_id()
        self._peers: dict[str, tuple[Address, bytes]] = {}
        self._streams: dict[str, list[_Stream]] = {}
        self._batches: dict[int, _Batch] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._refused: set[tuple[str, str]] = set()
        self._server_threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self.spliced_bytes = 0  # served on Unix sockets by reference (under _lock)
        self.copied_bytes = 0  # served with sendmsg
        self._start_server(str(self.options.get("host", "127.0.0.1")), int(self.options.get("port", 0)))

    def _unix_send(self, value: DataPlaneValue | None) -> str:
        """``unix_send``: ``splice`` unless this host refuses spliced pages (then ``copy``, logged;
        asked for by name, the plane refuses to start instead). With ``transport: tcp`` there is
        no Unix connection to serve: not probed."""
        if value not in (None, "splice", "copy"):
            raise ValueError(f"connector.data_plane.unix_send: expected splice or copy, got {value!r}")
        if value == "copy" or self.transport == "tcp":
            return "copy" if value == "copy" else "splice"
        why = splice_works()
        if why is None:
            return "splice"
        if value == "splice":
            raise ValueError(f"connector.data_plane.unix_send: splice does not work here ({why}); use copy")
        logger.warning("tcp data plane: Unix-socket reads are served with sendmsg (splice does not work here: %s)",
                       why)
        return "copy"

    # ------------------------------------------------------------------ server
    def _start_server(self, host: str, port: int) -> None:
        self._tcp = socket.create_server((host, port), reuse_port=False, backlog=64)
        self._unix_path = os.path.join(tempfile.gettempdir(), f"kvxfer-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock")
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind(self._unix_path)
        os.chmod(self._unix_path, 0o600)
        self._unix.listen(64)
        self._address = Address(host=host, port=self._tcp.getsockname()[1], unix_path=self._unix_path,
                                host_id=self.host_id)
        for srv in (self._tcp, self._unix):
            srv.settimeout(0.2)  # here, not in the thread: a plane closed at once has closed the socket
            t = NamedThread(target=self._accept_loop, args=(srv,), name="tcp-accept", daemon=True)
            t.start()
            self._server_threads.append(t)

    def _accept_loop(self, srv: socket.socket) -> None:
        """Supervised: only closing the plane ends it (an accept that fails, e.g. out of file
        descriptors, is reported and tried again)."""
        while not self._closed.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except Exception as e:
                if self._closed.is_set():
                    break
                report("tcp accept", e)
                time.sleep(0.05)
                continue
            try:
                conn.settimeout(None)
                widen_unix_buffer(conn)
                if conn.family != socket.AF_UNIX:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._lock:
                    self._conns.add(conn)
                NamedThread(target=self._serve, args=(conn,), name="tcp-serve", daemon=True).start()
            except Exception as e:
                report("tcp accept", e, "starting a connection's server")
                with self._lock:
                    self._conns.discard(conn)
                conn.close()

    def _refuse_once(self, peer: str, code: ErrorCode, why: str) -> None:
        key = (peer, code.value)
        if key not in self._refused:
            self._refused.add(key)
            logger.warning("tcp data plane refused peer %s: %s", peer, why)

    def _serve(self, conn: socket.socket) -> None:
        peer = "?"
        splicer: Splicer | None = None
        try:
            conn.settimeout(self.timeout_s)
            hello = decode_data(recv_frame(conn, limit=4096))
            if not isinstance(hello, DataHello):
                raise ConnectionError("first frame is not a hello")
            peer = hello.engine_id
            if self._token_checker is not None and not self._token_checker(hello.token):
                self._refuse_once(peer, ErrorCode.AUTH, "connection without a valid handshake token: closed")
                return
            conn.settimeout(None)  # blocking: splice waits in the kernel as sendmsg does
            if conn.family == socket.AF_UNIX and self.unix_send == "splice":
                try:
                    splicer = Splicer()
                except OSError as e:  # out of file descriptors: this connection copies
                    logger.warning("tcp data plane: no splice pipe for a connection from %s (%s): served with "
                                   "sendmsg", peer, e)
            while not self._closed.is_set():
                req = decode_data(recv_frame(conn))
                if not isinstance(req, ReadRequest):
                    raise ConnectionError(f"expected a read request, got {type(req).__name__}")
                self._serve_read(conn, peer, req, splicer)
        except (OSError, ValueError) as e:  # the peer's doing (or closing): the connection ends
            if not self._closed.is_set() and not isinstance(e, ConnectionError):
                self._refuse_once(peer, ErrorCode.PEER_LOST, f"connection dropped: {e}")
        except Exception as e:  # supervised: only this connection ends; the consumer reconnects
            report("tcp serve", e, f"connection from {peer}")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if splicer is not None:
                splicer.close()

    def _serve_read(self, conn: socket.socket, peer: str, req: ReadRequest, splicer: Splicer | None) -> None:
        """One read request (a joint one's parts each checked against its own request): checked,
        then sent (spliced with ``splicer``, else copied by sendmsg). An exception before the reply
        header is sent refuses this read as ``internal`` and the connection serves the next one."""
        pieces: list[memoryview] = []
        addresses = np.empty(0, np.int64)
        try:
            table = self._table
            if req.parts:  # a burst's reads as one: each part checked against its own request
                why, d = check_read_parts(table, self._validator, req.request_id, req.regions, req.offsets,
                                          req.lengths, req.parts)
            else:
                why, d = check_read(table, self._validator, req.request_id, req.regions, req.offsets,
                                    req.lengths, allow_empty=True)
            if why is None and splicer is not None:
                addresses = table.addresses(d.remote_region, d.remote_offset)
            elif why is None:
                pieces = self._piece_views(d.remote_region, d.remote_offset, d.length)
        except Exception as e:
            report("tcp serve", e, f"read for {req.request_id} from {peer}")
            why = Refusal(ErrorCode.INTERNAL, f"serving the read failed: {describe(e)}")
        if why is not None:
            self._refuse_once(peer, why.code, f"read for {req.request_id}: {why.message}")
            send_frame(conn, encode(ReadReply(batch_id=req.batch_id, nbytes=0, error=why.message, code=why.code)))
            return
        send_frame(conn, encode(ReadReply(batch_id=req.batch_id, nbytes=d.nbytes)))
        if splicer is not None:
            splicer.send(conn, addresses, d.length)
        else:
            send_pieces(conn, pieces)
        with self._lock:
            if splicer is not None and splicer.copying is None:
                self.spliced_bytes += d.nbytes
            else:
                self.copied_bytes += d.nbytes

    # ------------------------------------------------------------------ DataPlane
    def address(self) -> bytes:
        return msgspec.msgpack.encode(self._address)

    def connect(self, peer_id: str, address: bytes, token: bytes = b"") -> None:
        try:
            addr = msgspec.msgpack.decode(address, type=Address)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ConnectionError(f"peer {peer_id}: bad tcp address: {e}") from None
        with self._lock:
            if peer_id in self._peers:
                return
            self._peers[peer_id] = (addr, token)
            self._streams[peer_id] = [_Stream(self, peer_id, addr, token, i) for i in range(self.streams)]

    def disconnect(self, peer_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_id, None)
            streams = self._streams.pop(peer_id, [])
        for s in streams:
            s.close()

    def read(self, peer_id: str, request_id: str, descriptors: Descriptors) -> int:
        return self._read(peer_id, request_id, descriptors, inline=True)

    def read_many(self, reads: Sequence[tuple[str, str, Descriptors]]) -> list[int]:
        """Each read queued on its streams (none inline unless alone: the streams move them in
        parallel). A burst's reads of one producer that would each go on one stream, of small
        pieces, go as one request of up to MERGE_BYTES (``ReadRequest.parts``): the producer checks
        each part against its own request's hold and sends one reply; each read is still reported
        alone, and if the producer refuses any part, each asks again alone. A request per load cost
        about 0.4 ms of this 2-core machine's CPU between the four processes (session 37: 32 loads
        of 1 block in flight moved 0.43-0.61 of one load's GB/s, joined 0.69-0.76). Reads of big
        pieces keep a request each, spread over the streams."""
        if len(reads) == 1:
            peer_id, request_id, d = reads[0]
            return [self._read(peer_id, request_id, d, inline=True)]
        ids = [0] * len(reads)
        groups: dict[str, list[list[int]]] = {}
        sizes: dict[str, tuple[int, int]] = {}  # the peer's open group: bytes, pieces
        for i, (peer_id, request_id, d) in enumerate(reads):
            if not 0 < d.nbytes < MIN_SPLIT_BYTES or d.nbytes >= MIN_SPLIT_PIECE * len(d):  # alone: see above
                ids[i] = self._read(peer_id, request_id, d, inline=False)
                continue
            nbytes, npieces = sizes.get(peer_id, (MERGE_BYTES, 0))
            if nbytes + d.nbytes > MERGE_BYTES or npieces + len(d) > MERGE_PIECES:
                groups.setdefault(peer_id, []).append([])
                nbytes, npieces = 0, 0
            groups[peer_id][-1].append(i)
            sizes[peer_id] = (nbytes + d.nbytes, npieces + len(d))
        for peer_id, chunks in groups.items():
            for chunk in chunks:
                for i, batch_id in zip(chunk, self._read_merged(peer_id, [reads[i] for i in chunk]), strict=True):
                    ids[i] = batch_id
        return ids

    def _read_merged(self, peer_id: str, reads: Sequence[tuple[str, str, Descriptors]]) -> list[int]:
        """Reads of one peer (each one stream's) as one job; a lone read, or a group with a read
        out of bounds (or no streams), goes read by read through ``_read``, which reports each."""
        with self._lock:
            streams = self._streams.get(peer_id)
        if len(reads) == 1 or not streams or any(
                check_bounds(self._table, d.local_region, d.local_offset, d.length) is not None for _, _, d in reads):
            return [self._read(peer_id, request_id, d, inline=False) for _, request_id, d in reads]
        d = Descriptors.concat([d for _, _, d in reads])
        lv = self._piece_views(d.local_region, d.local_offset, d.length)
        members = [(next(self._ids), request_id, len(rd)) for _, request_id, rd in reads]
        job = _Job(members[0][0], 0, members[0][1], d.remote_region, d.remote_offset, d.length, lv,
                   time.monotonic() + self.timeout_s, members=members)
        with self._lock:
            for (batch_id, request_id, _), (_, _, rd) in zip(members, reads, strict=True):
                self._batches[batch_id] = _Batch(batch_id, peer_id, request_id, rd.nbytes, 1)
            stream = min(streams, key=lambda s: s.outstanding)
            stream.outstanding += 1
        stream.jobs.put(job)
        return [batch_id for batch_id, _, _ in members]

    def _read(self, peer_id: str, request_id: str, descriptors: Descriptors, inline: bool) -> int:
        """``read``; ``inline``: a small read for an idle, connected stream is done on this thread
        (see ``_Stream.try_inline``): no hand-off to the stream's thread and back."""
        batch_id = next(self._ids)
        d = descriptors
        with self._lock:
            streams = self._streams.get(peer_id)
        if not streams:
            self._finish(BatchResult.failed(batch_id, peer_id, request_id, ErrorCode.PEER_LOST,
                                            f"peer {peer_id} is not connected"))
            return batch_id
        why = check_bounds(self._table, d.local_region, d.local_offset, d.length)
        if why is not None or len(d) == 0:
            self._finish(BatchResult(batch_id, peer_id, request_id, 0, why,
                                     ErrorCode.OUT_OF_BOUNDS if why else None))
            return batch_id
        assert streams is not None
        # Split by bytes into one contiguous share per stream, but only for big pieces: with
        # small ones the streams' threads fight over the GIL (512 MiB as 16384 x 32 KiB:
        # 2.9 GB/s on one stream, 2.2 on two; as 64 x 8 MiB: 5.6 on one, 5.5-6 on two).
        n_streams = len(streams) if d.nbytes >= MIN_SPLIT_BYTES and d.nbytes / len(d) >= MIN_SPLIT_PIECE else 1
        cum = np.cumsum(d.length)
        bounds = np.searchsorted(cum, cum[-1] * np.arange(1, n_streams) / n_streams, side="left")
        cuts = [0, *sorted(set(int(b) + 1 for b in bounds if 0 <= b < len(d) - 1)), len(d)]
        parts = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
        deadline = time.monotonic() + self.timeout_s
        batch = _Batch(batch_id, peer_id, request_id, d.nbytes, len(parts))
        jobs = []
        for i, (a, b) in enumerate(parts):
            lv = self._piece_views(d.local_region[a:b], d.local_offset[a:b], d.length[a:b])
            jobs.append(_Job(batch_id, i, request_id, d.remote_region[a:b], d.remote_offset[a:b], d.length[a:b], lv,
                             deadline))
        with self._lock:
            self._batches[batch_id] = batch
            # the least-loaded streams first (a stable sort: ties keep the stream order), one part each
            order = sorted(streams, key=lambda s: s.outstanding)
            chosen = [order[i % len(order)] for i in range(len(jobs))]
            for s in chosen:
                s.outstanding += 1
            # alone: no other read of this plane in flight, and its stream had nothing else to do
            alone = len(self._batches) == 1 and len(jobs) == 1 and chosen[0].outstanding == 1
        if inline and alone and d.nbytes <= INLINE_READ_BYTES and chosen[0].try_inline(jobs[0]):
            return batch_id
        for s, job in zip(chosen, jobs, strict=True):
            s.jobs.put(job)
        return batch_id

    def _piece_views(self, regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
        """A memoryview of each (region, offset, length) piece of this rank's registered regions."""
        views = self._views
        return [views[r][o : o + k] for r, o, k in zip(regions.tolist(), offsets.tolist(), lengths.tolist(),
                                                       strict=True)]

    def _part_done(self, stream: _Stream, job: _Job, code: ErrorCode | None, error: str | None) -> None:
        """A job done (``error`` None) or failed: its part of its batch, or every read it merged."""
        finished: list[_Batch] = []
        with self._lock:
            stream.outstanding -= 1
            for batch_id in [m[0] for m in job.members] or [job.batch_id]:
                b = self._batches.get(batch_id)
                if b is None:
                    continue
                if error and b.error is None:
                    b.error, b.code = error, code
                b.parts_left -= 1
                if not b.parts_left:
                    del self._batches[batch_id]
                    finished.append(b)
        for b in finished:
            self._finish(BatchResult(b.batch_id, b.peer_id, b.request_id, b.nbytes if b.error is None else 0,
                                     b.error, b.code))

    def counters(self) -> dict[str, float]:
        with self._lock:
            return {"spliced_bytes": self.spliced_bytes, "copied_bytes": self.copied_bytes}

    def broken(self) -> str | None:
        if self._closed.is_set():
            return "the plane is closed"
        return None

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for peer in list(self._streams):
            self.disconnect(peer)
        for srv in (self._tcp, self._unix):
            srv.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._server_threads:
            t.join(timeout=5)
        try:
            os.unlink(self._unix_path)
        except OSError:
            pass
