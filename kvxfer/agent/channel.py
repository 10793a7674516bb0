"""A framed message stream over one end of a Unix socket pair, between an engine and its agent.

Frames are a 4-byte little-endian length and a msgpack body (msgspec Structs, tagged; nothing is
unpickled). ``send`` is safe from several threads; ``recv`` belongs to one thread at a time.

A send that fits the socket's buffer, and a receive of what is already there, are made without
releasing the GIL (libc through ``ctypes.PyDLL``, non-blocking): each takes microseconds, and a
thread that releases the GIL while another thread of its process spins in Python waits a whole
switch interval (5 ms) to get it back. So a busy engine's ``start_load`` and ``poll()`` cost it
no GIL hand-off; only a wait that must block (``recv`` with a timeout and nothing there) releases it.
"""

from __future__ import annotations

import ctypes
import errno
import select
import socket
import struct
import threading
import time
from typing import Any

import msgspec

MAX_FRAME = 64 << 20  # a hold or load of a million blocks still fits
_HEADER = struct.Struct("<I")
RECV_CHUNK = 1 << 20
_libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held through the call
_send_now = _libc.send
_send_now.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
_send_now.restype = ctypes.c_ssize_t
_recv_now = _libc.recv
_recv_now.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_recv_now.restype = ctypes.c_ssize_t
_NOW = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


_poll_now = _libc.poll  # writable(): poll(2), the GIL kept
_poll_now.argtypes = [ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.c_int]
_poll_now.restype = ctypes.c_int


class ChannelClosed(ConnectionError):
    """The other end closed the socket (its process exited or closed the channel)."""


class Channel:
    """Length-prefixed msgspec messages over a stream socket; it receives ``message_type``."""

    def __init__(self, sock: socket.socket, message_type: Any) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(message_type)
        self._send_lock = threading.Lock()
        self._buf = bytearray()
        self._chunk = bytearray(RECV_CHUNK)  # what a receive without the GIL released reads into
        self._chunk_at = ctypes.addressof(ctypes.c_char.from_buffer(self._chunk))

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Any, timeout_s: float | None = None) -> None:
        """Send one message; one the reader has not taken within ``timeout_s`` raises TimeoutError."""
        body = self._encoder.encode(msg)
        if len(body) > MAX_FRAME:
            raise ValueError(f"{type(msg).__name__} of {len(body)} bytes exceeds the channel's {MAX_FRAME}")
        whole = _HEADER.pack(len(body)) + body
        with self._send_lock:
            sent = _send_now(self.sock.fileno(), whole, len(whole), _NOW)  # the GIL kept
            if sent < 0:
                err = ctypes.get_errno()
                if err not in _AGAIN:
                    raise ChannelClosed(f"send failed: [Errno {err}] {errno.errorcode.get(err, '')}")
                sent = 0
            if sent == len(whole):  # the usual case: it fit the socket's buffer
                return
            frame = memoryview(whole)[sent:]
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while frame:
                if deadline is not None:
                    _, ready, _ = select.select([], [self.sock], [], max(0.0, deadline - time.monotonic()))
                    if not ready:
                        raise TimeoutError(f"the reader did not take {type(msg).__name__} within {timeout_s:g} s")
                try:
                    n = self.sock.send(frame) if deadline is None else self.sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError as e:
                    raise ChannelClosed(f"send failed: {e}") from None
                frame = frame[n:]

    def writable(self) -> bool:
        """Whether a small message would go out now (the reader has left the socket room).

        A zero-timeout ``poll`` through libc with the GIL kept: ``select`` releases it, and the
        agent's command thread asks this between a load it finished and that load's event, while
        the notifier thread (woken by the load's done notice) waits for the GIL: it would take it
        there and the event would wait for its Python to run."""
        fd = _PollFd(self.sock.fileno(), select.POLLOUT, 0)
        if _poll_now(ctypes.byref(fd), 1, 0) <= 0:  # not writable (or EINTR: the caller sends later)
            return False
        return bool(fd.revents & select.POLLOUT)

    def has_next(self) -> bool:
        """Whether a whole message is here to receive now (read without waiting or releasing the GIL)."""
        if self._whole():
            return True
        try:
            return self._take_now() and self._whole()
        except ChannelClosed:
            return True  # the next ``recv`` raises it

    def _whole(self) -> bool:
        return len(self._buf) >= _HEADER.size and len(self._buf) >= _HEADER.size + _HEADER.unpack_from(self._buf)[0]

    def _frame(self) -> Any | None:
        """One complete frame from the buffer, decoded, or None."""
        if len(self._buf) < _HEADER.size:
            return None
        (n,) = _HEADER.unpack_from(self._buf)
        if n > MAX_FRAME:
            raise ChannelClosed(f"a frame of {n} bytes exceeds the channel's {MAX_FRAME}")
        if len(self._buf) < _HEADER.size + n:
            return None
        body = bytes(self._buf[_HEADER.size:_HEADER.size + n])
        del self._buf[:_HEADER.size + n]
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ChannelClosed(f"an undecodable frame ({e}); the channel cannot go on") from None

    def _take_now(self) -> bool:
        """Read what is already there without releasing the GIL; False if nothing is."""
        n = _recv_now(self.sock.fileno(), self._chunk_at, RECV_CHUNK, _NOW)
        if n < 0:
            err = ctypes.get_errno()
            if err in _AGAIN:
                return False
            raise ChannelClosed(f"receive failed: [Errno {err}] {errno.errorcode.get(err, '')}")
        if n == 0:
            raise ChannelClosed("the other end closed the channel")
        self._buf += memoryview(self._chunk)[:n]
        return True

    def _fill(self, timeout_s: float | None) -> bool:
        """Read what is there (waiting up to ``timeout_s``; None: forever); False if nothing came.

        What a wait brought is read into the channel's own chunk: ``sock.recv(1 MiB)`` would
        allocate (and map) a fresh MiB for every message, about 15 us against 1."""
        if self._take_now():
            return True
        if timeout_s is not None and timeout_s <= 0:
            return False
        if timeout_s is not None:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout_s))
            return bool(ready) and self._take_now()
        try:
            n = self.sock.recv_into(self._chunk)
        except BlockingIOError:
            return False
        except OSError as e:
            raise ChannelClosed(f"receive failed: {e}") from None
        if not n:
            raise ChannelClosed("the other end closed the channel")
        self._buf += memoryview(self._chunk)[:n]
        return True

    def recv(self, timeout_s: float | None) -> Any | None:
        """The next message, waiting up to ``timeout_s`` (None: forever); None on timeout."""
        if timeout_s is None:
            while (msg := self._frame()) is None:
                self._fill(None)
            return msg
        deadline = time.monotonic() + timeout_s
        while (msg := self._frame()) is None:
            left = deadline - time.monotonic()
            if not self._fill(max(0.0, left)) and left <= 0:
                return None
        return msg

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
