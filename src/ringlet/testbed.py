"""Several "hosts" on one Linux machine: network namespaces joined by a bridge.

``HostBed(H)`` makes H hosts, each a network namespace with a UTS (host name),
IPC and mount namespace of its own, so every process on one host shares
``_topology.host_id()`` with the others there and differs from every other
host's.  The hosts' ``eth0`` veths join a bridge that lives in a namespace of
its own: nothing is ever created in, or changed about, the caller's network
namespace.  Addresses come from one private /24 that no route of the caller's
namespace covers; each host's /etc/hosts (bind-mounted in its own mount
namespace) names every host, so ``h2`` resolves on ``h1`` as it would on a
cluster.  ``rate="1gbit"`` shapes both directions of every link with ``tbf``.

Processes start on a host through ``nsenter`` into a holder process (one per
host, ``sleep infinity``) that owns its namespaces.  Names carry this
process's pid and a counter, so beds of parallel tests never collide; a bed
tears down (its processes killed, its namespaces deleted, which also deletes
its veths and bridge) on ``close()``, on leaving its ``with`` block by any
path, and at interpreter exit; beds left by a process that died with SIGKILL
are swept by the next bed (namespaces named ``ringletbed-<pid>-...`` whose
pid is gone), and the processes a bed started die with the thread that
started them (``PR_SET_PDEATHSIG``: start a bed from a thread that outlives
its use).  Root only; ``HostBed.unavailable()`` says why a bed cannot be
made here.

Example::

    with HostBed(2, rate="1gbit") as bed:
        bed.run("h1", ["hostname"]).stdout          # b"h1\\n"
        p = bed.popen("h2", [sys.executable, "-c", "print(1)"])
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import weakref
from typing import Dict, List, Mapping, Optional, Sequence, Union

from .run import own_process_group

__all__ = ["HostBed", "BedError"]

_PREFIX = "ringletbed-"
_counter = itertools.count()
_probed: Optional[str] = None  # "" once namespaces were made here, else why not
_live: "weakref.WeakSet[HostBed]" = weakref.WeakSet()
_STEP_S = 10.0  # bound on any one set-up or teardown command
# Variables an rsh session passes to the remote side, like an ssh login on a
# cluster with a shared home and profile; nothing else crosses (in particular
# no RINGLET_* variable: launchers must send their own over the channel).
_RSH_KEEP = ("PATH", "HOME", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "TMPDIR", "LANG",
             "LC_ALL")


# Every process a bed starts dies with the thread that started it (PR_SET_PDEATHSIG,
# kept across exec), so a test runner killed with SIGKILL leaves none behind.
_PDEATH = ["setpriv", "--pdeathsig", "KILL", "--"]


class BedError(RuntimeError):
    """The test bed could not be set up (the message names the failing command)."""


def _sh(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=_STEP_S)
    if check and p.returncode != 0:
        raise BedError(f"`{shlex.join(argv)}` failed ({p.returncode}): "
                       f"{p.stderr.decode(errors='replace').strip()}")
    return p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale() -> None:
    """Delete namespaces of beds whose creating process is gone (it died with SIGKILL)."""
    try:
        names = os.listdir("/run/netns")
    except OSError:
        return
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            # Its processes first: a namespace with processes in it lives on unnamed.
            for p in _sh(["ip", "netns", "pids", name], check=False).stdout.split():
                try:
                    os.kill(int(p), signal.SIGKILL)
                except (ValueError, ProcessLookupError, PermissionError):
                    pass
            _sh(["ip", "netns", "del", name], check=False)


def _pick_subnet(salt: int) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of the caller's namespace overlaps."""
    taken = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        out = _sh(argv, check=False).stdout.decode(errors="replace")
        for tok in out.split():
            try:
                net = ipaddress.ip_network(tok, strict=False)
            except ValueError:
                continue
            if net.version == 4 and net.prefixlen > 0:
                taken.append(net)
    for i in range(4096):
        k = (salt * 7919 + i) % (200 * 250)
        net = ipaddress.ip_network(f"10.{40 + k // 250}.{k % 250}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise BedError("no free /24 in 10.40.0.0-10.239.255.0 for the test bed")


class HostBed:
    """H simulated hosts (network, UTS, IPC and mount namespaces) joined by a bridge.

    Args:
        hosts: number of hosts (1..200).
        rate: ``tbf`` rate of every link, each direction (e.g. "1gbit"), or a mapping
            from host name to its link's rate (hosts left out are unshaped); None: unshaped.
        names: host names (default ``h1`` .. ``hH``); each is the host's UTS host
            name unless ``hostnames`` says otherwise, and resolves on every host.
        hostnames: what ``hostname`` reports on each host (default: ``names``);
            e.g. all "localhost", as on clusters where every node says so.
        burst: the ``tbf`` bucket of every shaped link (default "256kb"): what may
            leave at the veth's speed before the rate applies.  A NIC sends at its
            line rate, so a small bucket (e.g. "16kb") prices messages of tens of
            KiB as a real link does; the default keeps TCP at the full rate.
    Raises:
        BedError: not root, no ``ip``/``nsenter``/``unshare``, or a set-up command failed
            (the bed is torn down before this is raised).

    Attributes:
        hosts: the host names, in order.
        subnet: the bed's IPv4 network.
        ifname: each host's interface name ("eth0").
    """

    ifname = "eth0"

    def __init__(self, hosts: int = 2, *, rate: Union[str, Mapping[str, str], None] = None,
                 names: Optional[Sequence[str]] = None,
                 hostnames: Optional[Sequence[str]] = None, burst: str = "256kb") -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be an int in 1..200, got {hosts!r}")
        if not (isinstance(burst, str) and re.fullmatch(r"[0-9]+(kb|mb|k|m|b)?", burst)):
            raise ValueError(f"burst must be a tc size such as '16kb', got {burst!r}")
        if isinstance(rate, Mapping) and names is None and \
                set(rate) - {f"h{i + 1}" for i in range(hosts)}:
            raise ValueError(f"rate names hosts not in the bed: {sorted(rate)}")
        names = list(names) if names is not None else [f"h{i + 1}" for i in range(hosts)]
        hostnames = list(hostnames) if hostnames is not None else list(names)
        if len(names) != hosts or len(hostnames) != hosts or len(set(names)) != hosts:
            raise ValueError(f"need {hosts} distinct names and {hosts} hostnames, got "
                             f"{names!r} and {hostnames!r}")
        for name in names + hostnames:
            # They become file names, /etc/hosts entries and shell words.
            if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}", name)):
                raise ValueError(f"host name {name!r} must be 1-63 letters, digits or '-'")
        why = HostBed.unavailable()
        if why:
            raise BedError(why)
        self.hosts: List[str] = names
        self._hostnames = dict(zip(names, hostnames))
        n = next(_counter)
        self._tag = f"{_PREFIX}{os.getpid()}-{n}"
        self.subnet = _pick_subnet(os.getpid() * 131 + n)
        self._addr = {h: str(self.subnet.network_address + 1 + i) for i, h in enumerate(names)}
        self._ns = {h: f"{self._tag}-{i + 1}" for i, h in enumerate(names)}
        self._bridge_ns = f"{self._tag}-br"
        self._made: List[str] = []  # namespaces this bed created, deleted in close()
        self._holders: Dict[str, subprocess.Popen] = {}
        self._procs: List[subprocess.Popen] = []
        self._host_of: Dict[int, str] = {}  # pid -> host, of the processes started here
        self._lock = threading.Lock()
        self._closed = False
        self._dir = tempfile.mkdtemp(prefix=self._tag + ".")
        _live.add(self)
        try:
            _sweep_stale()
            self._build(rate, burst)
        except BaseException:
            self.close()
            raise

    # ---- availability -----------------------------------------------------------------
    @staticmethod
    def unavailable() -> Optional[str]:
        """Why no bed can be made here (a sentence), or None when one can."""
        if not os.path.exists("/proc/self/ns/net"):
            return "network namespaces need Linux"
        if os.geteuid() != 0:
            return "network namespaces need root (run the multi-host tests as root)"
        for tool in ("ip", "nsenter", "unshare", "setpriv", "tc"):
            if shutil.which(tool) is None:
                return f"`{tool}` is not installed (iproute2 / util-linux)"
        global _probed
        if _probed is None:
            # Root without CAP_SYS_ADMIN (a container) cannot make namespaces: try once.
            probe = f"{_PREFIX}{os.getpid()}-probe"
            made = _sh(["ip", "netns", "add", probe], check=False)
            _sh(["ip", "netns", "del", probe], check=False)
            uts = _sh(["unshare", "--uts", "--ipc", "true"], check=False)
            bad = made if made.returncode else uts if uts.returncode else None
            _probed = "" if bad is None else (
                f"cannot make namespaces here (`{shlex.join(bad.args)}`: "
                f"{bad.stderr.decode(errors='replace').strip()})")
        return _probed or None

    # ---- set-up -----------------------------------------------------------------------
    def _netns_add(self, ns: str) -> None:
        _sh(["ip", "netns", "add", ns])
        self._made.append(ns)

    def _build(self, rate: Union[str, Mapping[str, str], None], burst: str) -> None:
        br = self._bridge_ns
        self._netns_add(br)
        _sh(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", br, "link", "set", "br0", "up"])
        hosts_file = os.path.join(self._dir, "hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            for h in self.hosts:
                f.write(f"{self._addr[h]} {h}\n")
        plen = self.subnet.prefixlen
        for h in self.hosts:
            os.mkdir(self._tmpdir(h))
        for i, h in enumerate(self.hosts):
            ns, port = self._ns[h], f"p{i + 1}"
            self._netns_add(ns)
            # Created directly inside the two namespaces: never in the caller's.
            _sh(["ip", "link", "add", self.ifname, "netns", ns, "type", "veth", "peer", "name",
                 port, "netns", br])
            _sh(["ip", "-n", br, "link", "set", port, "master", "br0", "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{self._addr[h]}/{plen}", "dev", self.ifname])
            _sh(["ip", "-n", ns, "link", "set", self.ifname, "up"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            link_rate = rate.get(h) if isinstance(rate, Mapping) else rate
            if link_rate:
                for where, dev in ((ns, self.ifname), (br, port)):
                    _sh(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                         link_rate, "burst", burst, "latency", "50ms"])
            self._start_holder(h, hosts_file)
        rsh = os.path.join(self._dir, "rsh")
        keep = " ".join(f'"{k}=${{{k}:-}}"' for k in _RSH_KEEP if k != "TMPDIR")
        with open(rsh, "w") as f:
            # `rsh HOST COMMAND...`, as ssh: the words joined into one shell command.
            f.write("#!/bin/sh\n"
                    "host=$1; shift\n"
                    "while [ \"${host#-}\" != \"$host\" ]; do host=$1; shift; done\n"
                    f"pid=$(cat \"{self._dir}/$host.pid\" 2>/dev/null) || "
                    "{ echo \"rsh: no such bed host: $host\" >&2; exit 255; }\n"
                    f"exec env -i {keep} \"TMPDIR={self._dir}/$host.tmp\" "
                    "nsenter -t \"$pid\" -n -u -i -m --wd=/ -- "
                    "/bin/sh -c \"$*\"\n")
        os.chmod(rsh, 0o755)
        self.rsh = rsh
        for h, p in self._holders.items():
            with open(os.path.join(self._dir, f"{h}.pid"), "w") as f:
                f.write(str(p.pid))

    def _start_holder(self, h: str, hosts_file: str) -> None:
        # `ip netns exec` gives a mount namespace of its own (with /sys for the
        # netns); unshare adds the host name and IPC namespaces.  Every command
        # on this host then enters the holder's namespaces.
        script = (f"hostname {shlex.quote(self._hostnames[h])} && "
                  f"mount --bind {shlex.quote(hosts_file)} /etc/hosts && echo ready && "
                  f"exec sleep infinity")
        p = subprocess.Popen(_PDEATH + ["ip", "netns", "exec", self._ns[h], "unshare", "--uts",
                                        "--ipc", "/bin/sh", "-c", script],
                             stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
        self._holders[h] = p
        line = p.stdout.readline()
        if line.strip() != b"ready":
            p.kill()
            err = p.stderr.read().decode(errors="replace").strip()
            raise BedError(f"host {h}: could not make its namespaces: {err or 'no output'}")

    # ---- queries ----------------------------------------------------------------------
    def addr(self, host: str) -> str:
        """The IPv4 address of ``host``'s eth0."""
        return self._addr[self._check(host)]

    def _tmpdir(self, host: str) -> str:
        return os.path.join(self._dir, f"{host}.tmp")

    def hostname(self, host: str) -> str:
        """What ``hostname`` reports on ``host``."""
        return self._hostnames[self._check(host)]

    def netns(self, host: str) -> str:
        """The name of ``host``'s network namespace (for ``ip -n``)."""
        return self._ns[self._check(host)]

    def _check(self, host: str) -> str:
        if host not in self._addr:
            raise ValueError(f"no host {host!r} in this bed (hosts: {self.hosts})")
        if self._closed:
            raise BedError("the bed is closed")
        return host

    # ---- processes --------------------------------------------------------------------
    def _argv(self, host: str, argv: Sequence[str], cwd: Optional[str]) -> List[str]:
        pid = self._holders[self._check(host)].pid
        return _PDEATH + ["nsenter", "-t", str(pid), "-n", "-u", "-i", "-m",
                f"--wd={cwd or os.getcwd()}", "--"] + [str(a) for a in argv]

    def popen(self, host: str, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              *, cwd: Optional[str] = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host``; returns its ``Popen`` (killed at teardown).

        Args:
            env: the process's whole environment (default: this process's), but
                ``TMPDIR`` is always the host's own temporary directory: hosts share
                this machine's /tmp, and tools that name their files there by host name
                (Open MPI's session directories) would collide on hosts named alike.
            cwd: working directory (default: this process's).
            kwargs: more ``subprocess.Popen`` keywords (stdout=, stderr=, ...).
        The process leads a process group of its own, so ``os.killpg(p.pid, sig)``
        reaches everything it starts.
        """
        full = dict(os.environ if env is None else env)
        full["TMPDIR"] = self._tmpdir(self._check(host))
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        with self._lock:
            if self._closed:
                raise BedError("the bed is closed")
            p = subprocess.Popen(self._argv(host, argv, cwd), env=full,
                                 **own_process_group(), **kwargs)
            self._procs.append(p)
            self._host_of[p.pid] = host
        return p

    def run(self, host: str, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
            *, timeout: float = 60.0, check: bool = False, **kwargs
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to completion (output captured unless given).

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` (it is killed first).
            subprocess.CalledProcessError: ``check`` and a non-zero exit.
        """
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        p = self.popen(host, argv, env, **kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
        res = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            res.check_returncode()
        return res

    def signal_host(self, host: str, sig: int) -> List[int]:
        """Send ``sig`` to every process group this bed started on ``host``; their pids."""
        pids = []
        with self._lock:
            procs = [p for p in self._procs if p.poll() is None
                     and self._host_of[p.pid] == self._check(host)]
        for p in procs:
            try:
                os.killpg(p.pid, sig)
                pids.append(p.pid)
            except ProcessLookupError:
                pass
        return pids

    # ---- links ------------------------------------------------------------------------
    def add_interface(self, host: str, name: str, cidr: str) -> None:
        """Give ``host`` another interface ``name`` with address ``cidr``, which no other
        host has a route to: a second network only that host is on (a veth pair whose
        other end, ``name`` + "x", stays in the same namespace).  ``name`` is at most 14
        characters."""
        ns = self.netns(host)
        if not 0 < len(name) <= 14:
            raise ValueError(f"interface name {name!r} must have 1..14 characters")
        _sh(["ip", "-n", ns, "link", "add", name, "type", "veth", "peer", "name", name + "x"])
        _sh(["ip", "-n", ns, "addr", "add", cidr, "dev", name])
        for dev in (name, name + "x"):
            _sh(["ip", "-n", ns, "link", "set", dev, "up"])

    def set_link(self, host: str, up: bool) -> None:
        """Bring ``host``'s eth0 up or down (down: its packets are dropped, no reset)."""
        _sh(["ip", "-n", self.netns(host), "link", "set", self.ifname, "up" if up else "down"])

    # ---- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process this bed started, then delete its namespaces and files.

        Idempotent; deletes only what this bed made."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._procs) + list(self._holders.values())
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in procs:
            try:
                p.wait(timeout=_STEP_S)
            except subprocess.TimeoutExpired:
                pass
            for s in (p.stdout, p.stderr):
                if s is not None:
                    s.close()
        # Deleting a namespace deletes its veth ends and the bridge with it.
        for ns in reversed(self._made):
            _sh(["ip", "netns", "del", ns], check=False)
        self._made.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "HostBed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


@atexit.register
def _close_all() -> None:
    for bed in list(_live):
        bed.close()
