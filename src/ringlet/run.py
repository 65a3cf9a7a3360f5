"""``ringlet run``: start N ranks on this host (or several) and stop them together.

Usage::

    ringlet run -n 4 train.py --epochs 3        # a script: run with this Python
    ringlet run -n 4 -m mypkg.train --epochs 3  # a module
    ringlet run -n 4 -- ./a.out arg             # any program
    python -m ringlet.run -n 4 train.py
    ringlet run --hosts node1:4,node2:4 [--rsh 'ssh -p 2222'] train.py

With ``--hosts``, ranks on other hosts start through the remote shell (ssh by
default, called as ``CMD HOST COMMAND``) and ``_agent`` there, which reads the
rank's variables, secret included, as one JSON line on its stdin; the store is
then served on the address that routes to those hosts (docs/launching.md).

The launcher serves the rendezvous store itself, on 127.0.0.1 with an
OS-chosen port (nothing to configure, no port collisions between jobs), and
makes a fresh 32-byte job secret.  Each rank gets, in its environment only
(never in argv or output): RINGLET_RANK, RINGLET_WORLD_SIZE, RINGLET_LOCAL_RANK,
RINGLET_LOCAL_WORLD_SIZE, RINGLET_MASTER_ADDR, RINGLET_MASTER_PORT,
RINGLET_SECRET and RINGLET_EXTERNAL_STORE=1 (rank 0 must not start a store).

Every line a rank writes is prefixed with ``[rank] `` (stdout and stderr kept
apart; ``--no-prefix`` passes the streams through untouched).

Shutdown rules:
  * the first rank to exit non-zero is reported on stderr; the others get
    SIGTERM, then SIGKILL after ``--grace`` seconds; the launcher exits with
    that rank's code (a rank killed by signal S counts as 128 + S);
  * SIGINT/SIGTERM/SIGHUP to the launcher are forwarded to every rank, then
    the same grace/SIGKILL sequence; a second signal kills at once; the exit
    code is 128 + the signal;
  * ``--timeout`` bounds the whole run: all ranks are stopped, exit code 124.

Each rank runs in its own process group (session), so the launcher alone
decides how signals reach it (a remote rank's go to its agent as lines on the
remote shell's stdin), and stopping a rank also stops the processes it
started (data loader workers, shells).  On Linux each rank also gets
``PR_SET_PDEATHSIG`` (SIGKILL), so even a launcher killed with SIGKILL leaves
no orphans behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple

from .errors import RingletError

__all__ = ["main", "build_parser"]

_PROG = "ringlet run"
# Runs in each child before the real program: arm PR_SET_PDEATHSIG (it survives
# exec) so the rank dies with the launcher, then exec.  Done here rather than in
# a preexec_fn, which is unsafe in a process that already runs threads.
_TRAMPOLINE = r"""
import os, sys
try:
    import ctypes, signal
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    # A rank is a background process group of the launcher's session: with the
    # terminal's "tostop" set, its writes would stop it.  Ignoring SIGTTOU
    # (kept across exec) lets them through.
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    # Likewise a read of the terminal (ssh asking for a password or a host key)
    # fails at once instead of stopping the rank for good.
    signal.signal(signal.SIGTTIN, signal.SIG_IGN)
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
try:
    os.execv(sys.argv[2], sys.argv[3:])
except OSError as e:
    sys.stderr.write("ringlet run: cannot execute %r: %s\n" % (sys.argv[2], e.strerror or e))
    os._exit(127)
