"""The flight recorder's Python side: dumping each rank's record, merging them, RINGLET_DEBUG.

Every communicator keeps its last ``RINGLET_TRACE_ENTRIES`` operations (default
2000; op, seq, dtype, bytes, peer, algorithm, start/end times, state) in a ring
written by the C core (csrc/flight.c).  This module writes that record as one
JSON file per rank:

* when an operation fails with a timeout, a desync or a lost peer, and when
  this rank learns that another rank failed (once per failure);
* on ``SIGUSR1`` (only if the program installed no handler of its own);
* when the job shuts down, if ``RINGLET_TRACE=1``.

Files go to ``RINGLET_TRACE_DIR`` (default ``$TMPDIR/ringlet-trace-<job tag>``, the
job tag being the first 8 hex digits of the job id; a directory it creates is
0700), named ``rank<R>.json`` (0600: readable by the job's user only).  A dump
holds the job tag, never the whole job id (docs/security.md).  ``ringlet trace
DIR`` (``main``) merges them and names, per communicator, the first sequence
number that not every rank completed and which ranks never entered it, are
stuck in it, or failed in it.  See docs/debugging.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence

from . import _core
from .errors import CollectiveTimeout, DesyncError, PeerClosedError

__all__ = ["dump", "dump_all", "trace_dir", "load", "analyze", "format_report", "main"]

_FORMAT = 1
# Hex digits of the job id that name a job in dumps, their directory and the log: enough
# to tell jobs apart, while the whole id stays with the authenticated store
# (docs/security.md).
_JOB_TAG_HEX = 8
_worlds: "weakref.WeakSet[Any]" = weakref.WeakSet()
_lock = threading.Lock()
# Held while dump_all runs: a SIGUSR1 that lands during a dump skips instead of
# waiting for a lock its own thread holds.
_dumping = threading.Lock()
_sigusr1_installed = False
_LEVELS = {"": 0, "0": 0, "OFF": 0, "INFO": 1, "1": 1, "DETAIL": 2, "2": 2}


# ---- RINGLET_DEBUG --------------------------------------------------------------
def debug_level() -> int:
    """0 (off), 1 (``RINGLET_DEBUG=INFO``) or 2 (``DETAIL``)."""
    raw = os.environ.get("RINGLET_DEBUG", "").strip().upper()
    if raw not in _LEVELS:
        raise ValueError(f"RINGLET_DEBUG must be INFO or DETAIL (or unset), got "
                         f"{os.environ['RINGLET_DEBUG']!r}")
    return _LEVELS[raw]


def log(rank: int, level: int, msg: str) -> None:
    """One line on stderr in the C core's format: ``ringlet[rank R] INFO: msg``."""
    if debug_level() >= level:
        sys.stderr.write(f"ringlet[rank {rank}] {'DETAIL' if level >= 2 else 'INFO'}: {msg}\n")
        sys.stderr.flush()


def _algorithm_rules(t: Dict[str, int]) -> List[str]:
    # Mirrors the dispatch in csrc/ (allreduce.c, bcast.c, reduce.c, ring.c,
    # alltoall.c, barrier.c); every op's actual choice is in its trace entry.
    s = t["allreduce_small_bytes"]
    return [f"all_reduce: recursive_doubling up to {s} bytes, else ring",
            f"broadcast: binomial_tree up to {t['bcast_small_bytes']} bytes (flat up to 4 "
            f"ranks; on several hosts up to {t['bcast_flat_bytes']} bytes, beyond that "
            f"hosts_tree), else chain",
            f"reduce: binomial_tree up to {t['reduce_small_bytes']} bytes (on several hosts "
            f"hosts_tree), else chain",
            f"all_gather: bruck up to {s} bytes in all (3+ ranks), else ring",
            f"reduce_scatter: recursive_halving up to {16 * s} bytes in all (power-of-two "
            f"4+ ranks), else ring",
            f"all_to_all: bruck up to {s} bytes in all (3+ ranks), else pairwise",
            "barrier: flat (3..RL_BARRIER_FLAT_MAX ranks), else dissemination"]


