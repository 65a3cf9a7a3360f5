"""Hostile connections never delay or break the job (docs/security.md).

A separate attacker process (real sockets, its descriptor limit raised to the
hard limit) holds thousands of idle connections and some slow ones (one byte
per send, never a complete hello) to every rank's listener and to the store,
and reopens each one the server drops, while the job keeps creating new groups
(fresh connections on fresh peer pairs) and new store clients.  Everything is
synchronised on explicit signals (the attacker's "ready" line, barriers);
the only time bounds are generous upper ones derived from the op deadline.
Also: a rank's listener flooded with valid HELLOs that never send a proof
(whoever sees the traffic knows the job id), under a low descriptor limit, and
idle connections held to rank 0's shared-memory hand-over socket.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import selectors
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np

import ringlet
from ringlet import _core, _world
from ringlet.errors import AuthenticationError
from ringlet.store import Store
from ringlet.testing import run_world

from _blocked import handover_sockets

_SRC = os.path.dirname(os.path.dirname(os.path.abspath(ringlet.__file__)))  # as installed

# The attacker.  argv: JSON list of [port, kind, count, prefix_hex] and a
# reopen budget per target.  Kinds: "idle" connects and says nothing; "slow"
# sends `prefix` one byte per send (never the whole hello).  A connection the
# server closes is counted and reopened (the pressure lasts the whole test)
# until the budget is used.  Prints "ready <json>" once every first
# connection is established or refused, then serves until stdin closes and
# prints "stats <json>".
_ATTACKER = textwrap.dedent(r"""
    import json, resource, selectors, socket, sys, threading, time
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    specs = json.loads(sys.argv[1])
    budget = int(sys.argv[2])
    sel = selectors.DefaultSelector()
    stats = {str(p): {"opened": 0, "dropped": 0} for p, _, _, _ in specs}
    stop = threading.Event()
    first_left = [0]

    def open_one(port, kind, prefix, first):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.connect_ex(("127.0.0.1", port))
        stats[str(port)]["opened"] += 1
        sel.register(s, selectors.EVENT_WRITE, [port, kind, prefix, 0, first, False])

    def settle(st):
        if st[4] and not st[5]:
            st[5] = True
            first_left[0] -= 1

    for port, kind, count, prefix in specs:
        for _ in range(count):
            open_one(port, kind, bytes.fromhex(prefix), True)
            first_left[0] += 1
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    said_ready = False
    ready_by = time.monotonic() + 30.0
    while not stop.is_set():
        if not said_ready and (first_left[0] <= 0 or time.monotonic() > ready_by):
            print("ready", json.dumps(stats), flush=True)
            said_ready = True
        for key, mask in sel.select(0.05):
            s, st = key.fileobj, key.data
            port, kind, prefix, sent = st[0], st[1], st[2], st[3]
            if mask & selectors.EVENT_READ:
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if data:
                    continue  # e.g. a refusal status: the close follows
                sel.unregister(s)
                s.close()
                settle(st)
                stats[str(port)]["dropped"] += 1
                if stats[str(port)]["opened"] < budget:
                    open_one(port, kind, prefix, False)
                continue
            settle(st)  # connected (or failed: the read side reports that)
            if kind == "slow" and sent < len(prefix):
                try:
                    s.send(prefix[sent:sent + 1])
                    st[3] = sent + 1
                except OSError:
                    sel.modify(s, selectors.EVENT_READ, st)
                continue
            sel.modify(s, selectors.EVENT_READ, st)
    # Count the closes already delivered but not yet seen (no reopening now).
    while True:
        events = sel.select(0.2)
        if not events:
            break
        for key, mask in events:
            s, st = key.fileobj, key.data
            try:
                data = s.recv(4096) if mask & selectors.EVENT_READ else b"x"
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                stats[str(st[0])]["dropped"] += 1
            elif not mask & selectors.EVENT_READ:
                sel.modify(s, selectors.EVENT_READ, st)
    print("stats", json.dumps(stats), flush=True)
