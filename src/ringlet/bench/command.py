"""``ringlet bench``: argument parsing and the top-level flow.

Two ways to run:

* Stand-alone (no launcher variables): ``ringlet bench`` starts its own
  local job of ``-n`` ranks per system, in rounds (``--rounds``) whose
  system order rotates, and reports the median over rounds.
* Inside a launch (``mpirun``/``srun``/``torchrun``/``ringlet run``, detected
  by ``ringlet.environment.detect()``): every rank runs the sweep in place on
  the job's ranks; rank 0 prints and writes the files; every rank returns
  the same exit code.

Exit codes: 0 success, 1 wrong values with ``--check``, 2 bad usage,
3 average busbw below ``--min-busbw``, 4 ringlet's job failed (or a busy loop did
not start).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from . import report
from .sweep import (NOT_IN_PLACE, OPS, REDOPS, REDUCING, SweepConfig, parse_size, resolve_dtype,
                    size_range)

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_WRONG, EXIT_USAGE, EXIT_SLOW, EXIT_FAILED = 0, 1, 2, 3, 4
LARGE = 16 << 20  # rows judged against the machine's ceilings and memory bound


class _Usage(Exception):
    """A usage error found after parsing (reported like argparse's, exit 2)."""


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The ``ringlet bench`` argument parser."""
    p = argparse.ArgumentParser(
        prog="ringlet bench",
        description="Measure ringlet's collectives (nccl-tests style), optionally against "
                    "Open MPI and torch.distributed gloo; or measure this machine's limits.",
        epilog="Sizes accept K, M, G suffixes (powers of 1024).  nccl-tests uses -n for "
               "iterations; here -n is the rank count and -i/--iters the iterations.  "
               "Exit codes: 0 ok, 1 wrong values, 2 usage, 3 below --min-busbw, 4 job failed.")
    p.add_argument("op", choices=list(OPS) + ["all", "limits", "model"],
                   help="collective to measure, 'all', 'limits' for the machine's ceilings, "
                        "or 'model' for the cost model's predictions at scale")
    p.add_argument("-n", "--nranks", type=_positive_int, default=4,
                   help="local ranks to launch (default 4; ignored inside a launch)")
    p.add_argument("-b", "--minbytes", type=_size, default=8, help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", type=_size, default=None,
                   help="largest size (default 64M; 1G for model)")
    p.add_argument("-f", "--stepfactor", type=float, default=4.0,
                   help="multiply the size by this between rows (default 4)")
    p.add_argument("-i", "--iters", type=_positive_int, default=20,
                   help="timed iterations per size (default 20; see --budget)")
    p.add_argument("-w", "--warmup", type=int, default=5,
                   help="warm-up iterations per size (default 5)")
    p.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0,
                   help="verify results against numpy (-c or -c 1); exit 1 on any wrong value")
    p.add_argument("-o", "--op", dest="redop", default="sum", type=str.lower, choices=REDOPS,
                   help="reduction (default sum)")
    p.add_argument("-d", "--dtype", default="float32", help="element type (default float32)")
    p.add_argument("-r", "--root", type=int, default=0, help="root of rooted ops (default 0)")
    p.add_argument("-a", "--async", dest="inflight", type=_positive_int, default=1,
                   help="operations in flight per iteration (default 1)")
    p.add_argument("--batch", type=_positive_int, default=1,
                   help="operations timed back to back after each barrier, time divided by "
                        "N (nccl-tests' method); default 1: each operation from a common "
                        "start")
    p.add_argument("--in-place", action="store_true",
                   help="all_gather's input is the rank's block of the output (nccl-tests' "
                        "in-place); with `all`, ops without an in-place form are left out")
    p.add_argument("--offset", type=int, default=0, metavar="BYTES",
                   help="start every buffer BYTES past a page (16: where numpy's large arrays "
                        "start; default 0, page-aligned)")
    p.add_argument("--budget", type=float, default=2.0,
                   help="seconds of timed iterations per size: fewer iterations (at least 3) "
                        "for slow sizes; 0 = always --iters (default 2)")
    p.add_argument("--vs", default="", metavar="SYSTEMS",
                   help="also run ringlet-tcp (ringlet with RINGLET_TRANSPORT=tcp), mpi "
                        "(= mpi-tcp and mpi-sm), mpi-tcp, mpi-sm, gloo")
    p.add_argument("--busy", type=int, default=0, metavar="K",
                   help="run K busy-looping processes beside every system's job, started "
                        "before it and killed after it (default 0: an idle host)")
    p.add_argument("--rounds", type=_positive_int, default=None,
                   help="interleaved rounds per system (default 3 with --vs, else 1)")
    p.add_argument("--limits", action="store_true",
                   help="also measure `limits` (before every round; the ceiling is their median) "
                        "and show each large row's busbw as %% of its ceiling")
    p.add_argument("--duration", type=float, default=1.0,
                   help="limits: seconds per stream measurement (default 1)")
    p.add_argument("--congestion", default="ringlet", metavar="NAME",
                   help="limits: TCP congestion control of the measuring connections: "
                        "'ringlet' (default: what ringlet uses between ranks of one host, "
                        "Reno unless RINGLET_LOCAL_RENO=0), 'system', or a name such as cubic")
    p.add_argument("--params", metavar="FILE",
                   help="model: cost model parameters (JSON, as --save writes)")
    p.add_argument("--intra-limits", metavar="FILE",
                   help="model: fit intra-host parameters from `bench limits --json` output")
    p.add_argument("--inter-limits", metavar="FILE",
                   help="model: fit inter-host parameters from limits measured between hosts")
    p.add_argument("--save", metavar="FILE",
                   help="model: write the parameters used, for RINGLET_MODEL")
    p.add_argument("--json", metavar="FILE", help="write rows and environment as JSON")
    p.add_argument("--csv", metavar="FILE", help="write rows (with environment columns) as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw and time vs size (matplotlib)")
    p.add_argument("--min-busbw", type=float, default=None, metavar="GB/s",
                   help="exit 3 when an op's average busbw is below this (health check)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one system's job may run before it is killed (default 900)")
    return p


def _sweeps(args: argparse.Namespace) -> List[SweepConfig]:
    ops = [o for o in OPS] if args.op == "all" else [args.op]
    try:
        sizes = size_range(args.minbytes, args.maxbytes, args.stepfactor)
        resolve_dtype(args.dtype)
    except (ValueError, ImportError) as exc:
        raise _Usage(str(exc)) from None
    out = []
    for op in ops:
        if op == "sendrecv" and args.nranks_eff < 2:
            continue
        if args.in_place and args.op == "all" and op in NOT_IN_PLACE:
            continue
        cfg = SweepConfig(op=op, sizes=sizes, dtype=args.dtype, redop=args.redop,
                          root=args.root, iters=args.iters, warmup=args.warmup,
                          check=bool(args.check), inflight=args.inflight,
                          budget_s=args.budget, batch=args.batch, in_place=args.in_place,
                          offset=args.offset)
        if op not in REDUCING:
            cfg.redop = "sum"  # no reduction: -o only matters to reducing ops
        try:
            out.append(cfg.validate(args.nranks_eff))
        except (ValueError, TypeError) as exc:
            raise _Usage(str(exc)) from None
    return out


def _title(cfg: SweepConfig, nranks: int, how: str, rounds: int, busy: int = 0) -> str:
    what = f"{cfg.dtype}" + (f" {cfg.redop}" if cfg.op in ("all_reduce", "reduce",
                                                            "reduce_scatter") else "")
    tail = f", median of {rounds} interleaved rounds" if rounds > 1 else ""
    if cfg.batch > 1:
        tail += f"; {cfg.batch} operations back to back per timed iteration"
    if cfg.in_place:
        tail += "; in place"
    if cfg.offset:
        tail += f"; buffers at page + {cfg.offset} B"
    if busy:
        tail += f"; beside {busy} busy loop{'s' if busy > 1 else ''}"
    return (f"ringlet bench {cfg.op}: {nranks} ranks ({how}), {what}; time = median over "
            f"iterations of the slowest rank{tail}")


def _exit_code(rows: Sequence[Dict[str, Any]], args: argparse.Namespace, say) -> int:
    code = EXIT_OK
    bad = sum(r["wrong"] for r in rows if r["wrong"] > 0)
    if bad:
        say(f"ringlet bench: {bad} wrong value(s) (see the #wrong column)")
        code = EXIT_WRONG
    if args.min_busbw is not None:
        by_op: Dict[str, List[Dict[str, Any]]] = {}
        for r in rows:
            if r["op"] != "barrier":
                by_op.setdefault(r["op"], []).append(r)
        for op, rs in by_op.items():
            avg = report.average_busbw(rs)
            if avg < args.min_busbw:
                say(f"ringlet bench: {op} average busbw {avg:.4f} GB/s is below "
                    f"--min-busbw {args.min_busbw:g}")
                code = code or EXIT_SLOW
    return code


def _ceiling_column(rows: Sequence[Dict[str, Any]], median: Dict[str, Any],
                    samples: Sequence[Dict[str, Any]], nranks: int) -> str:
    """busbw of each large row against the ceiling of ``median`` (of the run's
    limits ``samples``), with the range those measurements spanned."""
    from .limits import ceilings

    ceil = ceilings(median, nranks)
    each = [ceilings(s, nranks) for s in samples]
    how = (f"median of {len(samples)} measurements, one before each round"
           if len(samples) > 1 else "measured at the start")
    lines = [f"# busbw as % of the loopback TCP ceiling (`ringlet bench limits`, {how})",
             f"#{'op':>15} {'size':>12} {'busbw':>8} {'ceiling':>8} {'min':>7} {'max':>7} "
             f"{'%':>6}"]
    for r in rows:
        c = ceil.get(r["op"])
        # Below ~16 MiB the socket buffers absorb much of a message, so the
        # steady-state stream rate is not yet the limit.
        if c and r["size"] >= LARGE:
            lo = min(e[r["op"]] for e in each)
            hi = max(e[r["op"]] for e in each)
            lines.append(f"{r['op']:>16} {r['size']:>12} {r['busbw']:>8.3f} {c:>8.3f} "
                         f"{lo:>7.3f} {hi:>7.3f} {100 * r['busbw'] / c:>6.1f}")
    return "\n".join(lines)


def _memory_column(rows: Sequence[Dict[str, Any]], median: Dict[str, Any],
                   nranks: int) -> str:
    """Each large row's time against the memory-bandwidth bound of the
    shared-memory algorithm for its op (``limits.memory_bound``); empty when
    the limits lack the memcpy rates."""
    from .limits import BOUND_OPS, memory_bound

    lines = []
    for r in rows:
        if r["op"] in BOUND_OPS and r["size"] >= LARGE and r["time_us"] > 0:
            t = memory_bound(median, r["op"], nranks, r["size"])
            if t is not None:
                lines.append(f"{r['op']:>16} {r['size']:>12} {r['time_us']:>10.1f} "
                             f"{t * 1e6:>10.1f} {100 * t * 1e6 / r['time_us']:>6.1f}")
    if not lines:
        return ""
    return "\n".join(["# time as % of the memory-bandwidth bound of the shared-memory "
                      "algorithms (bound / time; docs/algorithms.md)",
                      f"#{'op':>15} {'size':>12} {'time(us)':>10} {'bound(us)':>10} {'%':>6}"]
                     + lines)


def _outputs(args, rows, systems, skipped, env, limit_samples, say, round_rows=(),
             core_rtt=()) -> None:
    from .limits import ceilings, median_limits

    limits_res = median_limits(list(limit_samples)) if limit_samples else None
    if args.json:
        report.write_json(args.json, {
            "tool": "ringlet bench", "op": args.op, "nranks": args.nranks_eff,
            "config": {k: getattr(args, k) for k in (
                "minbytes", "maxbytes", "stepfactor", "iters", "warmup", "check", "redop",
                "dtype", "root", "inflight", "batch", "in_place", "offset", "budget", "rounds",
                "busy")},
            "systems": systems, "skipped": skipped, "environment": env,
            "limits": limits_res, "limits_rounds": list(limit_samples), "rows": list(rows),
            "round_rows": [{k: v for k, v in r.items() if k != "kind"} for r in round_rows],
            "core_rtt_rounds": list(core_rtt),
            "summary": {s: {op: report.average_busbw([r for r in rows if r["system"] == s
                                                      and r["op"] == op])
                            for op in sorted({r["op"] for r in rows if r["system"] == s})}
                        for s in systems},
        })
    if args.csv:
        report.write_csv(args.csv, rows, env)
    if args.plot:
        from .plot import plot

        plot(args.plot, rows, title=f"ringlet bench {args.op}, {args.nranks_eff} ranks",
             ceilings=ceilings(limits_res, args.nranks_eff) if limits_res else None)


# ---- stand-alone: launch a job per system and round ------------------------------
def _run_launched(args: argparse.Namespace) -> int:
    from . import launch
    from .busy import BusyError, busy_loops
    from .limits import LimitsError, core_roundtrip, format_limits, measure, median_limits

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    sweeps = _sweeps(args)
    try:
        peers = launch.expand_systems(args.vs) if args.vs else []
    except ValueError as exc:
        raise _Usage(str(exc)) from None
    skipped: Dict[str, str] = {}
    for p in list(peers):
        why = launch.missing_reason(p)
        if why:
            say(f"ringlet bench: skipping {p}: {why}")
            skipped[p] = why
            peers.remove(p)
    systems = ["ringlet"] + peers
    rounds = args.rounds or (3 if peers else 1)
    args.rounds = rounds
    n = args.nranks_eff
    live = not peers and rounds == 1
    # With several rounds the limits are measured before each one and the
    # ceiling is their median: a single measurement at the start of a long
    # sweep drifts more than ringlet's own numbers do (docs/experiments.md).
    limit_samples: List[Dict[str, Any]] = []
    per_round: Dict[str, List[List[Dict[str, Any]]]] = {s: [] for s in systems}
    versions: Dict[str, Any] = {}
    op_skips: Dict[str, Dict[str, str]] = {}
    state = {"op": None}

    def on_live(rec: Dict[str, Any]) -> None:
        if rec.get("kind") != "row":
            return
        if rec["op"] != state["op"]:
            if state["op"] is not None:
                print(report.format_footer([r for r in live_rows if r["op"] == state["op"]]))
                print()
            state["op"] = rec["op"]
            cfg = next(c for c in sweeps if c.op == rec["op"])
            print(report.format_header(_title(cfg, n, "local launch", 1, args.busy)))
        live_rows.append(rec)
        print(report.format_row(rec), flush=True)

    live_rows: List[Dict[str, Any]] = []
    # Before and after each job: a VM's host moves its vCPUs while they idle,
    # near each other or far apart, and far apart every byte handed between
    # ranks costs more; this tells which placement each job started and ended with.
    core_rtt: List[Dict[str, Any]] = []

    def probe_ns() -> Optional[float]:
        try:
            probe = core_roundtrip()
        except LimitsError:
            probe = None
        return round(probe["ns"], 1) if probe else None

    payload = [c.to_json() for c in sweeps]
    for k in range(rounds):
        if args.limits:
            say(f"ringlet bench: measuring limits ({k + 1}/{rounds}) ..." if rounds > 1
                else "ringlet bench: measuring limits ...")
            limit_samples.append(measure(max(2, n), args.duration,
                                         congestion=args.congestion))
            if live:
                print(format_limits(limit_samples[0]), flush=True)
                print(flush=True)
        order = systems[k % len(systems):] + systems[:k % len(systems)]
        for s in order:
            if s in skipped:
                continue
            rtt = probe_ns()
            probes = {"round": k, "system": s, "ns": rtt, "ns_after": None}
            core_rtt.append(probes)
            t0 = time.monotonic()
            try:
                # The same load beside every system's job, started afresh for each.
                with busy_loops(args.busy):
                    res = launch.run_system(s, n, payload, timeout=args.timeout,
                                            on_record=on_live if (live and s == "ringlet")
                                            else None)
            except BusyError as exc:
                say(f"ringlet bench: {exc}")
                return EXIT_FAILED
            except launch.LaunchError as exc:
                if s == "ringlet":
                    say(f"ringlet bench: ringlet's job failed:\n{exc}")
                    return EXIT_FAILED
                say(f"ringlet bench: skipping {s}: its job failed:\n{exc}")
                skipped[s] = f"job failed: {str(exc).splitlines()[0]}"
                continue
            probes["ns_after"] = after = probe_ns()
            per_round[s].append([dict(r, system=s) for r in res.rows])
            versions[s] = res.versions
            for op, why in res.skipped.items():
                op_skips.setdefault(s, {})[op] = why
            if not live:
                say(f"ringlet bench: round {k + 1}/{rounds}: {s} done in "
                    f"{time.monotonic() - t0:.1f} s"
                    + (f" (CPU-to-CPU cache line round trip before it: {rtt} ns, after it: "
                       f"{after} ns)" if rtt or after else ""))
    if live and state["op"] is not None:
        print(report.format_footer([r for r in live_rows if r["op"] == state["op"]]))
    systems = [s for s in systems if s not in skipped]
    rows = []
    for s in systems:
        rows += [{k: v for k, v in r.items() if k != "kind"}
                 for r in report.aggregate(per_round[s])]
    for s, ops in op_skips.items():
        for op, why in ops.items():
            say(f"ringlet bench: {s} skipped {op}: {why}")
    ring_rows = [r for r in rows if r["system"] == "ringlet"]
    limits_res = median_limits(limit_samples) if limit_samples else None
    if limits_res and not live:
        print(format_limits(limits_res), flush=True)
        print(flush=True)
    if not live:
        for cfg in sweeps:
            mine = [r for r in ring_rows if r["op"] == cfg.op]
            if not mine:
                continue
            print(report.format_table(_title(cfg, n, "local launch", rounds, args.busy), mine,
                                      peers=[p for p in systems if p != "ringlet"],
                                      all_rows=rows))
            if len(systems) > 1:
                print()
                print(report.format_compare(
                    f"{cfg.op}, {n} ranks: median time and busbw (GB/s) per system",
                    [r for r in rows if r["op"] == cfg.op], systems))
            print()
        for s in systems:
            bad = sum(r["wrong"] for r in rows if r["system"] == s and r["wrong"] > 0)
            if s != "ringlet" and bad:
                say(f"ringlet bench: warning: {s} produced {bad} wrong value(s)")
    if limits_res:
        print(_ceiling_column(ring_rows, limits_res, limit_samples, n))
        mem = _memory_column(ring_rows, limits_res, n)
        if mem:
            print()
            print(mem)
    env = report.environment_info(versions)
    if load_at_start is not None:
        env["loadavg_at_start"] = [round(x, 2) for x in load_at_start]
    all_skips = dict(skipped)
    for s, ops in op_skips.items():
        for op, why in ops.items():
            all_skips[f"{s}:{op}"] = why
    per_round_rows = [dict(r, round=k) for s in systems for k, rr in enumerate(per_round[s])
                      for r in rr]
    _outputs(args, rows, systems, all_skips, env, limit_samples, say, per_round_rows, core_rtt)
    return _exit_code(ring_rows, args, say)


# ---- inside an existing launch --------------------------------------------------
def _run_in_place(args: argparse.Namespace, source: str) -> int:
    import ringlet

    from .ringlet_driver import RingletBackend
    from .sweep import run_sweep

    if args.vs:
        raise _Usage("--vs needs `ringlet bench` to launch every system itself; run it "
                     "outside mpirun/srun/torchrun/ringlet run")
    if args.limits:
        raise _Usage("--limits starts its own processes; run `ringlet bench limits` outside "
                     "a launch")
    if args.busy:
        raise _Usage("--busy starts its loops beside the jobs `ringlet bench` launches; run "
                     "it outside mpirun/srun/torchrun/ringlet run")
    ringlet.init()
    try:
        backend = RingletBackend()
        args.nranks_eff = backend.size
        args.rounds = 1
        sweeps = _sweeps(args)
        lead = backend.rank == 0

        def say(msg: str) -> None:
            if lead:
                print(msg, file=sys.stderr, flush=True)

        rows: List[Dict[str, Any]] = []
        for cfg in sweeps:
            if lead:
                print(report.format_header(_title(cfg, backend.size, f"in place under {source}",
                                                  1)), flush=True)
            got = run_sweep(backend, cfg, on_row=(lambda r: print(report.format_row(r),
                                                                  flush=True)) if lead else None)
            rows += got
            if lead:
                print(report.format_footer(got))
                print()
        if lead:
            env = report.environment_info({"ringlet": backend.versions()})
            env["launcher"] = source
            _outputs(args, rows, ["ringlet"], {}, env, (), say)
        return _exit_code(rows, args, say)
    finally:
        ringlet.shutdown()


def _run_limits(args: argparse.Namespace) -> int:
    from .limits import format_limits, measure

    res = measure(max(2, args.nranks), args.duration, congestion=args.congestion,
                  progress=lambda s: print(f"ringlet bench limits: {s} ...", file=sys.stderr,
                                           flush=True))
    print(format_limits(res))
    if args.json:
        report.write_json(args.json, {"tool": "ringlet bench limits", "limits": res,
                                      "environment": report.environment_info()})
    return EXIT_OK


def _run_model(args: argparse.Namespace) -> int:
    from .model import run_model

    try:
        text = run_model(args.params, args.intra_limits, args.inter_limits, args.minbytes,
                         args.maxbytes, args.save,
                         args.json)
    except (OSError, ValueError) as exc:
        raise _Usage(f"model: {exc}") from None
    print(text)
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ringlet bench`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    Example::

        from ringlet.bench import main
        main(["all_reduce", "-n", "2", "-e", "1M", "--check"])
    """
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help (0) or a usage error (2): an exit code, not a raise
        return int(exc.code or 0) if isinstance(exc.code, (int, type(None))) else EXIT_USAGE
    if args.maxbytes is None:
        args.maxbytes = 1 << 30 if args.op == "model" else 64 << 20
    try:
        if args.warmup < 0:
            raise _Usage(f"--warmup must be >= 0, got {args.warmup}")
        if not 0 <= args.budget < math.inf:
            raise _Usage(f"--budget must be >= 0 seconds, got {args.budget}")
        if not 0 < args.duration < math.inf:
            raise _Usage(f"--duration must be > 0 seconds, got {args.duration}")
        # A NaN deadline would never fire: a hung job would never be killed.
        if not 0 < args.timeout < math.inf:
            raise _Usage(f"--timeout must be > 0 seconds, got {args.timeout}")
        if args.min_busbw is not None and not 0 <= args.min_busbw < math.inf:
            raise _Usage(f"--min-busbw must be a number of GB/s >= 0, got {args.min_busbw}")
        if args.busy < 0:
            raise _Usage(f"--busy must be >= 0 processes, got {args.busy}")
        if args.busy and args.op == "limits":
            raise _Usage("--busy applies to the sweeps; `limits` measures the idle machine")
        if args.op == "limits" or args.limits:
            from .limits import resolve_congestion

            try:
                resolve_congestion(args.congestion)
            except ValueError as exc:
                raise _Usage(f"--congestion: {exc}") from None
        if args.plot:
            from .plot import PlotUnavailable, require_matplotlib

            try:
                require_matplotlib()
            except PlotUnavailable as exc:
                raise _Usage(str(exc)) from None
            if args.op == "barrier":
                raise _Usage("--plot: a barrier has no size axis to plot")
        if args.op == "limits":
            return _run_limits(args)
        if args.op == "model":
            return _run_model(args)
        from ..environment import detect

        try:
            env = detect()
        except ValueError as exc:
            raise _Usage(f"malformed launcher variables: {exc}") from None
        if env is not None:
            return _run_in_place(args, env.source)
        args.nranks_eff = args.nranks
        return _run_launched(args)
    except _Usage as exc:
        parser.print_usage(sys.stderr)
        print(f"ringlet bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
