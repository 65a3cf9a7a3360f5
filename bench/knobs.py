"""Measure the effect of ringlet's tuning knobs, interleaved.

Each variant is a set of ``RINGLET_*`` environment variables (docs/experiments.md,
"Knobs").  Every round runs ``ringlet bench`` once per variant, in turn, so slow
drifts of this shared machine hit every variant alike; the table shows, per size,
the median over rounds of each variant's median time.

    PYTHONPATH=src python3 bench/knobs.py all_reduce -n 2 -b 1M -e 64M -f 4 \\
        --rounds 3 --vary RINGLET_SEGMENT_BYTES=262144,524288,1048576,2097152

To time two builds of ringlet against each other the same way, name each one's
``src`` folder with ``--build`` (e.g. a ``git worktree`` of the commit before,
built with ``python setup.py build_ext --inplace``); every round then runs each
build in turn, with ``PYTHONPATH`` pointing at it:

    python3 bench/knobs.py reduce -n 2 -b 4K -e 64K -f 2 --rounds 7 \\
        --build /tmp/old/src --build src

OP may be ``all`` (one row per op and size).  Arguments after the known options
go to ``ringlet bench`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple


def _variants(spec: List[str]) -> List[Dict[str, str]]:
    """``VAR=a,b`` options -> one env dict per value (one knob varied at a time)."""
    out: List[Dict[str, str]] = [{}]
    for item in spec:
        var, _, values = item.partition("=")
        if not var.startswith("RINGLET_") or not values:
            raise SystemExit(f"--vary wants RINGLET_NAME=v1,v2,... ; got {item!r}")
        out = [dict(base, **{var: v}) for base in out for v in values.split(",")]
    return out


def _run(op: str, rest: List[str], env_extra: Dict[str, str], out: str) -> List[dict]:
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, "-m", "ringlet.cli", "bench", op, *rest, "--rounds", "1",
           "--json", out]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return [r for r in json.load(f)["rows"] if r["system"] == "ringlet"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("op")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vary", action="append", default=[], metavar="RINGLET_VAR=v1,v2")
    p.add_argument("--build", action="append", default=[], metavar="SRC_DIR",
                   help="a build's src folder; with two or more, each round runs every build")
    args, rest = p.parse_known_args()
    if not args.vary and len(args.build) < 2:
        p.error("give --vary RINGLET_VAR=v1,v2 or two or more --build SRC_DIR")
    variants = _variants(args.vary)
    if args.build:
        for d in args.build:
            if not os.path.isdir(os.path.join(d, "ringlet")):
                p.error(f"--build {d}: no ringlet package in it")
        variants = [dict(env, PYTHONPATH=os.path.abspath(d)) for d in args.build
                    for env in variants]
    times: Dict[Tuple[int, str, int], List[float]] = {}
    busbw: Dict[Tuple[int, str, int], List[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for i, env in enumerate(variants):
                print(f"round {rnd + 1}/{args.rounds}: {env}", file=sys.stderr)
                for row in _run(args.op, rest, env, os.path.join(tmp, f"{i}.json")):
                    print(f"  {row['op']} {row['size']} B: {row['time_us']:.1f} us",
                          file=sys.stderr)
                    key = (i, row["op"], row["size"])
                    times.setdefault(key, []).append(row["time_us"])
                    busbw.setdefault(key, []).append(row["busbw"])
    first = {}  # ops in the order the sweep ran them
    for _, op, _s in times:
        first.setdefault(op, len(first))
    cells = sorted({(op, s) for _, op, s in times}, key=lambda c: (first[c[0]], c[1]))
    names = [" ".join(f"{k[8:]}={v}" if k.startswith("RINGLET_") else f"build {v}"
                      for k, v in env.items()) for env in variants]
    print(f"# {args.op} {' '.join(rest)}; median over {args.rounds} interleaved rounds")
    many = len({op for op, _ in cells}) > 1  # OP "all": one row per op and size
    print("# " + ("op | " if many else "") + "size (B) | "
          + " | ".join(f"{n}: us, GB/s" for n in names))
    for op, s in cells:
        row = []
        for i in range(len(variants)):
            t = statistics.median(times[(i, op, s)])
            b = statistics.median(busbw[(i, op, s)])
            row.append(f"{t:10.1f} {b:6.3f}")
        print((f"{op:>14} | " if many else "") + f"{s:12d} | " + " | ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
