"""The callee side of RPC connections: accept, authenticate, admit, read requests.

A mixin of ``Agent``: one accept thread; at most ``_MAX_HANDSHAKES``
unauthenticated connections, the oldest evicted beyond (docs/security.md, "RPC");
one reader thread per admitted connection hands requests to ``_dispatch``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, List, Optional

from ringlet.errors import PeerClosedError, ProtocolError, RingletError

from .._wire import codec as ser
from .current import _tls
from .protocol import _MAX_ERROR_TEXT, _MAX_HANDSHAKES, AUTH_PURPOSE, HANDSHAKE_TIMEOUT, K_CLOSE
from .transport import Connection, Stopped, UndecodableFrame, configure_socket

_log = logging.getLogger("ringlet.rpc")


class _Listener:
    """Agent's listener half (needs the attributes ``Agent.__init__`` sets)."""

    def _accept_loop(self) -> None:
        while not self.stop.is_set():
            try:
                sock, addr = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self.stop.is_set():
                    return
                if self._evict_oldest():
                    continue  # e.g. out of descriptors: one was just freed
                self._warn.warn("rpc: accept failed on worker %r: %s", self.name, e)
                self.stop.wait(0.05)  # nothing to free: do not spin
                continue
            # Unauthenticated clients cost a thread each for up to
            # HANDSHAKE_TIMEOUT; at the cap the oldest makes room.
            if len(self._handshaking) >= _MAX_HANDSHAKES:
                self._evict_oldest()
            with self._clock:
                self._handshaking[sock] = True
            threading.Thread(target=self._serve, args=(sock, addr), name=f"rpc{self.rank}-serve",
                             daemon=True).start()

    def _evict_oldest(self) -> bool:
        """Cut the oldest pending handshake (its thread then fails it); False if none."""
        with self._clock:
            victim = next(iter(self._handshaking), None)
            if victim is None:
                return False
            del self._handshaking[victim]
        try:
            victim.shutdown(socket.SHUT_RDWR)  # wakes its handshake thread at once
        except OSError:
            pass
        return True

    def _admit(self, sock: socket.socket, claim: bytes) -> bool:
        """check_claim of a handshake whose proof verified: leave the evictable set.

        An eviction that got here first wins: the socket is shut before any
        status is sent, so the client sees a cut handshake and retries.
        """
        with self._clock:
            admitted = self._handshaking.pop(sock, False)
        if not admitted:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return False
        return self._check_claim(claim)

    def _check_claim(self, claim: bytes) -> bool:
        try:
            r = int(claim.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return False
        return 0 <= r < self.world_size and claim.decode("ascii") == str(r)

    def _serve(self, sock: socket.socket, addr: Any) -> None:
        from ringlet._auth import server_handshake

        _tls.agent = self
        try:
            claim = server_handshake(sock, self._key, AUTH_PURPOSE, deadline=time.monotonic() + HANDSHAKE_TIMEOUT,
                                     check_claim=lambda c: self._admit(sock, c))
            peer = int(bytes(claim).decode("ascii"))
            configure_socket(sock)
        except (RingletError, OSError, ValueError) as e:
            with self._clock:
                self._handshaking.pop(sock, None)
                self.rejected_connections += 1
            self._warn.warn("rpc: worker %r rejected a connection from %s: %s", self.name, addr, e)
            sock.close()
            return
        conn = Connection(sock, peer_rank=peer, peer_name=self.workers[peer].name, stop=self.stop,
                          frame_timeout=self.rpc_timeout)
        with self._clock:
            if self.closed:
                conn.close()
                return
            self._in.add(conn)
        err: Optional[BaseException] = None
        decoded: List[Any] = []  # the RRefs of the frame being decoded

        def ext_decode(code: int, v: Any) -> Any:
            r = self._ext_decode(code, v)
            decoded.append(r)
            return r

        try:
            while True:
                try:
                    header, value = conn.recv_frame(limits=self.limits, allow_pickle=self.allow_pickle,
                                                    ext_decode=ext_decode)
                except UndecodableFrame:
                    for r in decoded:
                        r._released = True  # the caller releases the counts of a request refused here
                    raise
                finally:
                    decoded.clear()
                self._dispatch(conn, header, value)
                value = None  # the pool job holds what it needs; do not pin args while idle
        except Stopped:
            pass
        except UndecodableFrame as e:
            err = e
            self._reject_frame(conn, e, e.header.req_id)
        except ProtocolError as e:
            err = e
            self._reject_frame(conn, e)
        except PeerClosedError:
            pass  # the caller went away: normal at the end of a job
        except RingletError as e:
            err = e
            _log.warning("rpc: connection from %s failed: %s", self._label(peer), e)
        except Exception as e:  # a frame that decodes into nonsense (e.g. a bad RRef)
            err = ProtocolError(f"{type(e).__name__}: {e}")
            self._reject_frame(conn, err)
        finally:
            conn.close(err)
            with self._clock:
                self._in.discard(conn)

    def _reject_frame(self, conn: Connection, err: BaseException, refused: int = 0) -> None:
        """Drop ``conn`` after a frame it cannot use, telling the caller why.

        ``refused`` is the request id of a frame whose payload did not decode:
        this worker kept none of the RRefs in it, so the caller releases the
        counts it made for them (0: none).
        """
        with self._clock:
            self.rejected_frames += 1
        _log.warning("rpc: worker %r dropped the connection from %s: %s", self.name, self._label(conn.peer_rank), err)
        try:  # tell the caller why, so its pending calls fail with the reason (best effort)
            conn.send_frame(K_CLOSE, refused, ser.encode(str(err)[:_MAX_ERROR_TEXT]),
                            deadline=time.monotonic() + 1.0)
            # Half-close and discard what the peer still sends (bounded): closing
            # with unread input would send a reset that can destroy the notice.
            conn.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            budget = 1 << 20
            while budget > 0 and time.monotonic() < deadline and not self.stop.is_set():
                try:
                    chunk = conn.sock.recv(65536)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                budget -= len(chunk)
        except (RingletError, Stopped, OSError):
            pass