""")


def _start_attacker(specs, budget):
    env = dict(os.environ, PYTHONPATH=_SRC)
    proc = subprocess.Popen([sys.executable, "-c", _ATTACKER, json.dumps(specs), str(budget)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.startswith("ready "), line
    return proc, json.loads(line.split(" ", 1)[1])


def _stop_attacker(proc):
    out, _ = proc.communicate(timeout=60)
    line = [ln for ln in out.splitlines() if ln.startswith("stats ")][-1]
    return json.loads(line.split(" ", 1)[1])


# A hello prefix that is well-formed as far as it goes (magic, version, kind)
# but never completed: the listener must wait for the rest or evict it.
_RANK_PREFIX = (b"RLTH" + (1).to_bytes(2, "little") + (1).to_bytes(2, "little")
                + b"\x00" * 59).hex()  # 67 of 68 bytes
_STORE_PREFIX = (b"RLH1" + b"\x00\x01" + b"\x00" * 97).hex()  # 103 of 104 bytes


class _Counter(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.n = 0

    def emit(self, record):
        self.n += 1


def _job_under_attack(rank, P, n_idle, n_slow):
    w = _world._current()
    ports = ringlet.all_gather_object(w.ctx.port)
    out = {}
    if rank == 0:
        specs = []
        for port in ports + [w.store.port]:
            prefix = _STORE_PREFIX if port == w.store.port else _RANK_PREFIX
            specs += [[port, "idle", n_idle, prefix], [port, "slow", n_slow, prefix]]
        proc, ready = _start_attacker(specs, budget=4 * (n_idle + n_slow))
        out["ready"] = ready
    ringlet.barrier()  # the flood is on from here
    checks = []
    t0 = time.monotonic()
    # Fresh groups: every pair, every triple and the whole world, each with its
    # own new connections, checked against numpy.
    for size in (2, 3, P):
        for members in itertools.combinations(range(P), size):
            g = ringlet.new_group(list(members), timeout=60)
            if rank in members:
                x = np.arange(7, dtype=np.float64) * (rank + 1)
                g.all_reduce(x, timeout=60)
                want = np.arange(7, dtype=np.float64) * sum(m + 1 for m in members)
                checks.append(bool(np.array_equal(x, want)))
    # A new authenticated store client still gets in and is served.
    with Store("127.0.0.1", w.store.port, secret=w.secret, timeout=60) as st:
        st.set(f"hostile/{rank}", str(rank).encode())
        total = st.add("hostile/count", rank + 1)
        checks.append(st.get(f"hostile/{(rank + 1) % P}", timeout=60) == str((rank + 1) % P).encode())
    checks.append(total <= P * (P + 1) // 2)
    out["busy_s"] = time.monotonic() - t0  # for docs/security.md; not asserted
    # Rank 0 never accepts a connection from the job (the lower rank of a pair
    # connects), so nothing orders its listener's work before this point:
    # wait, boundedly, for it to have gone through the whole first wave.
    deadline = time.monotonic() + 60
    while w.ctx.rejected() < n_idle + n_slow - 256 and time.monotonic() < deadline:
        time.sleep(0.05)
    ringlet.barrier()
    out["rejected"] = w.ctx.rejected()
    if rank == 0:
        out["stats"] = _stop_attacker(proc)
        out["ports"] = ports
        out["store_port"] = w.store.port
    out["ok"] = all(checks) and len(checks) > 0
    return out


def test_flood_of_idle_and_slow_connections_cannot_break_new_groups():
    P, n_idle, n_slow = 4, 1200, 60
    counter = _Counter()
    logger = logging.getLogger("ringlet.store")
    logger.addHandler(counter)
    try:
        res = run_world(_job_under_attack, P, mode="thread", timeout=120,
                        args=(n_idle, n_slow))
    finally:
        logger.removeHandler(counter)
    assert all(r["ok"] for r in res), res
    ready, stats = res[0]["ready"], res[0]["stats"]
    for port in res[0]["ports"] + [res[0]["store_port"]]:
        # the flood really reached every listener, and the server dropped
        # unauthenticated connections to make room (more than its table holds)
        assert ready[str(port)]["opened"] >= n_idle + n_slow, (port, ready)
        assert stats[str(port)]["dropped"] >= n_idle + n_slow - 512, (port, stats)
    for r in res:
        assert r["rejected"] >= n_idle + n_slow - 256, r["rejected"]
    # thousands of dropped connections cost the log a few lines, not one each
    assert counter.n <= 40, counter.n


# ---- the store when descriptors run out ---------------------------------------------------
_STORE_MAIN = textwrap.dedent(r"""
    import logging, os, resource, sys
    from ringlet.store import StoreServer
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="LOG %(message)s")
    secret = bytes.fromhex(sys.argv[1])
    # Far fewer descriptors than the flood needs, and a handshake cap above
    # that, so accept() itself fails with EMFILE.
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    with StoreServer("127.0.0.1", 0, secret=secret, max_handshakes=10000) as server:
        print(server.port, flush=True)
        sys.stdin.read()
        print("rejected", server.rejected, flush=True)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        print("cpu", ru.ru_utime + ru.ru_stime, flush=True)