def on_init(world: Any, source: str = "") -> None:
    """Called by ``ringlet.init`` once the world group exists: register the
    world for dumps, set the C log level, install SIGUSR1, log the set-up."""
    level = debug_level()
    _core.set_log_level(level)
    with _lock:
        _worlds.add(world)
    _install_sigusr1()
    if level:
        tun = _core.get_tuning()
        store = world._store_args[:2] if world._store_args else None
        log(world.rank, 1, f"init: rank {world.rank} of {world.size}, host "
                           f"{socket.gethostname()}, pid {os.getpid()}, listening on "
                           f"{world.host}:{world.ctx.port if world.ctx else '?'}, store "
                           f"{'%s:%s' % store if store else 'none'}, launcher "
                           f"{source or 'args'}, job {job_tag(world)}")
        mode = os.environ.get("RINGLET_TRANSPORT", "").strip().lower() or "auto"
        log(world.rank, 1, "transport: %s (same-host Reno: %s), simd %s; world group: %s"
            % (mode, "on" if tun["local_reno"] else "off", _core.simd_info(),
               world.group.transport if world.group is not None else "?"))
        log(world.rank, 1, "tuning: " + ", ".join(f"{k}={v}" for k, v in sorted(tun.items())))
        for rule in _algorithm_rules(tun):
            log(world.rank, 1, "algorithm " + rule)


# ---- dumping -----------------------------------------------------------------------
def job_tag(world: Any) -> str:
    """The first hex digits of the job id: what dumps and logs name the job by."""
    return world.job_id.hex()[:_JOB_TAG_HEX]


def trace_dir(world: Any) -> str:
    """Where this job's dumps go: RINGLET_TRACE_DIR, else $TMPDIR/ringlet-trace-<job tag>."""
    d = os.environ.get("RINGLET_TRACE_DIR")
    if d:
        return d
    return os.path.join(tempfile.gettempdir(), f"ringlet-trace-{job_tag(world)}")


def _comm_record(g: Any, kind: str, comm: Any, mono_now: int, unix_now: float) -> Dict:
    total, cap, entries = comm.trace()
    for e in entries:
        e["start"] = unix_now - (mono_now - e["start_ns"]) / 1e9
        e["duration_us"] = (round((e["end_ns"] - e["start_ns"]) / 1e3, 1)
                            if e["end_ns"] else None)
        e["running_for_s"] = (round((mono_now - e["start_ns"]) / 1e9, 3)
                              if e["state"] == "started" else None)
        if e["op"] == "barrier":
            e["dtype"] = None
    err = comm.error()
    return {"comm_id": comm.comm_id, "kind": kind, "group_id": g.comm_id,
            "ranks": list(g.ranks), "rank": comm.rank, "seq": comm.seq,
            "capacity": cap, "recorded": total, "dropped": total - len(entries),
            "error": None if err is None else {"status": err[0], "peer": err[1], "message": err[3]},
            "entries": entries}


def snapshot(world: Any, reason: str) -> Dict:
    """This rank's flight record as a JSON-ready dict."""
    mono_now, unix_now = time.monotonic_ns(), time.time()
    comms = []
    for g in sorted(list(world._groups), key=lambda g: g.comm_id):
        if g.rank < 0:
            continue
        for kind, comm in (("collective", g._coll), ("p2p", g._p2pc)):
            if comm is None:
                continue
            try:
                comms.append(_comm_record(g, kind, comm, mono_now, unix_now))
            except Exception:  # noqa: BLE001 - closed meanwhile: nothing to record
                continue
    return {"format": _FORMAT, "rank": world.rank, "world_size": world.size,
            "host": socket.gethostname(), "pid": os.getpid(),
            "job_id": job_tag(world), "reason": reason, "time": unix_now,
            "communicators": comms}


