"""Hostile connections never delay or break the job (docs/security.md).

A separate attacker process (real sockets, its descriptor limit raised to the
hard limit) holds thousands of idle connections and some slow ones (one byte
per send, never a complete hello) to every rank's listener and to the store,
and reopens each one the server drops, while the job keeps creating new groups
(fresh connections on fresh peer pairs) and new store clients.  Everything is
synchronised on explicit signals (the attacker's "ready" line, barriers);
the only time bounds are generous upper ones derived from the op deadline.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np

import ringlet
from ringlet import _world
from ringlet.store import Store, StoreServer
from ringlet.testing import run_world

_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

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