""")


def test_store_out_of_descriptors_neither_spins_nor_floods_the_log():
    secret = os.urandom(32)
    env = dict(os.environ, PYTHONPATH=_SRC)
    server = subprocess.Popen([sys.executable, "-c", _STORE_MAIN, secret.hex()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        specs = [[port, "idle", 600, _STORE_PREFIX], [port, "slow", 20, _STORE_PREFIX]]
        attacker, ready = _start_attacker(specs, budget=1200)
        try:
            # genuine clients get in and are served while the flood holds on
            for i in range(3):
                with Store("127.0.0.1", port, secret=secret, timeout=30) as st:
                    st.set(f"k{i}", b"v%d" % i)
                    assert st.get(f"k{i}", timeout=30) == b"v%d" % i
                    assert st.add("n", 1) == i + 1
        finally:
            stats = _stop_attacker(attacker)
        out, err = server.communicate("", timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    lines = dict(ln.split(" ", 1) for ln in out.splitlines()[-2:])
    logs = [ln for ln in err.splitlines() if ln.startswith("LOG ")]
    assert ready[str(port)]["opened"] >= 620, ready
    assert stats[str(port)]["dropped"] >= 500, stats  # evicted to free descriptors
    assert int(lines["rejected"]) >= 500, lines
    assert any("descriptors" in ln for ln in logs), logs[:5]  # EMFILE was hit and handled
    assert len(logs) <= 40, (len(logs), logs[:5])


# ---- the connector: retry a dropped handshake, fail fast on a refusal ---------------------
class _DroppingRelay:
    """A TCP relay in front of a rank's listener that closes the first ``drops``
    connections without a word (as an evicting listener does) and relays the
    rest byte for byte."""

    def __init__(self, target_port, drops):
        self.target = target_port
        self.drops = drops
        self.accepted = 0
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        pairs = {}
        sel = selectors.DefaultSelector()
        sel.register(self.lsock, selectors.EVENT_READ, None)
        while not self.stop:
            for key, _ in sel.select(0.1):
                if key.data is None:
                    c, _ = self.lsock.accept()
                    self.accepted += 1
                    if self.accepted <= self.drops:
                        c.close()
                        continue
                    u = socket.create_connection(("127.0.0.1", self.target))
                    pairs[c], pairs[u] = u, c
                    sel.register(c, selectors.EVENT_READ, c)
                    sel.register(u, selectors.EVENT_READ, u)
                    continue
                s = key.data
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if data:
                    pairs[s].sendall(data)
                else:
                    for x in (s, pairs.pop(s)):
                        pairs.pop(x, None)
                        sel.unregister(x)
                        x.close()
        sel.close()
        self.lsock.close()


def _through_dropping_relay(rank, P):
    w = _world._current()
    ports = ringlet.all_gather_object(w.ctx.port)
    relay = None
    if rank == 0:  # rank 0 reaches rank 1 through the relay from now on
        relay = _DroppingRelay(ports[1], drops=3)
        w.ctx.set_peer(1, "127.0.0.1", relay.port)
    g = ringlet.new_group([0, 1], timeout=60)
    x = np.full(5, rank + 1.0)
    g.all_reduce(x, timeout=60)
    out = bool(np.array_equal(x, np.full(5, 3.0)))
    ringlet.barrier()  # on the world's direct connection: rank 1 has all its bytes before the relay stops
    if relay is not None:
        relay.stop = True
        relay.thread.join(10)
        return out, relay.accepted
    return out, None


def test_connector_retries_handshakes_the_acceptor_dropped(monkeypatch):
    # The group's all_reduce must open its TCP connection (through the relay);
    # over shared memory it would open none.
    monkeypatch.setenv("RINGLET_TRANSPORT", "tcp")
    res = run_world(_through_dropping_relay, 2, mode="thread", timeout=90)
    assert res[0][0] and res[1][0], res
    assert res[0][1] == 4, res  # three attempts dropped, the fourth relayed and used


def _hello_for_another_job(rank, P):
    w = _world._current()
    ports = ringlet.all_gather_object(w.ctx.port)
    out = None
    if rank == 0:
        # right secret, wrong job id: the listener reads the whole HELLO and
        # refuses it explicitly, so the connector fails at once, not at its deadline
        rogue = _core.Context(0, 2, "127.0.0.1", w.secret, os.urandom(16))
        rogue.set_peer(1, "127.0.0.1", ports[1])
        comm = _core.Comm(rogue, 7, 0, [0, 1])
        t0 = time.monotonic()
        try:
            comm.connect(1, 30000)
            out = ("connected", 0.0)
        except AuthenticationError as exc:
            out = (str(exc), time.monotonic() - t0)
        comm.close()
        rogue.close()
    ringlet.barrier()
    return out


def test_hello_for_another_job_is_refused_without_retrying():
    msg, took = run_world(_hello_for_another_job, 2, mode="thread", timeout=90)[0]
    assert "refused our HELLO" in msg, msg
    assert took < 15, took  # well before the 30 s deadline a retry loop would run to


# ---- a rank's listener when descriptors run out ------------------------------------------
_LISTENER_MAIN = textwrap.dedent(r"""
    import os, resource, sys
    from ringlet import _core
    secret, job = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])
    ctx = _core.Context(1, 2, "127.0.0.1", secret, job)
    # Far fewer descriptors than the listener's table of pending handshakes (sized
    # by the limit when it was created: up to 256), so accept() itself fails with
    # EMFILE while the flood lasts.
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(ctx.port, flush=True)
    sys.stdin.read()
    print("rejected", ctx.rejected(), flush=True)