def dump(world: Any, reason: str, directory: Optional[str] = None) -> Optional[str]:
    """Write this rank's record to ``<dir>/rank<R>.json``; return the path.

    Never raises for an I/O problem (it runs on failure paths): it reports
    on stderr and returns None.
    """
    tmp = None
    try:
        rec = snapshot(world, reason)
        d = directory or trace_dir(world)
        # The record names hosts, pids and every op: the job's user's only.
        os.makedirs(d, mode=0o700, exist_ok=True)
        path = os.path.join(d, f"rank{world.rank}.json")
        # A fresh name per write (mkstemp, 0600): a dump from a signal handler
        # never shares its temporary file with the one it interrupted.
        fd, tmp = tempfile.mkstemp(prefix=f"rank{world.rank}.json.", suffix=".tmp", dir=d)
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)  # readers never see half a file
        tmp = None
    except Exception as exc:  # noqa: BLE001
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        sys.stderr.write(f"ringlet[rank {world.rank}]: could not write the flight record "
                         f"({reason}): {exc}\n")
        return None
    sys.stderr.write(f"ringlet[rank {world.rank}]: flight record ({reason}) written to {path}\n")
    return path


def dump_all(reason: str) -> List[str]:
    """Dump every live world of this process (thread-mode tests hold several)."""
    with _dumping:
        with _lock:
            worlds = list(_worlds)
        return _dump_worlds(worlds, reason)


def _dump_worlds(worlds: List[Any], reason: str) -> List[str]:
    return [p for p in (dump(w, reason) for w in worlds if not w._closed) if p]


_FAILURES = (CollectiveTimeout, DesyncError, PeerClosedError)
# Held through a failure dump: the rank's own failure and the watcher's cancel
# race to dump, and the loser must not return (and the process exit, killing
# the watcher thread) before the winner's file is written.
_failure_dump = threading.Lock()


def on_failure(world: Any, exc: Optional[BaseException], reason: str = "") -> None:
    """A group of ``world`` failed (``exc``) or was cancelled because another
    rank failed (``reason``): dump once per world failure."""
    with _failure_dump:
        if exc is not None and not isinstance(exc, _FAILURES):
            return
        if getattr(world, "_trace_dumped", False):
            return
        dump(world, f"{type(exc).__name__}: {exc}" if exc is not None else reason)
        world._trace_dumped = True


def on_close(world: Any) -> None:
    """``ringlet.shutdown`` (and so process exit): dump when RINGLET_TRACE=1."""
    if os.environ.get("RINGLET_TRACE") == "1":
        dump(world, "exit (RINGLET_TRACE=1)")


def _on_sigusr1(signum: int, frame: Any) -> None:
    # Python runs this in the main thread between bytecodes, or from the C
    # core's interrupt hook while that thread is blocked in an op: the ring is
    # read with the GIL and no C lock.  The Python locks are only tried (the
    # registry's briefly): the thread this interrupts may hold them (a dump
    # under way, which then stands for this one, or a world being
    # registered), and waiting for them here would never end.
    if not _dumping.acquire(blocking=False):
        sys.stderr.write("ringlet: SIGUSR1 while a flight record is being written: "
                         "no second dump\n")
        return
    try:
        if not _lock.acquire(timeout=0.1):
            sys.stderr.write("ringlet: SIGUSR1 while a world is being registered: "
                             "no dump, send it again\n")
            return
        try:
            worlds = list(_worlds)
        finally:
            _lock.release()
        _dump_worlds(worlds, "SIGUSR1")
    finally:
        _dumping.release()


def _install_sigusr1() -> None:
    global _sigusr1_installed
    if _sigusr1_installed or not hasattr(signal, "SIGUSR1"):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        return  # the program's own handler wins
    signal.signal(signal.SIGUSR1, _on_sigusr1)
    _sigusr1_installed = True


# ---- merging -------------------------------------------------------------------------
def load(directory: str) -> List[Dict]:
    """Every ``rank*.json`` dump in ``directory``, sorted by rank.

    Raises:
        FileNotFoundError: no dump there.
        ValueError: a file that is not a ringlet dump (names the file).
    """
    dumps = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable flight record ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != _FORMAT or "rank" not in d:
            raise ValueError(f"{path}: not a ringlet flight record (format {_FORMAT})")
        dumps.append(d)
    if not dumps:
        raise FileNotFoundError(f"no flight records (rank*.json) in {directory}")
    return sorted(dumps, key=lambda d: d["rank"])


def _op_of(e: Dict) -> Dict:
    return {k: e[k] for k in ("op", "dtype", "bytes", "peer", "algorithm")}


