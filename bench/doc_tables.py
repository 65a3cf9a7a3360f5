"""Rewrite a "Collectives, N ranks" section of docs/benchmarks.md from one sweep's output.

Takes the text report and the JSON file of one
``ringlet bench all -n N ... --vs mpi,gloo --limits --json FILE.json > FILE.txt``
run and replaces the body of the section headed ``## Collectives, N ranks``
(up to the next ``## `` heading) with: the limits block, the target tables
(``bench/targets.py``), every op's side-by-side table and the plot.

    python3 bench/doc_tables.py docs/benchmarks.md .bench-out/all_n2.txt .bench-out/all_n2.json \\
        docs/img/bench_all_n2.png
"""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import summary  # noqa: E402


def _blocks(text: str) -> tuple:
    """(limits lines, side-by-side tables) of a ``ringlet bench all`` text report."""
    lines = text.splitlines()
    # Rows start with a letter; the indented "each link timed on its own" rows
    # under a stream pattern belong to it.
    limits = [ln for ln in lines if ln.startswith("measure") or re.match(r"^ *[A-Za-z].*  \S+  (GB/s|us)$", ln)]
    tables, cur = [], None
    for ln in lines:
        if re.match(r"^# \w+, \d+ ranks: median time and busbw", ln):
            cur = [ln]
            tables.append(cur)
        elif cur is not None and (ln.startswith("#") or ln.startswith(" ")) and ln.strip():
            cur.append(ln)
        else:
            cur = None
    return limits, tables


def section(text: str, doc: dict, plot: str) -> str:
    limits, tables = _blocks(text)
    n = doc["nranks"]
    t = summary(doc).split("\n\n")
    k = (doc.get("limits") or {}).get("samples", 1)
    how = (f"median of {k} measurements, one before each round" if k > 1
           else "measured at the start")
    if (doc.get("limits") or {}).get("volume_bytes"):
        how += "; every link of a pattern timed carrying the same bytes, until the last ends"
    body = [
        f"Machine ceilings of the same run (`--limits`; {how}):", "",
        "```", *limits, "```", "",
        "Ratios to the faster of Open MPI over TCP and gloo (bold: ringlet behind), and "
        "large-message", "busbw against the ceiling, from `bench/targets.py`:", "",
    ]
    for part in t:
        lines = part.split("\n")
        if lines[0].startswith("# "):
            body += [f"*{lines[0][2:]}*", "", *lines[1:], ""]
        else:
            body += [part[0].upper() + part[1:] + ".", ""]
    body += ["Every op, every system (median time of the slowest rank, and busbw):", "", "```"]
    for i, tab in enumerate(tables):
        body += tab + ([""] if i < len(tables) - 1 else [])
    body += ["```", "", f"![busbw and time against size, {n} ranks]({plot})", ""]
    return "\n".join(body)


def main(md: str, txt: str, js: str, plot: str) -> int:
    with open(txt) as f:
        text = f.read()
    with open(js) as f:
        doc = json.load(f)
    with open(md) as f:
        page = f.read()
    head = f"## Collectives, {doc['nranks']} ranks\n"
    a = page.index(head) + len(head)
    b = page.index("\n## ", a) + 1
    rel = os.path.relpath(plot, os.path.dirname(os.path.abspath(md)))
    page = page[:a] + "\n" + section(text, doc, rel) + "\n" + page[b:]
    with open(md, "w") as f:
        f.write(page)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
