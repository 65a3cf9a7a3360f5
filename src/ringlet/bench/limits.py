"""``ringlet bench limits``: this machine's ceilings, for judging the collectives.

Measured with plain sockets and numpy in separate processes on loopback, with
the operating system's default socket buffers and the congestion control
ringlet itself uses between ranks of one host (Reno, unless
``RINGLET_LOCAL_RENO=0``; ``--congestion`` picks another):

* TCP one way: one process streams to another in 4 MiB sends.
* TCP both ways: two processes each send to and receive from the other at
  the same time over one connection, the pattern of a 2-rank ring.
* TCP ring of N: N processes, each sending to the next and receiving from
  the previous at once (ring all-reduce, reduce-scatter, all-gather).
* TCP chain of N: N-1 links 0->1->...->N-1 all busy at once (pipelined
  broadcast and reduce); the middle processes send and receive.
  Each process is one thread driving its sockets non-blocking with poll(2),
  like ringlet's engine.  Every link carries the same bytes (256 MiB, the
  sweeps' largest size) per transfer, all links at once; the rate is those
  bytes / (the last byte anywhere - the first sender's start), per link and
  per direction, the median over transfers repeated for ``duration``
  seconds.  That is how a collective is timed: it ends with its slowest
  link.  Each link's own rate (its first to last byte), averaged, is kept
  too ("tcp_separate"): on a machine with fewer cores than streams the
  links share the CPUs unevenly and that mean reads up to ~25% higher.
  The one-way stream is also timed walking buffers as large as the
  transfer ("tcp_one_way_dram"), as a collective of that size does, instead
  of reusing one 4 MiB buffer that stays in cache: shown, not judged; it
  tells a slow memory phase of the machine from a slow collective.
* Round trip: 8-byte ping-pong, with a blocking receive, and with a polling
  receive (non-blocking ``recv`` with ``sched_yield()`` between tries, the
  policy of ringlet's ``spin_us``), for one pair and for two pairs at once
  (four processes: more than the cores of a 2-core machine).  Python adds
  about 1-2 us per send and receive to these numbers.
* memcpy and float32 add: bytes of the destination written per second, for
  64 MiB arrays (memory bound) and 256 KiB arrays (in cache); the add with
  numpy and with ringlet's C kernel (``_core.reduce_kernel``).  The 64 MiB
  memcpy is timed also in N processes at once (the sum of their rates), for
  the memory-bandwidth bound of the shared-memory algorithms: ``shm_bytes``
  gives the bytes each rank reads and writes, ``memory_bound`` the time they
  take at the memcpy rate (docs/algorithms.md, "Memory-bandwidth bound on
  one host").

Example::

    ringlet bench limits --json limits.json
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import socket
import time
from statistics import median
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["measure", "format_limits", "ceilings", "median_limits", "ringlet_congestion",
           "resolve_congestion", "shm_bytes", "memory_bound", "BOUND_OPS"]

CHUNK = 4 << 20
_PIPE_TIMEOUT = 60.0
# Bytes each link carries per timed transfer: the largest size of the sweeps,
# so that a late start of one process is a small part of the time.
VOLUME = 256 << 20


class LimitsError(RuntimeError):
    """A measuring process failed or stopped answering."""


def _context():
    # forkserver: the measuring processes fork from one server that already
    # imported this module, so a dozen of them start in well under a second
    # (spawn would re-import numpy and ringlet in each).  Never plain fork:
    # the caller may run threads.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return mp.get_context("spawn")


def _recv(conn, what: str):
    if not conn.poll(_PIPE_TIMEOUT):
        raise LimitsError(f"limits: a measuring process did not report {what} within "
                          f"{_PIPE_TIMEOUT:.0f} s")
    return conn.recv()


def _listener() -> socket.socket:
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind(("127.0.0.1", 0))
    ls.listen(8)
    return ls


def _prepare(s: socket.socket, congestion: Optional[str]) -> socket.socket:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion:
        # Set on both ends once connected, as ringlet's engine does; a name the
        # kernel refuses is an error here (unlike in ringlet, which keeps the
        # system's): a ceiling must say what it measured.
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    s.settimeout(_PIPE_TIMEOUT)
    return s


def _congestion_of(s: socket.socket) -> str:
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def _connect(port: int, congestion: Optional[str]) -> socket.socket:
    return _prepare(socket.create_connection(("127.0.0.1", port), timeout=_PIPE_TIMEOUT),
                    congestion)


def _accept(ls: socket.socket, congestion: Optional[str]) -> socket.socket:
    ls.settimeout(_PIPE_TIMEOUT)
    s, _ = ls.accept()
    return _prepare(s, congestion)


def resolve_congestion(congestion: Optional[str]) -> Optional[str]:
    """The congestion control ``measure(congestion=...)`` sets: a name, or None
    for the system's default.  ValueError when the kernel refuses it."""
    if congestion is not None and (not isinstance(congestion, str) or not congestion):
        raise ValueError(f"congestion must be a non-empty name or None, got {congestion!r}")
    name = ringlet_congestion() if congestion == "ringlet" else (
        None if congestion in (None, "system") else congestion)
    if name is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
        except OSError as exc:
            try:
                with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
                    allowed = f.read().split()
            except OSError:
                allowed = []
            raise ValueError(f"congestion control {name!r} refused by the kernel "
                             f"({exc.strerror}); allowed here: "
                             f"{', '.join(allowed) or 'unknown'}") from None
    return name


