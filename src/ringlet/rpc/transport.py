"""Sockets for RPC: deadline-bounded exact reads and zero-copy vectored writes.

Every socket here is in timeout mode with a short poll interval, so a thread
blocked in I/O wakes up regularly to check its deadline and the agent's stop
flag; no call can block forever.  Failures are mapped to ringlet's errors:
EOF or reset -> ``PeerClosedError``, deadline passed -> ``CollectiveTimeout``.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from typing import Any, Iterable, List, Optional

from ringlet.errors import CollectiveTimeout, PeerClosedError, ProtocolError

from .._wire import codec as ser

__all__ = ["POLL_INTERVAL", "Connection", "configure_socket", "send_buffers", "recv_exact_into"]

# How often a blocked socket call wakes up to look at its deadline and the
# stop flag.  Short enough for prompt shutdown, long enough to cost nothing.
POLL_INTERVAL = 0.2

# Linux caps one sendmsg at IOV_MAX (1024) buffers; stay well below.
_MAX_IOV = 512
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


class Stopped(Exception):
    """Internal: the agent is shutting down; the I/O loop should exit quietly."""


class UndecodableFrame(ProtocolError):
    """A frame whose header was valid but whose payload did not decode.

    Attributes:
        header: the frame's header (kind, request id, lengths).
        in_sync: the rest of the payload was read past, so the stream is at the
            next frame; False when it was not (the connection must be dropped).
    """

    def __init__(self, message: str, header: ser.Header, in_sync: bool, *, peer: int) -> None:
        super().__init__(message, peer=peer, op="rpc")
        self.header = header
        self.in_sync = in_sync


def configure_socket(sock: socket.socket) -> None:
    """Low latency for small calls, poll-interval timeouts for every blocking call."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(POLL_INTERVAL)


def _closed_error(what: str, peer: Any, exc: Optional[BaseException] = None) -> PeerClosedError:
    reason = "closed the connection" if exc is None else f"connection failed ({exc})"
    err = PeerClosedError(f"{what}: peer {peer} {reason}", peer=peer if isinstance(peer, int) else None, op="rpc")
    return err


