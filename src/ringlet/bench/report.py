"""Tables, round aggregation and machine-readable output for ``ringlet bench``.

The text table follows nccl-tests: one row per size with size, count, type,
redop, root, time, algbw, busbw and #wrong, plus p10/p90 and, with ``--vs``,
ringlet's time divided by each peer's (``vs mpi-tcp`` < 1: ringlet is faster).
JSON and CSV carry the same rows with the environment (versions, build,
tuning knobs, host): never a secret nor the process environment at large.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import socket
from statistics import median
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["COLUMNS", "environment_info", "aggregate", "format_header", "format_row",
           "format_footer", "format_table", "format_compare", "average_busbw", "write_json",
           "write_csv", "ratio_columns"]

# Row fields, in CSV column order (environment columns follow).
COLUMNS = ("system", "op", "nranks", "size", "count", "type", "redop", "root", "time_us",
           "p10_us", "p90_us", "time_rank_mean_us", "algbw", "busbw", "wrong", "iters",
           "inflight", "batch", "in_place", "offset", "rounds")


def environment_info(versions: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """Facts about this run: versions, build, tuning, host.  Contains no secret.

    Args:
        versions: per-system version dicts reported by each job's rank 0.
    """
    import numpy as np

    info: Dict[str, Any] = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    if hasattr(os, "getloadavg"):  # was the machine idle while measuring?
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    try:
        import ringlet
        from ringlet import _core

        info["ringlet"] = ringlet.__version__
        info["build"] = _core.build_info()
        tuning_env = [k["env"] for k in _core.knobs() if k["env"]]
    except ImportError as exc:  # pragma: no cover - the extension is missing
        info["ringlet"] = f"unavailable ({exc})"
        tuning_env = []
    info["tuning_env"] = {k: os.environ[k] for k in tuning_env if k in os.environ}
    if versions:
        info["systems"] = versions
    return info


def _key(row: Dict[str, Any]) -> Tuple:
    return (row["system"], row["op"], row["size"])


def aggregate(rounds: Sequence[Sequence[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Median over rounds of each (system, op, size): time, p10, p90; bandwidths follow.

    ``wrong`` is summed over rounds (-1 when unchecked).  Row order follows
    the first round in which each row appears.  ``round_min_us`` and
    ``round_max_us`` keep the fastest and slowest round's time: on a shared
    machine a whole round can run at half speed (docs/experiments.md, "Two
    speeds at 2 ranks, large messages"), which the median hides.
    """
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for rows in rounds:
        for row in rows:
            groups.setdefault(_key(row), []).append(row)
    out = []
    for rows in groups.values():
        first = dict(rows[0])
        t = median(r["time_us"] for r in rows)
        first["time_us"] = t
        first["p10_us"] = median(r["p10_us"] for r in rows)
        first["p90_us"] = median(r["p90_us"] for r in rows)
        if all("time_rank_mean_us" in r for r in rows):
            first["time_rank_mean_us"] = median(r["time_rank_mean_us"] for r in rows)
        factor = first["busbw"] / first["algbw"] if first["algbw"] else 0.0
        first["algbw"] = first["size"] / (t * 1e-6) / 1e9 if t > 0 else 0.0
        first["busbw"] = first["algbw"] * factor
        wrongs = [r["wrong"] for r in rows]
        first["wrong"] = -1 if any(w < 0 for w in wrongs) else sum(wrongs)
        first["iters"] = sum(r["iters"] for r in rows)
        first["rounds"] = len(rows)
        first["round_min_us"] = min(r["time_us"] for r in rows)
        first["round_max_us"] = max(r["time_us"] for r in rows)
        out.append(first)
    return out


def average_busbw(rows: Iterable[Dict[str, Any]]) -> float:
    """nccl-tests' footer: the mean busbw over the rows (0 for none)."""
    vals = [r["busbw"] for r in rows]
    return sum(vals) / len(vals) if vals else 0.0


def ratio_columns(rows: Sequence[Dict[str, Any]], peers: Sequence[str],
                  all_rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Optional[float]]]:
    """Per ringlet row: {peer: ringlet time / peer time} (None where the peer has no row)."""
    index = {_key(r): r for r in all_rows}
    out = []
    for r in rows:
        d: Dict[str, Optional[float]] = {}
        for p in peers:
            other = index.get((p, r["op"], r["size"]))
            d[p] = (r["time_us"] / other["time_us"]
                    if other and other["time_us"] > 0 else None)
        out.append(d)
    return out


_HDR = ("{:>12} {:>12} {:>9} {:>6} {:>5} {:>10} {:>10} {:>10} {:>8} {:>8} {:>7}")


def format_header(title: str, peers: Sequence[str] = ()) -> str:
    """The table's comment lines: title, column names, units."""
    extra = "".join(f" {('vs ' + p):>11}" for p in peers)
    names = _HDR.format("size", "count", "type", "redop", "root", "time", "p10", "p90",
                        "algbw", "busbw", "#wrong") + extra
    units = _HDR.format("(B)", "(elements)", "", "", "", "(us)", "(us)", "(us)", "(GB/s)",
                        "(GB/s)", "") + "".join(f" {'(time)':>11}" for _ in peers)
    return f"# {title}\n#{names[1:]}\n#{units[1:]}"