def _analyze_comm(comm_id: int, recs: Dict[int, Dict]) -> Dict:
    """recs: world rank -> that rank's record of one collective communicator."""
    any_rec = next(iter(recs.values()))
    members = any_rec["ranks"]
    by_seq: Dict[int, Dict[int, Dict]] = {}
    first_open: Dict[int, int] = {}
    for wr, rec in recs.items():
        entries = {e["seq"]: e for e in rec["entries"] if e["seq"] > 0}
        by_seq[wr] = entries
        open_seqs = [s for s, e in entries.items() if e["state"] != "completed"]
        first_open[wr] = min(open_seqs) if open_seqs else rec["seq"] + 1
    out: Dict[str, Any] = {"comm_id": comm_id, "group_id": any_rec["group_id"],
                           "ranks": members, "missing_dumps": sorted(set(members) - set(recs)),
                           "last_seq": {str(wr): recs[wr]["seq"] for wr in sorted(recs)}}
    # A rank that kept no entry of its last op (RINGLET_TRACE_ENTRIES=0) cannot
    # say whether that op completed: it is reported as unknown, never as done.
    unknown = [{"rank": wr, "last_seq": recs[wr]["seq"]} for wr in sorted(recs)
               if recs[wr]["seq"] > 0 and recs[wr]["seq"] not in by_seq[wr]]
    out["unknown_state"] = unknown
    seq = min(first_open.values())
    if all(recs[wr]["seq"] < seq for wr in recs):
        out.update(first_incomplete_seq=None, never_entered=[], stuck=[], failed=[],
                   completed=sorted(set(recs) - {u["rank"] for u in unknown}), ops={},
                   mismatch=False)
        return out
    never, stuck, failed, done, ops = [], [], [], [], {}
    for wr in sorted(recs):
        rec, e = recs[wr], by_seq[wr].get(seq)
        if e is None:
            if rec["seq"] < seq:
                last = by_seq[wr].get(rec["seq"])
                never.append({"rank": wr, "last_seq": rec["seq"],
                              "last_op": last["op"] if last else None,
                              "last_state": last["state"] if last else None})
            else:  # fell out of its ring: older than everything it kept
                done.append(wr)
            continue
        ops[str(wr)] = _op_of(e)
        if e["state"] == "started":
            stuck.append({"rank": wr, "op": e["op"], "running_for_s": e["running_for_s"]})
        elif e["state"] == "failed":
            failed.append({"rank": wr, "op": e["op"], "status": e["status"]})
        else:
            done.append(wr)
    kinds = {(o["op"], o["dtype"], o["bytes"]) for o in ops.values()}
    out.update(first_incomplete_seq=seq, never_entered=never, stuck=stuck, failed=failed,
               completed=done, ops=ops, mismatch=len(kinds) > 1)
    return out


def analyze(dumps: Sequence[Dict]) -> Dict:
    """Merge the ranks' dumps: per collective communicator, the first seq not
    completed by every rank and who never entered / is stuck in / failed it;
    per rank, the point-to-point operations still in flight."""
    # Compared by tag: dumps of older versions hold the whole id.
    jobs = {str(d.get("job_id") or "")[:_JOB_TAG_HEX] for d in dumps}
    per_comm: Dict[int, Dict[int, Dict]] = {}
    p2p: List[Dict] = []
    for d in dumps:
        for c in d["communicators"]:
            wr = c["ranks"][c["rank"]]
            if c["kind"] == "collective":
                per_comm.setdefault(c["comm_id"], {})[wr] = c
            else:
                for e in c["entries"]:
                    if e["state"] != "completed":
                        p2p.append({"rank": wr, "comm_id": c["comm_id"],
                                    "op": "recv" if e["recv"] else "send",
                                    "peer": (c["ranks"][e["peer"]] if 0 <= e["peer"] < len(c["ranks"])
                                             else "any" if e["peer"] == -1 and e["recv"]
                                             else e["peer"]),
                                    "tag": e["tag"], "bytes": e["bytes"], "state": e["state"],
                                    "status": e["status"], "running_for_s": e["running_for_s"]})
    world = max(d["world_size"] for d in dumps)
    return {"ranks": [d["rank"] for d in dumps], "world_size": world,
            "missing_ranks": sorted(set(range(world)) - {d["rank"] for d in dumps}),
            "job_ids": sorted(j for j in jobs if j), "reasons": {str(d["rank"]): d["reason"] for d in dumps},
            "communicators": [_analyze_comm(cid, per_comm[cid]) for cid in sorted(per_comm)],
            "p2p_in_flight": p2p}