def send_buffers(
    sock: socket.socket,
    buffers: Iterable[Any],
    *,
    deadline: float,
    stop: Optional[threading.Event] = None,
    peer: Any = None,
    what: str = "rpc send",
    written: Optional[List[int]] = None,
) -> None:
    """Write every buffer completely, in order, with ``sendmsg`` (no concatenation).

    Large numpy arrays go to the kernel straight from their own memory.
    Partial writes are resumed from where the kernel stopped.

    Args:
        written: if given, ``written[0]`` is increased by every byte handed to
            the kernel, so a caller can tell a failure that left the stream
            untouched (nothing written) from one that cut a frame.

    Raises:
        PeerClosedError: the peer reset or closed the connection.
        CollectiveTimeout: ``deadline`` (a ``time.monotonic()`` value) passed.
    """
    views: List[memoryview] = []
    for b in buffers:
        mv = b if isinstance(b, memoryview) else memoryview(b)
        if mv.nbytes:
            views.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
    i = 0
    total = 0
    while i < len(views):
        if stop is not None and stop.is_set():
            raise Stopped()
        # Checked on every pass, not only when a poll times out: a peer that
        # reads a byte now and then must not stretch the frame past it.
        if time.monotonic() > deadline:
            how = "did not accept data" if total else "accepted none of the frame"
            raise CollectiveTimeout(f"{what}: peer {peer} {how} before the deadline",
                                    peer=peer if isinstance(peer, int) else None, op="rpc")
        try:
            sent = sock.sendmsg(views[i : i + _MAX_IOV], (), _NOSIGNAL)
        except socket.timeout:
            continue
        except InterruptedError:
            continue
        except OSError as e:
            raise _closed_error(what, peer, e) from None
        total += sent
        if written is not None:
            written[0] += sent
        # Skip the buffers written completely; trim the one written partly.
        while sent and i < len(views):
            n = views[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def recv_exact_into(
    sock: socket.socket,
    mv: memoryview,
    *,
    deadline: Optional[float],
    stop: Optional[threading.Event] = None,
    idle_ok: bool = False,
    budget: Optional[float] = None,
    peer: Any = None,
    what: str = "rpc recv",
) -> None:
    """Fill ``mv`` completely from ``sock``.

    Args:
        deadline: ``time.monotonic()`` value after which waiting raises
            ``CollectiveTimeout``; None means no deadline (only for ``idle_ok``).
        stop: when set, the call raises ``Stopped`` at the next poll.
        idle_ok: waiting for the *first* byte has no deadline (an idle
            connection between frames is normal); once a byte has arrived the
            rest must come before ``deadline``, or, with ``budget``, within
            ``budget`` seconds of that first byte.

    Raises:
        PeerClosedError: EOF or reset before ``mv`` was full.
        CollectiveTimeout: the deadline passed.
    """
    got = 0
    n = mv.nbytes
    while got < n:
        if stop is not None and stop.is_set():
            raise Stopped()
        # On every pass: a peer that sends a byte now and then must not
        # stretch the frame past its deadline.
        if deadline is not None and not (idle_ok and got == 0) and time.monotonic() > deadline:
            raise CollectiveTimeout(f"{what}: peer {peer} stalled in the middle of a frame "
                                    f"({got} of {n} bytes received)",
                                    peer=peer if isinstance(peer, int) else None, op="rpc")
        try:
            k = sock.recv_into(mv[got:])
        except socket.timeout:
            continue
        except InterruptedError:
            continue
        except OSError as e:
            if stop is not None and stop.is_set():
                raise Stopped() from None
            raise _closed_error(what, peer, e) from None
        if k == 0:
            if stop is not None and stop.is_set():
                raise Stopped()
            raise _closed_error(what, peer)
        if got == 0 and budget is not None:
            deadline = time.monotonic() + budget  # the frame's clock starts at its first byte
        got += k


class Connection:
    """One authenticated RPC socket: framed sends under a lock, framed receives by one reader.

    Frames from several threads never interleave: a whole frame (header, meta
    and out-of-band buffers) is written while holding ``send_lock``.  A send
    that fails part-way leaves the stream unusable, so the connection is
    closed; one whose deadline passed before its first byte leaves it open.
    """

    def __init__(self, sock: socket.socket, *, peer_rank: int, peer_name: str, stop: threading.Event,
                 frame_timeout: float) -> None:
        self.sock = sock
        self.peer_rank = peer_rank
        self.peer_name = peer_name
        self.stop = stop
        self.frame_timeout = frame_timeout
        self.send_lock = threading.Lock()
        self.closed = False
        self.close_reason: Optional[BaseException] = None
        # Request ids awaiting a reply on this connection (caller side; guarded by the agent).
        self.pending_ids: set = set()
        # Request ids sent whose reply has not arrived, timed-out calls included
        # (caller side; guarded by the agent): what graceful shutdown stops
        # waiting for once the connection is gone.
        self.unanswered: set = set()
        # Request id -> the RRef counts made for that request's receiver, until
        # its reply arrives (caller side; guarded by the agent): released if the
        # callee refuses the request without keeping them.
        self.carried: dict = {}

    def __repr__(self) -> str:
        return f"<rpc Connection peer={self.peer_name!r} rank={self.peer_rank} closed={self.closed}>"

    def send_frame(self, kind: int, req_id: int, encoded: ser.Encoded, *, deadline: Optional[float] = None) -> None:
        """Send one frame; closes the connection if it was cut part-way (or the socket failed).

        Raises:
            PeerClosedError: the connection is (or became) closed.
            CollectiveTimeout: the peer stopped reading until the deadline.
        """
        if deadline is None:
            deadline = time.monotonic() + self.frame_timeout
        bufs = ser.encode_frame(kind, req_id, encoded)
        # Behind another thread's long send, this frame's deadline still holds.
        if not self.send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise CollectiveTimeout(f"rpc send to worker {self.peer_name!r}: another send held the "
                                    f"connection until this frame's deadline",
                                    peer=self.peer_rank, op="rpc")
        try:
            if self.closed:
                raise PeerClosedError(
                    f"rpc connection to worker {self.peer_name!r} (rank {self.peer_rank}) is closed"
                    + (f": {self.close_reason}" if self.close_reason else ""),
                    peer=self.peer_rank, op="rpc")
            written = [0]
            try:
                send_buffers(self.sock, bufs, deadline=deadline, stop=self.stop, peer=self.peer_rank,
                             what=f"rpc send to worker {self.peer_name!r}", written=written)
            except CollectiveTimeout as e:
                # A frame that timed out before its first byte left the stream
                # whole: the other calls on this connection carry on.
                if written[0]:
                    self._close_locked(e)
                raise
            except BaseException as e:
                self._close_locked(e)
                raise
        finally:
            self.send_lock.release()

    def recv_frame(self, *, limits: ser.Limits, allow_pickle: bool, ext_decode: Any = None,
                   skip_undecodable: bool = False):
        """Wait (without deadline, but stoppable) for the next frame and decode it.

        Once its header has started arriving the whole frame must arrive
        within ``frame_timeout``.

        Args:
            skip_undecodable: when a payload does not decode, read the rest of
                it (its length is the header's) so the stream stays in sync.

        Returns:
            ``(header, value)``.

        Raises:
            UndecodableFrame: a valid header, but the payload did not decode
                (a ProtocolError; with ``skip_undecodable`` the stream is at
                the next frame).
            ProtocolError: malformed or oversized header (drop the connection).
            PeerClosedError, CollectiveTimeout: see :func:`recv_exact_into`.
            Stopped: the agent is shutting down.
        """
        head = bytearray(ser.HEADER_SIZE)
        who = f"rpc recv from worker {self.peer_name!r}"
        recv_exact_into(self.sock, memoryview(head), deadline=None, budget=self.frame_timeout,
                        stop=self.stop, idle_ok=True, peer=self.peer_rank, what=who)
        header = ser.parse_header(bytes(head), limits)
        deadline = time.monotonic() + self.frame_timeout

        got = 0

        def read_into(dst: memoryview) -> None:
            nonlocal got
            recv_exact_into(self.sock, dst, deadline=deadline, stop=self.stop, peer=self.peer_rank, what=who)
            got += dst.nbytes

        reason = ""
        try:
            return header, ser.decode_payload(header, read_into, limits=limits, allow_pickle=allow_pickle,
                                              ext_decode=ext_decode)
        except ProtocolError as e:
            # The decoder refused bytes it had read whole (a failed read raises
            # PeerClosedError, CollectiveTimeout or Stopped instead).  Only the
            # text is kept: the traceback would pin what was decoded (RRefs too).
            reason = str(e)
        if skip_undecodable:
            left = header.payload_len - got
            scratch = memoryview(bytearray(min(left, 1 << 20)))
            while left:
                n = min(left, len(scratch))
                recv_exact_into(self.sock, scratch[:n], deadline=deadline, stop=self.stop,
                                peer=self.peer_rank, what=who)
                left -= n
        raise UndecodableFrame(reason, header, skip_undecodable, peer=self.peer_rank)

    def _close_locked(self, reason: Optional[BaseException]) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        try:
            # shutdown() wakes a reader blocked in recv on this socket at once.
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def close(self, reason: Optional[BaseException] = None) -> None:
        """Close the socket (idempotent).  Waits for an in-progress send at most briefly."""
        got = self.send_lock.acquire(timeout=2 * POLL_INTERVAL)
        try:
            if not got:
                # A sender is stuck on a full socket; shutting the socket down makes it fail now.
                if not self.closed:
                    try:
                        self.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                got = self.send_lock.acquire(timeout=10 * POLL_INTERVAL)
            self._close_locked(reason)
        finally:
            if got:
                self.send_lock.release()


def is_connection_refused(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) in (
        errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)


__all__ += ["Stopped", "ProtocolError", "UndecodableFrame", "is_connection_refused"]
