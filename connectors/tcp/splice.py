"""Sends on a Unix socket that hand the kernel the producer's pages instead of copying them.

``sendmsg`` copies every byte into the socket's buffers and the consumer's ``recvmsg_into``
copies it out again: two copies, one in each process. Here ``vmsplice`` puts references to the
pages of a read's pieces into a pipe and ``splice`` moves them into the Unix socket, which queues
them as page fragments: the consumer's receive is the only copy. The producer's CPU per byte falls
to page bookkeeping (``benchmarks/tcp_splice.py`` measures it beside ``sendmsg``).

The consumer copies the pages when it receives them, not when ``splice`` returns, so they must
keep the bytes of the read until then. They do while the read's hold lasts: a pull hold ends
when the consumer says done (after its receive), abandons the load, or its lease runs out
(``timeouts.lease_s``, pushed out by every read), as with ``sendmsg``, whose last socket
buffer's worth is also read after ``sendmsg`` returned only when the buffer was not full. Only the
engine's own ``release`` of a hold a consumer is still receiving is not covered (see
docs/data-planes.md). Pages stay referenced, read-only, until the consumer takes them or closes
its socket; the producer's memory is never written through them.

Threads: a Splicer belongs to the one thread serving its connection.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import socket

import numpy as np

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.vmsplice.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_uint]
_libc.vmsplice.restype = ctypes.c_ssize_t
_libc.splice.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_uint]
_libc.splice.restype = ctypes.c_ssize_t
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ from Python 3.10 on; spelled out for older builds
SPLICE_F_MORE = 4
PIPE_BYTES = 1 << 20  # fs.pipe-max-size's default: what an unprivileged process may ask for
IOV_BATCH = 256  # pieces per vmsplice call (the pipe takes what fits; the rest goes next turn)
_IOVEC = 16  # bytes per struct iovec: (void *base, size_t len)


def _check(n: int, call: str) -> int:
    if n < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{call}: {os.strerror(e)}")
    return n


class Splicer:
    """One connection's pipe, through which a read's pieces go into its socket by reference."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        try:
            fcntl.fcntl(self.w, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError as e:  # a lower fs.pipe-max-size: the default 64 KiB pipe, in more calls
            logger.debug("pipe size left at its default: %s", e)

    def close(self) -> None:
        for fd in (self.r, self.w):
            os.close(fd)

    def send(self, sock: socket.socket, addresses: np.ndarray, lengths: np.ndarray) -> None:
        """Every piece (this process's ``addresses``, ``lengths``) into ``sock``, in order.
        Blocks while the consumer's socket is full, as ``sendmsg`` does (the socket's timeout
        does not apply: the kernel's splice waits on it)."""
        iov = np.empty((len(addresses), 2), dtype=np.uint64)
        iov[:, 0] = addresses
        iov[:, 1] = lengths
        base, n, i = iov.ctypes.data, len(iov), 0
        fd = sock.fileno()
        while i < n:
            k = min(IOV_BATCH, n - i)
            got = _check(_libc.vmsplice(self.w, base + i * _IOVEC, k, 0), "vmsplice")
            left = got
            while left:
                moved = _check(_libc.splice(self.r, None, fd, None, left, SPLICE_F_MORE), "splice")
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


def splice_works() -> str | None:
    """Why a Unix socket here cannot take spliced pages (seccomp, an old kernel), or None."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    buf = np.arange(8192, dtype=np.uint8)
    try:
        s = Splicer()
        try:
            s.send(a, np.array([buf.ctypes.data + 100], np.int64), np.array([5000], np.int64))
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