def _ranks(xs: Sequence[Any]) -> str:
    return ", ".join(str(x) for x in xs) if xs else "-"


def format_report(rep: Dict) -> str:
    """The human-readable form of ``analyze``'s result."""
    lines = [f"flight records of ranks {_ranks(rep['ranks'])} (world size {rep['world_size']})"]
    if rep["missing_ranks"]:
        lines.append(f"  no record from ranks {_ranks(rep['missing_ranks'])}")
    if len(rep["job_ids"]) > 1:
        lines.append(f"  WARNING: records from {len(rep['job_ids'])} different jobs")
    for c in rep["communicators"]:
        lines.append(f"group {c['group_id']} (comm {c['comm_id']}, world ranks {c['ranks']}):")
        unknown = c.get("unknown_state") or []
        if unknown:
            lines.append("  state unknown (no operation entries kept, RINGLET_TRACE_ENTRIES=0?): "
                         + _ranks([f"rank {u['rank']} (last seq {u['last_seq']})"
                                   for u in unknown]))
        if c["first_incomplete_seq"] is None:
            if unknown:
                lines.append("  the other ranks completed every op they recorded")
            else:
                lines.append(f"  every rank completed every op (last seq "
                             f"{max(int(v) for v in c['last_seq'].values())})")
            continue
        seq = c["first_incomplete_seq"]
        kinds = sorted({f"{o['op']}" + (f" {o['dtype']}" if o["dtype"] else "")
                        + f" {o['bytes']} bytes" for o in c["ops"].values()})
        lines.append(f"  first seq not completed by every rank: {seq} ({'; '.join(kinds) or '?'})")
        if c["mismatch"]:
            lines.append("  DESYNC: ranks are in different ops at this seq: "
                         + "; ".join(f"rank {r}: {o['op']} {o['bytes']} bytes"
                                     for r, o in c["ops"].items()))
        lines.append("  never entered: " + _ranks(
            [f"rank {n['rank']} (last seq {n['last_seq']}"
             + (f" {n['last_op']} {n['last_state']})" if n["last_op"] else ")")
             for n in c["never_entered"]]))
        lines.append("  stuck in it:   " + _ranks(
            [f"rank {s['rank']} (running {s['running_for_s']}s)" for s in c["stuck"]]))
        lines.append("  failed in it:  " + _ranks(
            [f"rank {f['rank']} ({f['status']})" for f in c["failed"]]))
        lines.append("  completed it:  " + _ranks([f"rank {r}" for r in c["completed"]]))
        if c["missing_dumps"]:
            lines.append("  unknown (no record): " + _ranks(c["missing_dumps"]))
    for p in rep["p2p_in_flight"]:
        peer = "any rank" if p["peer"] == "any" else f"rank {p['peer']}"
        lines.append(f"p2p: rank {p['rank']} {p['op']} {'from' if p['op'] == 'recv' else 'to'} "
                     f"{peer} tag {p['tag']} ({p['bytes']} bytes): {p['state']}"
                     + (f" ({p['status']})" if p["status"] else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ringlet trace DIR [--json]``: merge the dumps in DIR and say who is stuck where."""
    p = argparse.ArgumentParser(
        prog="ringlet trace",
        description="Merge the flight records (rank*.json) of a job and report, per "
                    "communicator, the first sequence number not every rank completed and "
                    "which ranks never entered it, are stuck in it or failed in it.")
    p.add_argument("directory", help="the dump directory (RINGLET_TRACE_DIR)")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        rep = analyze(load(ns.directory))
    except (OSError, ValueError) as exc:
        print(f"ringlet trace: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        print(f"ringlet trace: {ns.directory}: a flight record is malformed "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2) if ns.json else format_report(rep))
    return 0