""")


def test_rank_listener_out_of_descriptors_evicts_and_admits_a_genuine_rank():
    secret, job = os.urandom(32), os.urandom(16)
    env = dict(os.environ, PYTHONPATH=_SRC)
    listener = subprocess.Popen([sys.executable, "-c", _LISTENER_MAIN, secret.hex(), job.hex()],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(listener.stdout.readline())
        specs = [[port, "idle", 400, _RANK_PREFIX], [port, "slow", 20, _RANK_PREFIX]]
        attacker, ready = _start_attacker(specs, budget=800)
        try:
            ok = []
            for comm_id in (2, 4, 6):  # each a fresh connection and handshake
                ctx = _core.Context(0, 2, "127.0.0.1", secret, job)
                ctx.set_peer(1, "127.0.0.1", port)
                comm = _core.Comm(ctx, comm_id, 0, [0, 1])
                comm.connect(1, 30000)  # raises on failure
                ok.append(comm_id)
                comm.close()
                ctx.close()
        finally:
            stats = _stop_attacker(attacker)
        out, _ = listener.communicate("", timeout=60)
    finally:
        if listener.poll() is None:
            listener.kill()
    rejected = int(out.split()[-1])
    assert ok == [2, 4, 6]
    assert ready[str(port)]["opened"] >= 420, ready
    assert stats[str(port)]["dropped"] >= 300, stats  # evicted to free descriptors
    assert rejected >= 300, rejected


# ---- a rank's listener: its table follows the descriptor limit, valid HELLOs are evicted too ----
_LISTENER_LOW_LIMIT = textwrap.dedent(r"""
    import resource, sys
    from ringlet import _core
    secret, job = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])
    # 400 descriptors: the listener holds at most 400 / 8 = 50 handshakes at
    # once; each waits a minute for its proof, so only eviction frees a slot.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (400, hard))
    _core.set_tuning(handshake_ms=60000)
    ctx = _core.Context(1, 2, "127.0.0.1", secret, job)
    print(ctx.port, flush=True)
    sys.stdin.read()
    print("rejected", ctx.rejected(), flush=True)