def _t(x: float) -> str:
    return f"{x:.1f}" if x < 1e5 else f"{x:.0f}"


def format_row(row: Dict[str, Any], ratios: Optional[Dict[str, Optional[float]]] = None,
               peers: Sequence[str] = ()) -> str:
    """One table line for ``row``."""
    root = "-" if row["root"] < 0 else str(row["root"])
    wrong = "N/A" if row["wrong"] < 0 else str(row["wrong"])
    line = _HDR.format(row["size"], row["count"], row["type"], row["redop"], root,
                       _t(row["time_us"]), _t(row["p10_us"]), _t(row["p90_us"]),
                       f"{row['algbw']:.3f}", f"{row['busbw']:.3f}", wrong)
    for p in peers:
        v = (ratios or {}).get(p)
        line += f" {('-' if v is None else f'{v:.2f}'):>11}"
    return line


# Rounds further apart than this get a line under the table.
SPREAD_NOTE = 1.5


def format_footer(rows: Sequence[Dict[str, Any]]) -> str:
    wrong = [r["wrong"] for r in rows if r["wrong"] >= 0]
    lines = [f"# Out of bounds values : {sum(wrong) if wrong else 'N/A'}",
             f"# Avg bus bandwidth    : {average_busbw(rows):.4f} GB/s"]
    wide = [r for r in rows if r.get("rounds", 1) > 1 and r.get("round_min_us", 0) > 0
            and r["round_max_us"] / r["round_min_us"] > SPREAD_NOTE]
    if wide:
        cells = ", ".join(f"{r['size']} B {_t(r['round_min_us'])}-{_t(r['round_max_us'])} us"
                          for r in wide)
        lines.append(f"# Rounds more than {SPREAD_NOTE}x apart (the machine changed speed; "
                     f"the median of the rounds is shown): {cells}")
    return "\n".join(lines)


def format_table(title: str, rows: Sequence[Dict[str, Any]], peers: Sequence[str] = (),
                 all_rows: Sequence[Dict[str, Any]] = ()) -> str:
    """Header, one line per row (with ratio columns for ``peers``), footer."""
    ratios = ratio_columns(rows, peers, all_rows) if peers else [None] * len(rows)
    body = [format_row(r, q, peers) for r, q in zip(rows, ratios)]
    return "\n".join([format_header(title, peers), *body, format_footer(rows)])


def format_compare(title: str, rows: Sequence[Dict[str, Any]], systems: Sequence[str]) -> str:
    """Side by side: median time and busbw of every system per size."""
    sizes: List[int] = []
    for r in rows:
        if r["size"] not in sizes:
            sizes.append(r["size"])
    index = {(r["system"], r["size"]): r for r in rows}
    w = max(9, max(len(s) for s in systems) + 1)
    head = f"#{'size':>11}" + "".join(f" {s:>{w}}" for s in systems) + " |" + \
        "".join(f" {s:>{w}}" for s in systems)
    units = f"#{'(B)':>11}" + "".join(f" {'time(us)':>{w}}" for _ in systems) + " |" + \
        "".join(f" {'busbw':>{w}}" for _ in systems)
    lines = [f"# {title}", head, units]
    for size in sorted(sizes):
        cells_t, cells_b = [], []
        for s in systems:
            r = index.get((s, size))
            cells_t.append(f" {(_t(r['time_us']) if r else '-'):>{w}}")
            bw = f"{r['busbw']:.3f}" if r else "-"
            cells_b.append(f" {bw:>{w}}")
        lines.append(f"{size:>12}" + "".join(cells_t) + " |" + "".join(cells_b))
    return "\n".join(lines)


def write_json(path: str, doc: Dict[str, Any]) -> None:
    """Write ``doc`` as indented JSON (atomically: a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def _flat_env(env: Dict[str, Any]) -> Dict[str, Any]:
    build = env.get("build") or {}
    tuning = build.get("tuning") or {}
    flat = {"ringlet_version": env.get("ringlet"), "python_version": env.get("python"),
            "numpy_version": env.get("numpy"), "hostname": env.get("hostname"),
            "cpu_count": env.get("cpu_count"), "platform": env.get("platform"),
            "simd": build.get("simd"), "compile_flags": build.get("compile_flags"),
            "timestamp": env.get("timestamp")}
    for k, v in tuning.items():
        flat[f"tuning_{k}"] = v
    for k, v in (env.get("tuning_env") or {}).items():
        flat[k] = v
    return flat


def write_csv(path: str, rows: Sequence[Dict[str, Any]], env: Dict[str, Any]) -> None:
    """One line per row: the row's columns, then the environment's, repeated."""
    flat = _flat_env(env)
    fields = list(COLUMNS) + [k for k in flat if k not in COLUMNS]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**flat, **{c: r.get(c, "") for c in COLUMNS}})
    os.replace(tmp, path)
