"""Summarise a ``ringlet bench all --vs mpi,gloo --json`` file against the speed targets.

Prints, per size and op, ringlet's time divided by the faster of Open MPI
over TCP and gloo measured in the same run (<= 1.00 meets the target), and
for large messages ringlet's busbw as a share of the loopback TCP ceiling
from the same run's ``limits`` (docs/benchmarks.md explains the
translation).

The verdict of a cell is the median over rounds of the paired ratio: round
k of ringlet against round k of each peer.  Rounds are interleaved, so a
slow phase of the machine, which lasts a whole round and slows every
system alike, lands on both sides of a pair instead of deciding the cell
by which system drew it.  The ratio of the overall medians is counted too.

    python3 bench/targets.py .bench-out/all_n4.json
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Dict, Tuple

from ringlet.bench.limits import ceilings

PEERS = ("mpi-tcp", "gloo")
LARGE = 16 << 20


def ceiling(limits: dict, op: str, nranks: int) -> float:
    """The per-link TCP rate the op's busiest link can reach on this machine."""
    return ceilings(limits, nranks)[op]


def main(path: str) -> int:
    with open(path) as f:
        print(summary(json.load(f)))
    return 0


def paired_ratio(doc: dict, op: str, size: int) -> float:
    """Median over rounds of ringlet's time / the faster peer's in that round."""
    per: Dict[int, Dict[str, float]] = {}
    for r in doc.get("round_rows", ()):
        if r["op"] == op and r["size"] == size:
            per.setdefault(r["round"], {})[r["system"]] = r["time_us"]
    qs = [t["ringlet"] / min(t[p] for p in PEERS if p in t)
          for t in per.values() if "ringlet" in t and any(p in t for p in PEERS)]
    return statistics.median(qs) if qs else float("nan")


def summary(doc: dict) -> str:
    """The two target tables of one ``--json`` document, as markdown."""
    out = []
    n = doc["nranks"]
    rows: Dict[Tuple[str, int], Dict[str, dict]] = {}
    for r in doc["rows"]:
        rows.setdefault((r["op"], r["size"]), {})[r["system"]] = r
    ops = list(dict.fromkeys(op for op, _ in rows))
    sizes = sorted({s for _, s in rows})
    out.append(f"# {n} ranks: ringlet time / min(mpi-tcp, gloo) time, median of the per-round "
               "ratios (<= 1.00 meets the target)")
    out.append("| size (B) | " + " | ".join(ops) + " |")
    out.append("|---:|" + "---:|" * len(ops))
    worst, behind_medians, ncells = [], 0, 0
    for s in sizes:
        cells = []
        for op in ops:
            got = rows.get((op, s), {})
            peers = [got[p]["time_us"] for p in PEERS if p in got]
            if "ringlet" not in got or not peers:
                cells.append("")
                continue
            ncells += 1
            behind_medians += got["ringlet"]["time_us"] > min(peers)
            q = paired_ratio(doc, op, s)
            if q != q:  # no per-round rows (an older file): the ratio of medians
                q = got["ringlet"]["time_us"] / min(peers)
            cells.append(f"**{q:.2f}**" if q > 1.0 else f"{q:.2f}")
            if q > 1.0:
                worst.append((q, op, s))
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    out.append(f"\nbehind in {len(worst)} of {ncells} cells"
               + (f"; worst {max(worst)[0]:.2f} ({max(worst)[1]}, {max(worst)[2]} B)" if worst else "")
               + f" (by the ratio of the overall medians: behind in {behind_medians})")
    lim = doc.get("limits")
    if lim:
        each = doc.get("limits_rounds") or [lim]
        k = len(each)
        out.append(f"\n# {n} ranks: busbw of large messages as % of the TCP ceiling"
                   + (f" (median of {k} measurements, one before each round; range; and the "
                      "median over rounds of round k's busbw / round k's ceiling)" if k > 1 else ""))
        out.append("| op | size (B) | busbw GB/s | ceiling GB/s | range | % | % paired |")
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for op in ("all_reduce", "broadcast", "reduce_scatter", "all_gather"):
            for s in sizes:
                r = rows.get((op, s), {}).get("ringlet")
                if r and s >= LARGE:
                    c = ceiling(lim, op, n)
                    cs = [ceiling(e, op, n) for e in each]
                    q = paired_share(doc, op, s, cs)
                    out.append(f"| {op} | {s} | {r['busbw']:.2f} | {c:.2f} | "
                               f"{min(cs):.2f}–{max(cs):.2f} | {100 * r['busbw'] / c:.0f} | "
                               + ("–" if q != q else f"{q:.0f}") + " |")
    return "\n".join(out)


def paired_share(doc: dict, op: str, size: int, ceilings: list) -> float:
    """Median over rounds of ringlet's busbw in round k / the ceiling measured before it."""
    got = {r["round"]: r["busbw"] for r in doc.get("round_rows", ())
           if r["system"] == "ringlet" and r["op"] == op and r["size"] == size}
    if len(ceilings) < 2 or len(got) != len(ceilings):
        return float("nan")
    return statistics.median(100 * got[k] / c for k, c in enumerate(ceilings))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