"""
_VALUE_OPTS = {"-n", "--nproc", "--grace", "--timeout", "--hosts", "--rsh"}
_FLAG_OPTS = {"--no-prefix", "-h", "--help"}


def own_process_group() -> Dict[str, Any]:
    """``subprocess.Popen`` keywords that start a child in a process group of
    its own, inside the launcher's session.

    The group lets ``killpg`` reach everything the child starts and keeps the
    terminal's Ctrl-C to the launcher, which forwards it.  Staying in the
    session matters for speed: with ``kernel.sched_autogroup_enabled`` every
    session is a scheduling group of its own, a core is shared equally
    between groups, and ``sched_yield`` only yields within a group.  With more
    ranks than cores, a rank in a session of its own that polls for a peer's
    frame then keeps half the core the peer needs (measured in
    docs/experiments.md).
    Python < 3.11 has no ``process_group``; there it falls back to a new
    session.
    """
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}


def build_parser() -> argparse.ArgumentParser:
    """The launcher's option parser (the program and its arguments are split off first)."""
    p = argparse.ArgumentParser(
        prog=_PROG, description="Start N ranks of a ringlet job on this host, or on several "
                                "hosts (--hosts) over ssh.",
        usage=f"{_PROG} (-n N | --hosts H:K,...) [--rsh CMD] [--grace S] [--timeout S] "
              f"[--no-prefix] (script.py | -m module | [--] program) [args ...]")
    p.add_argument("-n", "--nproc", type=int, default=None, metavar="N",
                   help="number of ranks to start (with --hosts: their total, if given)")
    p.add_argument("--hosts", default=None, metavar="H:K,...",
                   help="hosts and ranks per host, e.g. node1:4,node2:4 (K defaults to 1); "
                        "ranks are numbered host by host; this host runs its own ranks, "
                        "the others are started with --rsh")
    p.add_argument("--rsh", default="ssh", metavar="CMD",
                   help="remote shell for other hosts, called as `CMD HOST COMMAND` "
                        "(default ssh; e.g. 'ssh -p 2222')")
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop every rank after S seconds and exit with code 124")
    p.add_argument("--no-prefix", action="store_true",
                   help="do not prefix output lines with [rank]; pass the streams through")
    return p


