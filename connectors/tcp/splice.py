"""Sends on a Unix socket that hand the kernel the producer's pages instead of copying them.

``sendmsg`` copies every byte into the socket's buffers and the consumer's ``recvmsg_into``
copies it out again: two copies, one in each process. Here ``vmsplice`` puts references to the
pages of a read's pieces into a pipe and ``splice`` moves them into the Unix socket, which queues
them as page fragments: the consumer's receive is the only copy. The producer's CPU per byte falls
to page bookkeeping (``benchmarks/tcp_splice.py`` measures it beside ``sendmsg``).

The consumer copies the pages when it receives them, not when ``splice`` returns: up to a socket
buffer's worth (``UNIX_SNDBUF``) is read from the producer's memory after ``send`` returned, where
``sendmsg`` has copied every byte by then (the rest goes at the consumer's pace either way). The
pages keep the read's bytes while its hold lasts: a pull hold ends when the consumer says done
(after its receive) or abandons the load (after its stream dropped the connection), or when the
lease runs out (``timeouts.lease_s``, pushed out by every read; the consumer's own deadline,
``transfer_s``, ends its receive first unless ``lease_s`` is set lower). The engine's own
``release`` of a hold a consumer is still receiving is not covered, as with ``sendmsg`` (see
docs/data-planes.md). Pages stay referenced, read-only, until the consumer takes them or closes
its socket; the producer's memory is never written through them.

Memory the kernel will not lend by reference (``vmsplice`` fails with EFAULT or EINVAL: some
driver mappings) is sent with ``sendmsg`` from the piece it stopped at, and the Splicer copies
from then on (``copying`` says why).

Threads: a Splicer belongs to the one thread serving its connection.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import socket
from collections.abc import Callable

import numpy as np

from kvxfer.dataplane import address_view

from .wire import send_pieces

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.vmsplice.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_uint]
_libc.vmsplice.restype = ctypes.c_ssize_t
_libc.splice.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_uint]
_libc.splice.restype = ctypes.c_ssize_t
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032  # fcntl's names from Python 3.10 on; spelled out for older builds
SPLICE_F_MORE = 4
# fs.pipe-max-size's default: what an unprivileged process may ask for. Pipes count against the
# user's fs.pipe-user-pages-soft (64 MiB by default): past it the kernel gives a new pipe 2 pages,
# and the send goes on in smaller steps (logged once)
PIPE_BYTES = 1 << 20
IOV_BATCH = 256  # pieces per vmsplice call (the pipe takes what fits; the rest goes next turn)
_IOVEC = 16  # bytes per struct iovec: (void *base, size_t len)
_small_pipe_logged = False


def _call(fn: Callable[..., int], name: str, *args: object) -> int:
    """``fn(*args)``, again after a signal interrupted it; OSError naming ``name`` on failure."""
    while True:
        n = int(fn(*args))
        if n >= 0:
            return n
        e = ctypes.get_errno()
        if e != errno.EINTR:
            raise OSError(e, f"{name}: {os.strerror(e)}")


class Splicer:
    """One connection's pipe, through which a read's pieces go into its socket by reference."""

    def __init__(self) -> None:
        global _small_pipe_logged
        self.r, self.w = os.pipe()
        self.copying: str | None = None  # why this connection now sends with sendmsg, once it does
        try:
            fcntl.fcntl(self.w, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError as e:
            if not _small_pipe_logged:
                _small_pipe_logged = True
                logger.warning("tcp data plane: a splice pipe got %d bytes, not %d (%s; fs.pipe-user-pages-soft): "
                               "reads are spliced in more, smaller steps", fcntl.fcntl(self.w, F_GETPIPE_SZ),
                               PIPE_BYTES, e)

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass

    def send(self, sock: socket.socket, addresses: np.ndarray, lengths: np.ndarray) -> None:
        """Every piece (this process's ``addresses``, ``lengths``) into ``sock``, in order.
        Blocks while the consumer's socket is full, as ``sendmsg`` does (``sock`` is blocking).
        Any exception leaves the connection unusable (what is in the pipe would go next): the
        caller closes it."""
        iov = np.empty((len(addresses), 2), dtype=np.uint64)
        iov[:, 0] = addresses
        iov[:, 1] = lengths
        if self.copying is not None:
            _copy(sock, iov)
            return
        base, n, i = iov.ctypes.data, len(iov), 0
        fd = sock.fileno()
        while i < n:
            k = min(IOV_BATCH, n - i)
            try:
                got = _call(_libc.vmsplice, "vmsplice", self.w, base + i * _IOVEC, k, 0)
            except OSError as e:
                if e.errno not in (errno.EFAULT, errno.EINVAL):
                    raise
                self.copying = f"vmsplice refused the memory ({e.strerror})"
                logger.warning("tcp data plane: a connection's reads are sent with sendmsg from now on: %s",
                               self.copying)
                _copy(sock, iov[i:])
                return
            left = got
            while left:
                moved = _call(_libc.splice, "splice", self.r, None, fd, None, left, SPLICE_F_MORE)
                if moved == 0:
                    raise ConnectionError("splice moved nothing: the connection is closed")
                left -= moved
            # past the bytes queued: whole pieces, then part of the next
            ends = np.cumsum(iov[i : i + k, 1], dtype=np.int64)
            whole = int(np.searchsorted(ends, got, side="right"))
            into = got - (int(ends[whole - 1]) if whole else 0)
            i += whole
            if into:
                iov[i, 0] += np.uint64(into)
                iov[i, 1] -= np.uint64(into)


def _copy(sock: socket.socket, iov: np.ndarray) -> None:
    """The pieces of ``iov`` (address, length rows) sent with sendmsg."""
    send_pieces(sock, [address_view(a, k) for a, k in iov.tolist()])


def splice_works() -> str | None:
    """Why a Unix socket here cannot take spliced pages (seccomp, an old kernel), or None."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    buf = np.arange(8192, dtype=np.uint8)
    try:
        s = Splicer()
        try:
            s.send(a, np.array([buf.ctypes.data + 100], np.int64), np.array([5000], np.int64))
            if s.copying is not None:
                return s.copying
        finally:
            s.close()
        b.settimeout(1.0)
        got = bytearray()
        while len(got) < 5000:
            chunk = b.recv(5000 - len(got))
            if not chunk:
                break
            got += chunk
        if bytes(got) != buf[100:5100].tobytes():
            return "spliced bytes arrived changed"
        return None
    except OSError as e:
        return str(e)
    finally:
        a.close()
        b.close()