def ringlet_congestion() -> Optional[str]:
    """The congestion control ringlet gives connections between ranks of one
    host: "reno" while its ``local_reno`` knob is on (``RINGLET_LOCAL_RENO``,
    else ``_core.set_tuning``), else None: the system's default."""
    from .. import _core
    from .._world import _tuning_from_env

    on = _tuning_from_env().get("local_reno", _core.get_tuning()["local_reno"])
    return "reno" if on else None


# ---- streams ---------------------------------------------------------------------
def _flow_worker(idx: int, sends_to: Optional[int], recvs_from: Optional[int],
                 volume: int, conn, span: int = CHUNK,
                 congestion: Optional[str] = None) -> None:
    """Send ``volume`` bytes to one process and/or receive as many from another,
    once per "go" from the parent, until told to stop.  The bytes come from
    and go to buffers of ``span`` bytes, walked and wrapped around.

    One thread drives both directions over non-blocking sockets with poll(2),
    as ringlet's progress engine does.  When the process sends to and
    receives from the same peer, one connection carries both directions
    (ringlet's 2-rank ring does the same).  Per transfer it reports when it
    started, and (if it receives) when its first and last bytes arrived.
    """
    try:
        ls = _listener()
        conn.send(ls.getsockname()[1])
        ports = conn.recv()
        same = sends_to is not None and sends_to == recvs_from
        out = inp = None
        if same:  # the lower index connects, the other accepts
            inp = out = (_connect(ports[sends_to], congestion) if idx < sends_to
                         else _accept(ls, congestion))
        else:
            out = _connect(ports[sends_to], congestion) if sends_to is not None else None
            inp = _accept(ls, congestion) if recvs_from is not None else None
        ls.close()
        # Only the buffers this process uses, every page written before timing.
        # Large ones come from numpy, which asks for transparent huge pages,
        # as the sweeps' buffers do.
        sbuf = rbuf = memoryview(b"")
        if out is not None:
            if span > CHUNK:
                sbuf = memoryview(np.resize(np.frombuffer(os.urandom(1024), np.uint8), span))
            else:
                sbuf = memoryview(bytearray(os.urandom(1024)) * (CHUNK // 1024))
        if inp is not None:
            rbuf = memoryview(np.ones(span, np.uint8) if span > CHUNK else bytearray(CHUNK))
        for s_ in {s for s in (out, inp) if s is not None}:
            s_.setblocking(False)
        poller = select.poll()
        conn.send("ready")
        cc = sorted({_congestion_of(s_) for s_ in (out, inp) if s_ is not None})
        while conn.recv() == "go":
            clock = time.perf_counter
            t_start = clock()
            hard_stop = t_start + _PIPE_TIMEOUT
            sent = 0 if out is not None else volume
            got = 0 if inp is not None else volume
            first = last = None
            while sent < volume or got < volume:
                if sent < volume:
                    try:
                        off = sent % span
                        sent += out.send(sbuf[off:off + min(CHUNK, span - off, volume - sent)])
                    except BlockingIOError:
                        pass
                while got < volume:
                    try:
                        off = got % span if span > CHUNK else 0
                        n = inp.recv_into(rbuf[off:off + min(CHUNK, span - off, volume - got)])
                    except BlockingIOError:
                        break
                    if n == 0:
                        raise LimitsError("peer closed the stream")
                    got += n
                    last = clock()
                    if first is None:
                        first = last
                if sent < volume or got < volume:
                    if clock() > hard_stop:
                        raise LimitsError("stream did not finish")
                    ev = {}
                    if sent < volume:
                        ev[out.fileno()] = select.POLLOUT
                    if got < volume:
                        ev[inp.fileno()] = ev.get(inp.fileno(), 0) | select.POLLIN
                    for fd, mask in ev.items():
                        poller.register(fd, mask)
                    poller.poll(100)
                    for fd in ev:
                        poller.unregister(fd)
            conn.send(("ok", {"start": t_start if out is not None else None,
                              "first": first, "last": last, "congestion": cc}))
        conn.send(("ok", None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"process {idx}: {exc!r}"))


def _reap(procs) -> None:
    """Join the workers, killing any that outlive a short grace period."""
    for p in procs:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join()


def _ready(pipes) -> None:
    """Wait until every worker is ready; a worker that failed while setting up
    (a refused socket option, say) reports its error instead."""
    for c in pipes:
        msg = _recv(c, "readiness")
        if msg != "ready":
            raise LimitsError(msg[1] if isinstance(msg, tuple) and len(msg) == 2 else repr(msg))


def _go_and_collect(pipes) -> list:
    """Wait until every worker is ready, start them together, return their results."""
    _ready(pipes)
    for c in pipes:
        c.send("go")
    return _collect(pipes)


def _collect(pipes) -> list:
    results = []
    for c in pipes:
        status, res = _recv(c, "its result")
        if status != "ok":
            raise LimitsError(res)
        results.append(res)
    return results


def _flows(links: List[Tuple[int, int]], nprocs: int, duration: float,
           volume: int = VOLUME, span: int = CHUNK, congestion: Optional[str] = None,
           seen: Optional[set] = None) -> Tuple[float, float]:
    """Run the given (src, dst) links at once, each carrying ``volume`` bytes
    from and into buffers of ``span`` bytes, repeatedly for about
    ``duration`` seconds (at least 3 transfers), over connections using
    ``congestion`` control (None: the system's).  The names the sockets
    reported are added to ``seen``.

    Returns two per-link GB/s figures, medians over the transfers:
    ``volume`` / (last byte anywhere - first sender's start), the rate at
    which every link carries the same bytes (what a collective needs: it ends
    with its slowest link); and the mean over links of each link's own rate
    (first to last byte), which counts a link that finished early at its own
    pace and so reads higher whenever the links share the CPUs unevenly.
    """
    ctx = _context()
    sends = {s: d for s, d in links}
    recvs = {d: s for s, d in links}
    procs, pipes = [], []
    try:
        for i in range(nprocs):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_flow_worker,
                            args=(i, sends.get(i), recvs.get(i), volume, b, span,
                                  congestion),
                            daemon=True)
            p.start()
            procs.append(p)
            pipes.append(a)
        ports = [_recv(c, "its port") for c in pipes]
        for c in pipes:
            c.send(ports)
        _ready(pipes)
        together: List[float] = []
        separate: List[float] = []
        stop = time.perf_counter() + duration
        while len(together) < 3 or time.perf_counter() < stop:
            for c in pipes:
                c.send("go")
            res = _collect(pipes)
            if seen is not None:
                seen.update(c for r in res for c in r["congestion"])
            start = min(r["start"] for r in res if r["start"] is not None)
            last = max(r["last"] for r in res if r["last"] is not None)
            together.append(volume / (last - start) / 1e9)
            own = [volume / (r["last"] - r["first"]) / 1e9 for r in res
                   if r["last"] is not None and r["last"] > r["first"]]
            separate.append(sum(own) / len(own) if own else 0.0)
        for c in pipes:
            c.send("stop")
        _collect(pipes)
        return median(together), median(separate)
    finally:
        _reap(procs)


# ---- round trip ---------------------------------------------------------------
def _pingpong_worker(role: int, mode: str, duration: float, conn,
                     congestion: Optional[str] = None) -> None:
    try:
        if role == 0:
            ls = _listener()
            conn.send(ls.getsockname()[1])
            s = _accept(ls, congestion)
            ls.close()
        else:
            s = _connect(conn.recv(), congestion)
        cc = _congestion_of(s)
        conn.send("ready")
        conn.recv()
        buf = bytearray(8)
        view = memoryview(buf)
        poll = mode == "polling"
        if poll:
            s.setblocking(False)
        dontwait = socket.MSG_DONTWAIT
        yield_ = os.sched_yield

        def recv8() -> None:
            got = 0
            while got < 8:
                if poll:
                    try:
                        n = s.recv_into(view[got:], 8 - got, dontwait)
                    except BlockingIOError:
                        yield_()
                        continue
                else:
                    n = s.recv_into(view[got:], 8 - got)
                if n == 0:
                    raise ConnectionError("peer closed")
                got += n

        def send8() -> None:
            while True:
                try:
                    s.send(buf)
                    return
                except BlockingIOError:
                    yield_()

        rtts: List[float] = []
        if role == 0:
            stop = time.perf_counter() + duration
            clock = time.perf_counter
            while clock() < stop:
                t0 = clock()
                send8()
                recv8()
                rtts.append(clock() - t0)
            buf[0] = 255  # tell the echoer to stop
            send8()
        else:
            while True:
                recv8()
                send8()
                if buf[0] == 255:
                    break
        s.close()
        conn.send(("ok", (rtts, cc)))
    except BaseException as exc:  # noqa: BLE001
        conn.send(("error", f"ping-pong {role}: {exc!r}"))


def _pingpong(mode: str, pairs: int, duration: float, congestion: Optional[str] = None,
              seen: Optional[set] = None) -> float:
    """Median round trip (us) of the first pair while ``pairs`` pairs run at once
    (``congestion`` and ``seen`` as for ``_flows``)."""
    ctx = _context()
    procs, pipes = [], []
    try:
        for _ in range(pairs):
            for role in (0, 1):
                a, b = ctx.Pipe()
                p = ctx.Process(target=_pingpong_worker,
                                args=(role, mode, duration, b, congestion), daemon=True)
                p.start()
                procs.append(p)
                pipes.append(a)
        for k in range(pairs):
            pipes[2 * k + 1].send(_recv(pipes[2 * k], "its port"))
        results = _go_and_collect(pipes)
        if seen is not None:
            seen.update(cc for _, cc in results)
        rtts = [x for k in range(pairs) for x in results[2 * k][0]]
        # Skip the first tries (connection warm-up, page faults).
        rtts = rtts[min(len(rtts) // 10, 100):] or rtts
        return median(rtts) * 1e6 if rtts else 0.0
    finally:
        _reap(procs)


# ---- memory ------------------------------------------------------------------
def _rate(fn, nbytes: int, duration: float) -> float:
    """Median GB/s of ``fn()`` (which writes ``nbytes``) over ``duration`` seconds."""
    fn()
    times = []
    stop = time.perf_counter() + duration
    while time.perf_counter() < stop or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / median(times) / 1e9


def _memory(duration: float) -> Dict[str, Dict[str, float]]:
    from .. import _core
    from .._dtypes import dtype_code

    f32 = dtype_code(np.float32)
    out: Dict[str, Dict[str, float]] = {"memcpy": {}, "add_f32_numpy": {},
                                        "add_f32_ringlet": {}}
    for label, nbytes in (("64MiB", 64 << 20), ("256KiB", 256 << 10)):
        n = nbytes // 4
        a = np.full(n, 1.0, np.float32)
        b = np.full(n, 2.0, np.float32)
        reps = max(1, (4 << 20) // nbytes)  # batch tiny calls so timer overhead vanishes

        def copy() -> None:
            for _ in range(reps):
                np.copyto(a, b)

        def add_np() -> None:
            for _ in range(reps):
                np.add(a, b, out=a)

        def add_rl() -> None:
            for _ in range(reps):
                _core.reduce_kernel(a, a, b, f32, 0)

        out["memcpy"][label] = _rate(copy, nbytes * reps, duration)
        a.fill(0.0)
        out["add_f32_numpy"][label] = _rate(add_np, nbytes * reps, duration)
        a.fill(0.0)
        out["add_f32_ringlet"][label] = _rate(add_rl, nbytes * reps, duration)
    return out


def core_roundtrip() -> Optional[Dict[str, Any]]:
    """The cache line round trip between the first two CPUs this process may
    use (``{"cpus": [a, b], "ns": ...}``); None with fewer than two.

    On a virtual machine it tells the host's placement of the two vCPUs,
    which sets what every byte staged from one rank to the other costs
    (docs/experiments.md): benchmarks record it beside each round.
    """
    from .. import _core

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if len(cpus) < 2:
        return None
    ns = _core.core_roundtrip_ns(cpus[0], cpus[1])
    if ns is None:
        raise LimitsError(f"timing a cache line between CPUs {cpus[0]} and {cpus[1]} failed "
                          "(affinity refused or no progress within 2 s)")
    return {"cpus": cpus[:2], "ns": ns}


def _copy_worker(nbytes: int, duration: float, conn) -> None:
    """Copy ``nbytes`` arrays back and forth for ``duration`` seconds after "go";
    report (start, end, bytes copied)."""
    try:
        a = np.full(nbytes, 1, np.uint8)
        b = np.full(nbytes, 2, np.uint8)
        np.copyto(a, b)  # every page faulted in before timing
        conn.send("ready")
        conn.recv()
        clock = time.perf_counter
        t0 = clock()
        copies = 0
        while True:
            np.copyto(a, b)
            copies += 1
            t1 = clock()
            if t1 - t0 >= duration:
                break
        conn.send(("ok", (t0, t1, copies * nbytes)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"memcpy process: {exc!r}"))


def _memcpy_together(nprocs: int, duration: float, nbytes: int = 64 << 20) -> float:
    """GB/s copied by ``nprocs`` processes at once, summed: all bytes copied over
    the span from the first start to the last end."""
    ctx = _context()
    procs, pipes = [], []
    try:
        for _ in range(nprocs):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_copy_worker, args=(nbytes, duration, b), daemon=True)
            p.start()
            procs.append(p)
            pipes.append(a)
        res = _go_and_collect(pipes)
        span = max(r[1] for r in res) - min(r[0] for r in res)
        return sum(r[2] for r in res) / span / 1e9
    finally:
        _reap(procs)


# ---- memory-bandwidth bound of the shared-memory algorithms ----------------------
# The ops with a bound: every op that moves data.
BOUND_OPS = ("all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather",
             "all_to_all", "gather", "scatter", "sendrecv")


def shm_bytes(op: str, nranks: int, nbytes: int, *,
              slots: bool = False) -> List[Tuple[int, int]]:
    """(bytes read, bytes written) in memory by each rank in the shared-memory
    algorithm family of ``op`` (rank 0 is the root; for ``sendrecv`` rank 0
    sends to rank 1).

    The family: copy-in to the rank's slot, each rank reduces 1/P of the data
    reading every rank's slot, copy-out; broadcast copies in once and every
    reader copies out.  ``nbytes`` is the size ``ringlet bench`` reports: the
    buffer of all_reduce, broadcast, reduce and sendrecv; the whole P-block
    buffer of the others.  By default only the user's buffers count: a
    message of 16 MiB or more streams them from and to memory, while the
    slots are a ring of segments reused as the pipeline advances, so what is
    written there is read back from the caches.  ``slots=True`` counts every
    copy (the traffic when the slots hold whole messages).  The 2-rank pair
    form of all_reduce and reduce moves the same user bytes (its reduction
    reads the buffer the copy-in just read, from the caches).
    docs/algorithms.md derives each line.

    Raises:
        ValueError: an op without data (barrier), ``nranks`` < 2 or ``nbytes`` < 0.
    """
    if op not in BOUND_OPS:
        raise ValueError(f"no memory bound for {op!r}; ops: {', '.join(BOUND_OPS)}")
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 2:
        raise ValueError(f"nranks must be an int >= 2, got {nranks!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    n, p = nbytes, nranks
    b = n // p  # one rank's block (the sweep's sizes are whole blocks)
    s = 1 if slots else 0  # slot traffic counts only with slots=True
    if op == "all_reduce":
        # copy-in reads the input (n) and writes the slot (n); the reduction
        # reads 1/P from each of P slots (n) and writes 1/P (b); copy-out
        # reads the result (n) and writes the output (n).
        return [(n + s * 2 * n, n + s * (n + b))] * p
    if op == "broadcast":  # the root copies in; every reader copies out
        return [(n, s * n)] + [(s * n, n)] * (p - 1)
    if op == "reduce":  # copy-in and the reduction everywhere; the root also copies out
        return ([(n + s * 2 * n, n + s * (n + b))]
                + [(n + s * n, s * (n + b))] * (p - 1))
    if op == "reduce_scatter":  # copy-in (n, n); reduce 1/P into the output (n, b)
        return [(n + s * n, b + s * n)] * p
    if op == "all_gather":  # copy-in the own block (b, b); copy every block out (n, n)
        return [(b + s * n, n + s * b)] * p
    if op == "all_to_all":  # copy-in every block (n, n); copy out those for me (n, n)
        return [(n + s * n, n + s * n)] * p
    if op == "gather":  # each copies its block in; the root copies every block out
        return [(b + s * (n - b), n)] + [(b, s * b)] * (p - 1)
    if op == "scatter":  # the root copies the others' blocks in; each copies its own out
        return [(n, b + s * (n - b))] + [(s * b, b)] * (p - 1)
    return [(n, s * n), (s * n, n)] + [(0, 0)] * (p - 2)  # sendrecv: copy-in, copy-out


def memory_bound(limits: Dict[str, Any], op: str, nranks: int, nbytes: int) -> Optional[float]:
    """Seconds ``op`` needs at least, by memory traffic alone, on the machine of
    ``limits`` (``measure()``'s result); None when ``limits`` lacks the memcpy rates.

    A memcpy of n bytes reads n and writes n in n / C seconds (C: the memcpy
    rate), so the traffic R + W of a rank takes (R + W) / 2C.  The ranks run
    at once: the busiest rank needs its traffic over one process's rate, and
    the host needs every rank's traffic over P processes' summed rate; the
    bound is the larger.  Traffic is ``shm_bytes``' default: the user's
    buffers.
    """
    one = (limits.get("memcpy") or {}).get("64MiB")
    together = (limits.get("memcpy_procs") or {}).get(str(nranks))
    if not one or not together:
        return None
    per = [r + w for r, w in shm_bytes(op, nranks, nbytes)]
    return max(max(per) / (2 * one * 1e9), sum(per) / (2 * together * 1e9))


# ---- driver --------------------------------------------------------------------
def measure(nranks: int = 4, duration: float = 1.0,
            progress=None, volume: int = VOLUME,
            congestion: Optional[str] = "ringlet") -> Dict[str, Any]:
    """Measure every ceiling; returns a JSON-ready dict (rates in GB/s, times in us).

    Args:
        nranks: also measure a ring and a chain of this many processes (>= 3).
        duration: seconds per stream measurement (round trips get half).
        progress: optional callable(str) told what is being measured.
        volume: bytes each link carries per timed transfer.
        congestion: TCP congestion control of the measuring connections:
            "ringlet" (what ringlet's own same-host connections use, see
            ``ringlet_congestion``), "system" or None (the kernel's default),
            or a name such as "cubic".  The name the sockets reported is
            kept as ``congestion``.
    Raises:
        ValueError: bad arguments.  LimitsError: a measuring process failed
        (also when the kernel refuses ``congestion``).
    """
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 2:
        raise ValueError(f"nranks must be an int >= 2, got {nranks!r}")
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    if isinstance(volume, bool) or not isinstance(volume, int) or volume < CHUNK:
        raise ValueError(f"volume must be an int >= {CHUNK} bytes, got {volume!r}")
    cc = resolve_congestion(congestion)
    say = progress or (lambda s: None)
    res: Dict[str, Any] = {"nranks": nranks, "duration_s": duration, "chunk_bytes": CHUNK,
                           "volume_bytes": volume}
    seen: set = set()

    def flows(links, nprocs, span=CHUNK):
        return _flows(links, nprocs, duration, volume, span, cc, seen)

    # The ceilings are the rates at which every link carries the same bytes
    # (a collective ends with its slowest link); "tcp_separate" keeps each
    # link's own rate, averaged, which reads higher when links share the
    # cores unevenly (docs/benchmarks.md, "The TCP ceiling";
    # docs/experiments.md, "The ceiling, timed as a collective is").
    sep: Dict[str, Any] = {}
    say("TCP one way")
    res["tcp_one_way"], sep["one_way"] = flows([(0, 1)], 2)
    say("TCP one way, from and into memory")
    res["tcp_one_way_dram"], _ = flows([(0, 1)], 2, span=volume)
    say("TCP both ways")
    res["tcp_both_ways"], sep["both_ways"] = flows([(0, 1), (1, 0)], 2)
    res["tcp_ring"] = {"2": res["tcp_both_ways"]}
    res["tcp_chain"] = {"2": res["tcp_one_way"]}
    sep["ring"] = {"2": sep["both_ways"]}
    sep["chain"] = {"2": sep["one_way"]}
    if nranks > 2:
        n = str(nranks)
        say(f"TCP ring of {n}")
        res["tcp_ring"][n], sep["ring"][n] = flows(
            [(i, (i + 1) % nranks) for i in range(nranks)], nranks)
        say(f"TCP chain of {n}")
        res["tcp_chain"][n], sep["chain"][n] = flows(
            [(i, i + 1) for i in range(nranks - 1)], nranks)
    res["tcp_separate"] = sep
    rt: Dict[str, float] = {}
    for mode in ("blocking", "polling"):
        for pairs in (1, 2):
            say(f"round trip, {mode}, {pairs} pair(s)")
            rt[f"{mode}_{pairs}pair"] = _pingpong(mode, pairs, duration / 2, cc, seen)
    res["rtt_us"] = rt
    res["congestion"] = ",".join(sorted(seen))
    say("memcpy and float32 add")
    res.update(_memory(duration / 2))
    procs = sorted({2, nranks})
    say(f"memcpy in {' and '.join(map(str, procs))} processes at once")
    res["memcpy_procs"] = {str(p): _memcpy_together(p, duration / 2) for p in procs}
    say("cache line round trip between two CPUs")
    rt2 = core_roundtrip()
    if rt2 is not None:
        res["core_rtt_ns"] = rt2["ns"]
        res["core_rtt_cpus"] = ",".join(map(str, rt2["cpus"]))
    return res


def median_limits(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Combine several ``measure()`` results: the median of every rate and time.

    The ceilings drift over a long sweep (one 1-second measurement at its
    start has read 2.2 and 3.0 GB/s on the same day), so ``ringlet bench
    --limits`` measures before every round and judges against the median.
    The settings (``nranks``, ``duration_s``, ``chunk_bytes``,
    ``volume_bytes``, ``congestion``) must agree;
    ``samples`` records how many measurements went in.
    """
    if not samples:
        raise ValueError("median_limits needs at least one measurement")
    settings = ("nranks", "duration_s", "chunk_bytes", "volume_bytes", "congestion",
                "core_rtt_cpus")
    for s in samples[1:]:
        for k in settings:
            if s.get(k) != samples[0].get(k):
                raise ValueError(f"limits measured with different {k}: "
                                 f"{samples[0].get(k)!r} and {s.get(k)!r}")

    def merge(vals: List[Any], where: str) -> Any:
        if all(isinstance(v, dict) for v in vals):
            keys = vals[0].keys()
            if any(v.keys() != keys for v in vals):
                raise ValueError(f"limits measurements differ in the keys of {where or 'the top'}")
            return {k: merge([v[k] for v in vals], f"{where}.{k}".lstrip(".")) for k in keys}
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            return float(median(vals))
        raise ValueError(f"limits: cannot combine {where}: {vals!r}")

    out = merge([{k: v for k, v in s.items() if k not in settings + ("samples",)}
                 for s in samples], "")
    out.update({k: samples[0][k] for k in settings if k in samples[0]})
    out["samples"] = len(samples)
    return out


def ceilings(limits: Dict[str, Any], nranks: int) -> Dict[str, float]:
    """Translate the TCP limits into a busbw ceiling (GB/s) per op for ``nranks`` ranks.

    See docs/benchmarks.md: ring ops (all_reduce, reduce_scatter, all_gather)
    send and receive on two connections at once, so their busbw is bounded by
    the per-link rate of a ring of ``nranks``; chain ops (broadcast, reduce)
    by the per-link rate of a chain of ``nranks``; all_to_all, like the ring,
    sends and receives at once; gather/scatter by the root's one link rate.
    """
    n = str(nranks)
    ring = limits.get("tcp_ring", {}).get(n)
    chain = limits.get("tcp_chain", {}).get(n)
    one = limits.get("tcp_one_way")
    out: Dict[str, float] = {}
    if ring:
        for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
            out[op] = ring
    if chain:
        out["broadcast"] = out["reduce"] = chain
    if one:
        out["gather"] = out["scatter"] = out["sendrecv"] = one
    return out


def format_limits(res: Dict[str, Any]) -> str:
    """The limits as a small table."""
    k = res.get("samples", 1)
    vol = res.get("volume_bytes")
    how = (f"every link carries {vol >> 20} MiB per transfer, median over ~{res['duration_s']:g} s"
           if vol else f"{res['duration_s']:g} s per stream")
    cc = res.get("congestion")
    lines = [f"# ringlet bench limits (loopback TCP{f' ({cc})' if cc else ''}, "
             "OS default socket buffers; "
             f"{how}, {res['chunk_bytes'] >> 20} MiB sends"
             + (f"; median of {k} measurements, one before each round)" if k > 1 else ")"),
             f"{'measure':<50} {'value':>10}  unit"]

    def row(name: str, v: float, unit: str) -> None:
        lines.append(f"{name:<50} {v:>10.2f}  {unit}")

    sep = res.get("tcp_separate", {})
    row("TCP one way (1 stream)", res["tcp_one_way"], "GB/s")
    if "tcp_one_way_dram" in res and vol:
        row(f"  from and into {vol >> 20} MiB buffers (not judged)", res["tcp_one_way_dram"],
            "GB/s")
    row("TCP both ways at once (per direction)", res["tcp_both_ways"], "GB/s")
    if "both_ways" in sep:
        row("  each direction timed on its own, mean", sep["both_ways"], "GB/s")
    for kind in ("ring", "chain"):
        for n, v in sorted(res[f"tcp_{kind}"].items(), key=lambda kv: int(kv[0])):
            if n != "2":
                row(f"TCP {kind} of {n} (per link)", v, "GB/s")
                if n in sep.get(kind, {}):
                    row("  each link timed on its own, mean", sep[kind][n], "GB/s")
    for k, v in res["rtt_us"].items():
        mode, pairs = k.split("_")
        row(f"round trip 8 B, {mode} recv, {pairs[0]} pair(s) at once", v, "us")
    for what, label in (("memcpy", "memcpy (numpy)"), ("add_f32_numpy", "float32 add (numpy)"),
                        ("add_f32_ringlet", "float32 add (ringlet kernel)")):
        for size, v in res[what].items():
            row(f"{label}, {size}", v, "GB/s")
    for p, v in sorted((res.get("memcpy_procs") or {}).items(), key=lambda kv: int(kv[0])):
        row(f"memcpy (numpy), 64MiB, {p} processes at once (sum)", v, "GB/s")
    if "core_rtt_ns" in res:
        row(f"cache line round trip, CPUs {res.get('core_rtt_cpus', '?').replace(',', ' and ')}",
            res["core_rtt_ns"], "ns")
    p = res.get("nranks", 2)
    if memory_bound(res, "broadcast", p, 1 << 20) is not None:
        # busbw a copy-in/copy-out algorithm reaches at the memcpy rates, at any size
        # (the bound is linear in the size; docs/algorithms.md)
        n = 256 << 20
        for op in BOUND_OPS:
            t = memory_bound(res, op, p, n)
            row(f"memory bound, {op}, {p} ranks (busbw)", n / t / 1e9 * _busbw_factor(op, p),
                "GB/s")
    return "\n".join(lines)


def _busbw_factor(op: str, nranks: int) -> float:
    from .sweep import busbw_factor

    return busbw_factor(op, nranks)