""")


def _recv_exactly(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_rank_listener_caps_handshakes_by_descriptors_and_evicts_unproven_hellos():
    # Someone who knows the job id (it travels in clear) sends valid HELLOs and
    # never a proof.  The listener holds an eighth of its descriptor limit of
    # them, evicting the oldest beyond, and never stops accepting: a genuine
    # rank still connects at once.
    secret, job = os.urandom(32), os.urandom(16)
    env = dict(os.environ, PYTHONPATH=_SRC)
    listener = subprocess.Popen([sys.executable, "-c", _LISTENER_LOW_LIMIT, secret.hex(),
                                 job.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env)
    held, early, late = [], [], []
    try:
        port = int(listener.stdout.readline())
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            held.append(s)
            s.sendall(struct.pack("<4sHH16sIII32s", b"RLTH", _core.PROTOCOL_VERSION, 1, job,
                                  9, 0, 1, os.urandom(32)))
            # the reply: the HELLO was valid, the listener now waits for a proof
            assert len(_recv_exactly(s, 64)) == 64
        # the 50 oldest were evicted (told so: status 4, then closed), the 50
        # newest are still pending (nothing to read)
        deadline = time.monotonic() + 10
        for i, s in enumerate(held):
            s.settimeout(max(0.01, deadline - time.monotonic()) if i < 50 else 0.2)
            got = b""
            try:
                while True:
                    chunk = s.recv(16)
                    if not chunk:
                        break
                    got += chunk
            except socket.timeout:
                got += b"(open)"
            (early if i < 50 else late).append(got)
        ctx = _core.Context(0, 2, "127.0.0.1", secret, job)
        ctx.set_peer(1, "127.0.0.1", port)
        comm = _core.Comm(ctx, 2, 0, [0, 1])
        t0 = time.monotonic()
        comm.connect(1, 30000)  # raises on failure
        took = time.monotonic() - t0
        comm.close()
        ctx.close()
    finally:
        for s in held:
            s.close()
        out, _ = listener.communicate("", timeout=60)
        if listener.poll() is None:
            listener.kill()
    rejected = int(out.split()[-1])
    assert early == [struct.pack("<I", 4)] * 50 and late == [b"(open)"] * 50, (early, late)
    assert rejected >= 51, rejected  # the 50 oldest, and one more for the genuine rank
    assert took < 20, took


# ---- the shared-memory hand-over under idle connections -----------------------------------
class _IdleHolder:
    """An outsider in this process: once a new hand-over socket appears (rank 0
    serving a new group), it holds ``n`` idle connections to it, then sets
    ``ready``; ``drain()`` counts how many of them the server dropped."""

    def __init__(self, n, before):
        self.n, self.before, self.socks = n, before, []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        name, deadline = None, time.monotonic() + 60
        while name is None and time.monotonic() < deadline:
            for cand in handover_sockets([os.getpid()]) - self.before:  # rank 0 is a thread here
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect("\0" + cand)
                except OSError:  # bound but not listening yet
                    s.close()
                    continue
                self.socks.append(s)
                name = cand
            if name is None:
                time.sleep(0.005)
        while name is not None and len(self.socks) < self.n:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            if s.connect_ex("\0" + name) != 0:  # the backlog is full
                s.close()
                break
            self.socks.append(s)
        self.ready.set()

    def drain(self, timeout):
        dropped, deadline = 0, time.monotonic() + timeout
        for s in self.socks:
            s.setblocking(True)
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                closed = s.recv(1) == b""
            except ConnectionResetError:
                closed = True
            except socket.timeout:
                closed = False
            dropped += closed
            s.close()
        return dropped


def test_idle_connections_cannot_hold_up_the_shared_memory_hand_over(monkeypatch):
    from ringlet import _shm

    monkeypatch.delenv("RINGLET_TRANSPORT", raising=False)
    # Each handshake may take 10 s: a server that waited for idle connections
    # to time out would keep the rank out for at least that long.
    monkeypatch.setattr(_shm, "_HANDSHAKE_S", 10.0)
    n_idle = 80  # more than rank 0's 32 handshake threads
    holder, joined = None, {}
    real_fetch = _shm._fetch

    def fetch_after_the_outsider(world, name, key, rank, deadline):
        # Rank 1 asks for its descriptors only once the idle connections are
        # queued ahead of it (the init's own hand-over goes through directly).
        if holder is not None:
            assert holder.ready.wait(60), "the outsider never found the hand-over socket"
            t0 = time.monotonic()
            out = real_fetch(world, name, key, rank, deadline)
            joined.update(join_s=time.monotonic() - t0)
            return out
        return real_fetch(world, name, key, rank, deadline)

    def job(rank, P):
        nonlocal holder
        ringlet.barrier()  # init's hand-over is over
        if rank == 1:
            joined["rejected0"] = _shm.rejected  # before the first idle connection
            holder = _IdleHolder(n_idle, handover_sockets([os.getpid()]))
        ringlet.barrier()
        g = ringlet.new_group([0, 1], timeout=60)
        x = np.full(3, rank + 1.0)
        g.all_reduce(x, timeout=60)
        return float(x[0]), g.transport

    monkeypatch.setattr(_shm, "_fetch", fetch_after_the_outsider)
    res = run_world(job, 2, mode="thread", timeout=120)
    assert res == [(3.0, "shm"), (3.0, "shm")], res
    n = len(holder.socks)
    assert n > _shm._MAX_HANDSHAKES, n
    assert joined["join_s"] < 5.0, joined  # well before one handshake window
    # Rank 0 has left the hand-over (it ran the all_reduce): every idle
    # connection was evicted or cut, none left to its deadline, each counted.
    assert holder.drain(5.0) == n
    assert _shm.rejected - joined["rejected0"] >= n, (_shm.rejected, joined, n)


# ---- the shared-memory hand-over out of descriptors ---------------------------------------
# Rank 0's hand-over server alone in a process whose descriptors all but 4 are
# taken.  argv: the key (hex).  Prints the socket name, serves comm rank 1 of
# 2, then prints "served <rejected>" or "failed <error>".
_HANDOVER_LOW_LIMIT = textwrap.dedent(r"""
    import os, resource, socket, sys, time, types
    from ringlet import _shm
    _shm._HANDSHAKE_S = 60.0  # idle connections never end on their own here
    key = bytes.fromhex(sys.argv[1])
    name = "ringlet-shm-" + os.urandom(16).hex()
    seg = os.memfd_create("ringlet-test", os.MFD_CLOEXEC)
    os.ftruncate(seg, 4096)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    listener.bind("\0" + name)
    listener.listen(64)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    filler = []
    try:
        while True:
            filler.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        pass
    for fd in filler[:4]:
        os.close(fd)
    print(name, flush=True)
    try:
        _shm._serve(types.SimpleNamespace(rank=0), listener, [seg], key, name, 2,
                    time.monotonic() + 60)
        print("served", _shm.rejected, flush=True)
    except Exception as exc:
        print("failed", type(exc).__name__, exc, flush=True)