def _split_argv(argv: Sequence[str]) -> Tuple[List[str], Optional[str], List[str]]:
    """Split into (launcher options, module or None, program argv).

    Launcher options end at the first token that is not one of ours, at
    ``--``, or at ``-m MODULE``; everything after belongs to the program, so
    its own options (``-c``, ``--lr``) are never mistaken for ours.
    """
    argv = list(argv)
    opts: List[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return opts, None, argv[i + 1:]
        if tok == "-m":
            if i + 1 >= len(argv):
                raise SystemExit(f"{_PROG}: -m needs a module name")
            return opts, argv[i + 1], argv[i + 2:]
        name = tok.split("=", 1)[0]
        if tok in _FLAG_OPTS:
            opts.append(tok)
        elif name in _VALUE_OPTS and "=" in tok:
            opts.append(tok)
        elif tok in _VALUE_OPTS:
            opts.extend(argv[i:i + 2])
            i += 1
        elif tok.startswith("-n") and tok[2:].isdigit():
            opts.append(tok)
        elif tok.startswith("-") and len(tok) > 1:
            raise SystemExit(f"{_PROG}: unknown option {tok!r} (put the program after '--' "
                             f"if the option is its own)")
        else:
            return opts, None, argv[i:]
        i += 1
    return opts, None, []


def _command(module: Optional[str], program: List[str]) -> List[str]:
    if module is not None:
        return [sys.executable, "-m", module] + program
    if not program:
        raise SystemExit(f"{_PROG}: no program given (e.g. `{_PROG} -n 2 train.py`)")
    prog = program[0]
    if prog.endswith(".py"):
        if not os.path.exists(prog):
            raise SystemExit(f"{_PROG}: script {prog!r} not found")
        return [sys.executable] + program
    path = shutil.which(prog)
    if path is None:
        raise SystemExit(f"{_PROG}: program {prog!r} not found (not on PATH, or not executable)")
    return [path] + program[1:]


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"killed by {name} (exit code {128 - rc})"
    return f"exit code {rc}"



_ABORTED = "peer aborted the operation: ["
_INNER = re.compile(r"rank (\d+): \S+ seq=\d+ peer (\d+) ")
# The core's wordings of a vanished peer: over TCP a reset or a plain close (EOF); over
# shared memory a closed communicator or a process gone.
_VANISHED = ("the peer exited", "the peer closed the connection",
             "the peer closed its communicator", "the peer's process")


def _root_cause(who: int, peer: Any, closed: bool, message: str, nproc: int) -> int:
    """Follow a record's vanished or aborting peer to the rank that failed first.

    An aborting peer's reason is quoted in brackets ("rank R: op seq=S peer P ...:
    ..."), itself possibly quoting another abort, so the chain is walked to its end.
    """
    for _ in range(nproc):
        if not (isinstance(peer, int) and 0 <= peer < nproc):
            break
        at = message.find(_ABORTED)
        if not closed and at < 0:
            break
        who = peer
        if at < 0:
            break  # that peer vanished: it is the cause
        inner = _INNER.match(message, at + len(_ABORTED))
        if not inner or int(inner[1]) != peer:
            break
        message = message[inner.start():]
        peer = int(inner[2])
        head = message.split("]", 1)[0]
        closed = any(w in head for w in _VANISHED)
    return who

class _Output:
    """Copies a rank's pipe to our stream, one prefixed line at a time."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._dead: Dict[int, bool] = {}

    def pump(self, pipe: IO[bytes], stream: IO, prefix: bytes) -> None:
        key = id(stream)
        try:
            while True:
                # Bounded readline: a huge line without newlines cannot grow
                # memory without limit; it is cut into prefixed pieces.
                chunk = pipe.readline(1 << 16)
                if not chunk:
                    return
                if self._dead.get(key):
                    continue  # keep draining so the rank never blocks on a full pipe
                if not chunk.endswith(b"\n"):
                    chunk += b"\n"
                with self._lock:
                    try:
                        buf = getattr(stream, "buffer", None)
                        if buf is not None:
                            buf.write(prefix + chunk)
                        else:
                            stream.write((prefix + chunk).decode("utf-8", "replace"))
                        stream.flush()
                    except (OSError, ValueError):
                        self._dead[key] = True  # e.g. `ringlet run ... | head`
        finally:
            pipe.close()


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """``"node1:4,node2:4"`` -> ``[("node1", 4), ("node2", 4)]`` (a missing count is 1).

    Raises:
        ValueError: an empty list, a bad or non-positive count, or a host named twice
            (in any case, or this host under two of its names).
    """
    out: List[Tuple[str, int]] = []
    for part in spec.split(","):
        part = part.strip()
        name, sep, count = part.rpartition(":") if ":" in part else (part, "", "1")
        if not name or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
            raise ValueError(f"--hosts {spec!r}: bad host {part!r} (expected HOST or HOST:K)")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--hosts {spec!r}: bad rank count in {part!r} (a positive integer)")
        if any(name.lower() == h.lower() for h, _ in out):  # host names ignore case
            raise ValueError(f"--hosts {spec!r}: host {name!r} is named twice")
        out.append((name, int(count)))
    here = [h for h, _ in out if _is_this_host(h)]
    if len(here) > 1:
        # Two entries for one machine would hand two ranks the same local rank.
        raise ValueError(f"--hosts {spec!r}: {' and '.join(repr(h) for h in here)} are all "
                         f"this host; name it once with all its ranks")
    return out


def _is_this_host(host: str) -> bool:
    from .environment import is_loopback

    me = socket.gethostname()
    return host in (me, me.split(".", 1)[0]) or is_loopback(host)


def _store_address(hosts: List[Tuple[str, int]]) -> str:
    """Where the launcher serves the store: loopback for one host, else the local
    address that routes to the first remote host (RINGLET_IFNAME if set)."""
    from .environment import select_bind_address

    remote = [h for h, _ in hosts if not _is_this_host(h)]
    if not remote:
        return "127.0.0.1"
    try:
        ip = socket.getaddrinfo(remote[0], None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise RingletError(f"host {remote[0]!r} does not resolve here ({exc}); the launcher "
                           f"serves the store on the address that routes to it") from None
    return select_bind_address(ip, os.environ.get("RINGLET_IFNAME"))


# The remote end of one rank (`CMD HOST 'cd DIR && exec PYTHON -c AGENT'`).
_AGENT = "from ringlet.run import _agent; _agent()"
# What the launcher may send a remote rank through its agent's stdin.
_CHANNEL_SIGNALS = frozenset({int(signal.SIGINT), int(signal.SIGTERM), int(signal.SIGHUP),
                              int(signal.SIGKILL)})
# Launcher variables that describe its own host, which a remote rank's host decides.
_NOT_FORWARDED = frozenset({"RINGLET_HOST_ID", "RINGLET_IFNAME", "RINGLET_RPC_HOST",
                            "RINGLET_SECRET_FILE"})


def _agent() -> None:
    """Run one rank on a remote host for ``ringlet run --hosts``; never returns.

    Reads the rank's variables and argv as one JSON line on stdin (the secret
    travels there, never in a command line), starts the rank in a process
    group of its own and exits with its code (128 + S if signal S killed it),
    once whatever the rank left in its process group is gone too.
    Later stdin lines are the launcher's signals for the rank
    (``{"signal": N}``), sent to its process group as they come (the launcher
    keeps the grace period and sends SIGKILL itself): a remote shell forwards
    no signal (ssh's remote command gets none), so this is how the launcher's
    Ctrl-C reaches a remote rank as SIGINT while the launcher still sees the
    rank's last output and real exit.  The launcher going away (stdin at EOF,
    as when ssh exits) or a SIGINT, SIGTERM or SIGHUP to this agent stops the
    rank too: that signal (SIGTERM at EOF), then SIGKILL after the launcher's
    grace period.
    """
    line = sys.stdin.buffer.readline(1 << 20)
    try:
        spec = json.loads(line)
        env, cmd, grace = dict(os.environ), list(spec["argv"]), float(spec["grace"])
        env.update(spec["env"])
    except (ValueError, KeyError, TypeError) as exc:
        sys.stderr.write(f"{_PROG}: remote agent got no valid job description on stdin ({exc})\n")
        os._exit(2)
    argv = cmd
    if sys.platform.startswith("linux"):
        argv = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), cmd[0]] + cmd
    asked: List[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: asked.append(signum))
    try:
        p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, **own_process_group())
    except OSError as exc:
        sys.stderr.write(f"{_PROG}: cannot start {cmd[0]!r} on {socket.gethostname()}: {exc}\n")
        os._exit(127)
    gone = threading.Event()
    told: List[int] = []  # the launcher's signals: it keeps the time (--grace) itself

    def channel() -> None:
        # The launcher's signals, one JSON line each, until EOF (launcher gone).
        for msg in iter(lambda: sys.stdin.buffer.readline(1 << 10), b""):
            try:
                sig = json.loads(msg)["signal"]
            except (ValueError, KeyError, TypeError):
                continue
            if sig in _CHANNEL_SIGNALS:
                told.append(int(sig))
        gone.set()

    threading.Thread(target=channel, daemon=True).start()
    stop_at: Optional[float] = None
    forwarded = relayed = 0
    while True:
        try:
            rc = p.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            pass
        try:
            while relayed < len(told):  # in order: a later one may be SIGKILL
                os.killpg(p.pid, told[relayed])
                relayed += 1
            while forwarded < len(asked):
                os.killpg(p.pid, asked[forwarded])
                forwarded += 1
                if stop_at is None:
                    stop_at = time.monotonic() + grace
            if stop_at is None and gone.is_set():
                os.killpg(p.pid, signal.SIGTERM)
                stop_at = time.monotonic() + grace
            elif stop_at is not None and time.monotonic() >= stop_at:
                os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        # A child the rank left behind (`cmd &`) holds the session's output
        # open: ssh, and the launcher with it, would wait for it without end.
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    os._exit(_exit_code(rc))


class _Launcher:
    def __init__(self, nproc: int, cmd: List[str], *, grace: float, timeout: Optional[float],
                 prefix: bool, hosts: Optional[List[Tuple[str, int]]] = None,
                 rsh: Optional[List[str]] = None) -> None:
        self.nproc = nproc
        self.hosts = hosts or [("localhost", nproc)]
        self.rsh = rsh or []
        self.addr = "127.0.0.1"
        self.cmd = cmd
        self.grace = grace
        self.timeout = timeout
        self.prefix = prefix
        self.procs: List[subprocess.Popen] = []
        self.exits: "queue.Queue[Tuple[int, int]]" = queue.Queue()
        self.codes: Dict[int, int] = {}
        self.pumps: List[threading.Thread] = []
        self.signal: Optional[int] = None
        self.signal_count = 0
        self.secret = b""
        self.port = 0
        self._store = None

    # ---- signals --------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        # Only record: the main loop acts within ~0.1 s (handlers must not take locks).
        if self.signal is None:
            self.signal = signum
        self.signal_count += 1

    def _send(self, sig: int, ranks: Optional[Sequence[int]] = None, *,
              hard: bool = False) -> None:
        """Signal ranks: a local rank's process group; a remote rank's agent through
        its remote shell's stdin (the shell's own group with ``hard``, or when the
        channel is gone: that only cuts the shell, and the agent then sees EOF)."""
        for r, p in enumerate(self.procs):
            if ranks is not None and r not in ranks:
                continue
            if p.stdin is not None and not hard and self._tell(p, sig):
                continue
            try:
                os.killpg(p.pid, sig)  # the rank's whole process group
            except (ProcessLookupError, PermissionError):
                pass

    @staticmethod
    def _tell(p: subprocess.Popen, sig: int) -> bool:
        """Write ``{"signal": sig}`` to a remote rank's agent; False if the channel is gone."""
        try:
            # Non-blocking (set at spawn): a remote shell that stopped reading
            # must not hold up the launcher; it is cut instead.
            return os.write(p.stdin.fileno(), json.dumps({"signal": int(sig)}).encode()
                            + b"\n") > 0
        except (OSError, ValueError):
            return False

    # ---- run --------------------------------------------------------------------------
    def run(self) -> int:
        from .store import StoreServer

        secret = secrets.token_hex(32)
        self.addr = _store_address(self.hosts)
        server = StoreServer(self.addr, 0, secret=secret.encode())
        self.secret, self.port = secret.encode(), server.port
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in handled:
                previous[s] = signal.signal(s, self._on_signal)
        try:
            self._spawn(server.port, secret)
            code = self._watch()
        finally:
            # Whatever happened (including an error while spawning), no rank
            # outlives the launcher.
            still = [r for r in range(len(self.procs)) if r not in self.codes]
            if still:
                self._send(signal.SIGKILL, still)  # through the channel first,
                self._send(signal.SIGKILL, still, hard=True)  # then the shells
            for p in self.procs:
                if p.stdin is not None:  # a remote rank's channel: its EOF stops the rank
                    try:
                        p.stdin.close()
                    except OSError:
                        pass
            for p in self.procs:
                try:
                    p.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    pass
            end = time.monotonic() + 2.0
            for t in self.pumps:
                t.join(max(0.0, end - time.monotonic()))
            if self._store is not None:
                self._store.close()
            server.close()
            for s, h in previous.items():
                signal.signal(s, h)
        return code

    def _spawn(self, port: int, secret: str) -> None:
        base = dict(os.environ)
        base.pop("RINGLET_SECRET_FILE", None)  # the launcher's secret is the job's
        base.setdefault("PYTHONUNBUFFERED", "1")  # timely, line-by-line output
        job = dict(RINGLET_WORLD_SIZE=str(self.nproc), RINGLET_MASTER_ADDR=self.addr,
                   RINGLET_MASTER_PORT=str(port), RINGLET_SECRET=secret,
                   RINGLET_EXTERNAL_STORE="1")
        # The remote shell itself gets no ringlet variable: the rank's travel on its stdin,
        # with the launcher's knobs (as mpirun forwards OMPI_MCA_*), except what names this
        # host: its identity and its interface.
        shell_env = {k: v for k, v in os.environ.items() if not k.startswith("RINGLET_")}
        knobs = {k: v for k, v in base.items()
                 if k.startswith("RINGLET_") and k not in _NOT_FORWARDED}
        lock = threading.Lock()
        out = _Output(lock)
        pipe = subprocess.PIPE if self.prefix else None
        placed = [(h, k, n) for h, n in self.hosts for k in range(n)]
        for r, (host, local, lsize) in enumerate(placed):
            mine = dict(job, RINGLET_RANK=str(r), RINGLET_LOCAL_RANK=str(local),
                        RINGLET_LOCAL_WORLD_SIZE=str(lsize))
            if _is_this_host(host):
                p = subprocess.Popen(self._trampoline(self.cmd), env=dict(base, **mine),
                                     stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe,
                                     **own_process_group())
            else:
                remote = (f"cd {shlex.quote(os.getcwd())} && exec "
                          f"{shlex.quote(sys.executable)} -c {shlex.quote(_AGENT)}")
                p = subprocess.Popen(self._trampoline(self.rsh + [host, remote]), env=shell_env,
                                     stdin=subprocess.PIPE, stdout=pipe, stderr=pipe,
                                     **own_process_group())
                desc = {"env": dict(knobs, **mine, PYTHONUNBUFFERED=base["PYTHONUNBUFFERED"]),
                        "argv": self.cmd, "grace": self.grace}
                try:
                    p.stdin.write(json.dumps(desc).encode() + b"\n")
                    p.stdin.flush()
                    os.set_blocking(p.stdin.fileno(), False)  # for _tell
                except OSError:
                    pass  # the remote shell failed at once: its exit code says why
            self.procs.append(p)
            if self.prefix:
                tag = f"[{r}] ".encode()
                for src, dst in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                    t = threading.Thread(target=out.pump, args=(src, dst, tag),
                                         name=f"ringlet-run-out{r}", daemon=True)
                    t.start()
                    self.pumps.append(t)
            w = threading.Thread(target=self._reap, args=(r, p), name=f"ringlet-run-wait{r}",
                                 daemon=True)
            w.start()

    def _trampoline(self, cmd: List[str]) -> List[str]:
        if sys.platform.startswith("linux"):
            return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()),
                    cmd[0]] + cmd
        return cmd

    def _reap(self, rank: int, p: subprocess.Popen) -> None:
        self.exits.put((rank, p.wait()))

    def _say(self, msg: str) -> None:
        try:
            sys.stderr.write(f"{_PROG}: {msg}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def _blame(self, rank: int) -> Tuple[int, str]:
        """Which rank failed first, once ``rank`` has exited non-zero: the one the
        job's own failure record names, else ``rank``; and what it reported.

        Exit order misleads: a rank that raises closes its sockets in its exit
        handlers, and its peers, failing on them, often exit before it does.
        Their record (the first failure of the latest generation, set with an
        atomic add) names the rank that failed and, where the failure was a
        vanished or aborting peer, that peer: the root cause.
        """
        from . import _core, _world
        from .store import Store

        try:
            if self._store is None:
                self._store = Store(self.addr, self.port, secret=self.secret, timeout=5.0)
            st = self._store
            if not st.check(_world.FAILURE_KEY):
                return rank, ""
            rec = json.loads(st.get(_world.FAILURE_KEY, timeout=0).decode())
            who = int(rec["rank"])
            # A record from a generation its rank has since left is history.
            gen_key = _world.GEN_KEY.format(who)
            if int(st.get(gen_key, timeout=0).decode()) != int(rec["gen"]):
                return rank, ""
        except (RingletError, OSError, ValueError, KeyError, TypeError):
            return rank, ""  # no usable record: fall back to exit order
        message = str(rec.get("message", ""))
        who = _root_cause(who, rec.get("peer"), rec.get("status") == _core.STATUS["PEER_CLOSED"],
                          message, self.nproc)
        if not 0 <= who < self.nproc or self.codes.get(who) == 0:
            return rank, ""  # the peer it names finished cleanly: blame the one that failed
        return who, message

    def _verdict(self, rank: int, rc: int, message: str, how: str = "") -> None:
        why = f"; it reported: {message[:300]}" if message else ""
        self._say(f"rank {rank} failed first ({how or _describe(rc)}){why}; stopping the "
                  f"other ranks")

    def _watch(self) -> int:
        start = time.monotonic()
        deadline = None if self.timeout is None else start + self.timeout
        stopping_since: Optional[float] = None
        killed_at: Optional[float] = None
        cut = False
        forwarded = 0
        code: Optional[int] = None
        pending: Optional[Tuple[int, int, int, str]] = None  # (blamed, first, its rc, report)
        while len(self.codes) < self.nproc:
            now = time.monotonic()
            running = [r for r in range(self.nproc) if r not in self.codes]
            if self.signal is not None and forwarded < self.signal_count:
                if forwarded == 0:
                    self._say(f"received {signal.Signals(self.signal).name}; forwarding it to "
                              f"{len(running)} rank(s)")
                    self._send(self.signal, running)
                    if stopping_since is None:
                        stopping_since = now
                    code = 128 + self.signal
                elif killed_at is None:  # a second signal: stop waiting
                    self._send(signal.SIGKILL, running)
                    killed_at = now
                forwarded = self.signal_count
            if deadline is not None and now >= deadline and stopping_since is None:
                self._say(f"timed out after {self.timeout:g}s; stopping all ranks")
                self._send(signal.SIGTERM, running)
                stopping_since, code = now, 124
            if stopping_since is not None and killed_at is None and \
                    now >= stopping_since + self.grace:
                if running:
                    self._say(f"rank(s) {running} still running {self.grace:g}s after being "
                              f"asked to stop; sending SIGKILL")
                self._send(signal.SIGKILL, running)
                killed_at = now
            if killed_at is not None and not cut and now > killed_at + 2.0:
                # A remote shell still there 2 s after its rank's SIGKILL went down
                # the channel: unreachable host or hung ssh.  Cut it.
                self._send(signal.SIGKILL, [r for r in running
                                            if self.procs[r].stdin is not None], hard=True)
                cut = True
            if killed_at is not None and now > killed_at + 5.0:
                self._say(f"rank(s) {running} survive SIGKILL (uninterruptible?); giving up")
                break
            # Sleep until the next rank exits or the next deadline, at most 0.1 s
            # so signals recorded by the handler are acted on promptly.
            wait = 0.1
            if deadline is not None and stopping_since is None:
                wait = min(wait, max(0.0, deadline - now))
            try:
                rank, rc = self.exits.get(timeout=wait)
            except queue.Empty:
                continue
            self.codes[rank] = rc
            if pending is not None and rank == pending[0]:
                # The blamed rank's own exit: its code is the job's, unless it
                # exited cleanly after all (then the first non-zero exit stands).
                culprit, first, first_rc, message = pending
                pending = None
                if rc != 0 and killed_at is not None and rc == -signal.SIGKILL:
                    # This launcher's SIGKILL after --grace ended it: 137 is ours,
                    # not its failure's; the first failing rank's code stands.
                    self._verdict(culprit, rc, message, how="it did not exit within --grace "
                                  "and was killed")
                elif rc != 0:
                    self._verdict(culprit, rc, message)
                    code = _exit_code(rc)
                else:
                    self._verdict(first, first_rc, "")
            elif rc != 0 and stopping_since is None:
                culprit, message = self._blame(rank)
                others = [r for r in range(self.nproc) if r not in self.codes and r != culprit]
                self._send(signal.SIGTERM, others)
                stopping_since, code = time.monotonic(), _exit_code(rc)
                if culprit == rank or culprit in self.codes:
                    self._verdict(culprit, self.codes[culprit], message)
                    code = _exit_code(self.codes[culprit])
                else:
                    # It is on its way out (its failure is what failed the
                    # others): let it finish and report its own exit code,
                    # within the grace period like everyone else.
                    pending = (culprit, rank, rc, message)
        if pending is not None:
            self._verdict(pending[1], pending[2], "")
        # Anything a stopped rank left in its process group goes too.
        if stopping_since is not None:
            self._send(signal.SIGKILL, hard=True)
        return 0 if code is None else code


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ringlet run`` / ``python -m ringlet.run``; returns the exit code.

    Example::

        sys.exit(main(["-n", "2", "train.py"]))
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, module, program = _split_argv(argv)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(opts)  # exits 2 with usage on bad options
    hosts, rsh = None, None
    if args.hosts is not None:
        try:
            hosts = parse_hosts(args.hosts)
        except ValueError as exc:
            parser.error(str(exc))
        total = sum(n for _, n in hosts)
        if args.nproc is not None and args.nproc != total:
            parser.error(f"-n {args.nproc} but --hosts {args.hosts!r} places {total} ranks")
        args.nproc = total
        try:
            rsh = shlex.split(args.rsh)
        except ValueError as exc:
            parser.error(f"--rsh {args.rsh!r}: {exc}")
        exe = shutil.which(rsh[0]) if rsh else None
        if exe is None and any(not _is_this_host(h) for h, _ in hosts):
            parser.error(f"--rsh {args.rsh!r}: {rsh[0] if rsh else 'nothing'!r} is not an "
                         f"executable on PATH")
        rsh = [exe or ""] + rsh[1:]
        if os.path.basename(rsh[0]) == "ssh":
            # Never a prompt nobody can answer, nor two minutes on a host that
            # drops packets; ssh keeps the first value of an option, so the
            # user's own -o settings come first and win.
            rsh += ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    elif args.nproc is None:
        parser.error("give -n N or --hosts H:K,...")
    if args.nproc < 1:
        parser.error(f"-n must be at least 1, got {args.nproc}")
    if not (0 <= args.grace < math.inf):  # NaN fails too: SIGKILL would never come
        parser.error(f"--grace must be a finite number >= 0, got {args.grace}")
    if args.timeout is not None and not (0 < args.timeout < math.inf):
        parser.error(f"--timeout must be a finite positive number, got {args.timeout}")
    try:
        cmd = _command(module, program)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 127 if "not found" in str(exc) else 2
    try:
        return _Launcher(args.nproc, cmd, grace=args.grace, timeout=args.timeout,
                         prefix=not args.no_prefix, hosts=hosts, rsh=rsh).run()
    except RingletError as exc:  # e.g. no route to the hosts: nothing was started
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