""")


def test_shared_memory_hand_over_out_of_descriptors_evicts_idle_connections():
    # Idle connections hold the last descriptors of rank 0: accept() fails with
    # EMFILE.  The hand-over frees one by evicting the oldest unproven
    # connection, as the rank listener and the store do, instead of failing
    # the group; the genuine rank behind 40 idle connections gets its segment.
    from ringlet import _shm

    key = os.urandom(32)
    env = dict(os.environ, PYTHONPATH=_SRC)
    server = subprocess.Popen([sys.executable, "-c", _HANDOVER_LOW_LIMIT, key.hex()],
                              stdout=subprocess.PIPE, text=True, env=env)
    idle = []
    try:
        name = server.stdout.readline().strip()
        assert name.startswith("ringlet-shm-"), name
        for _ in range(40):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            s.setblocking(False)
            assert s.connect_ex("\0" + name) == 0
            idle.append(s)
        world = type("World", (), {"rank": 1})()
        msg, fds = _shm._fetch(world, name, key, 1, time.monotonic() + 30)
        try:
            assert msg == b"\1" and len(fds) == 1, (msg, fds)
            assert os.fstat(fds[0]).st_size == 4096
        finally:
            for fd in fds:
                os.close(fd)
        out, _ = server.communicate(timeout=60)
    finally:
        for s in idle:
            s.close()
        if server.poll() is None:
            server.kill()
            server.wait()
    assert out.startswith("served"), out
    assert int(out.split()[1]) >= 40, out  # every idle connection evicted and counted
