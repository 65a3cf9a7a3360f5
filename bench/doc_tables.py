"""Regenerate the collective tables and plots of docs/benchmarks.md.

One command runs the sweeps and rewrites the page (from a source checkout; it measures the
ringlet of this checkout's src/):

    python3 bench/doc_tables.py --sweep [--ranks 2,4] [--rounds 9] [--out .bench-out] [--dry-run]

For each N it runs ``ringlet bench all -n N ... --vs mpi,gloo --limits`` (the exact command is
printed, and ``--dry-run`` prints only that), keeps the text report, JSON file and plot under
``--out``, writes the plot scaled to the page's width into docs/img/bench_all_nN.png (needs
matplotlib) and replaces the body of the section headed ``## Collectives, N ranks`` (up to the
next ``## `` heading) with: the limits block, the target tables (``bench/targets.py``), every
op's side-by-side table and the plot.  The rewrite alone, from files of an earlier run:

    python3 bench/doc_tables.py docs/benchmarks.md .bench-out/all_n2.txt .bench-out/all_n2.json \\
        docs/img/bench_all_n2.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
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


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PAGE = os.path.join(REPO, "docs", "benchmarks.md")
PAGE_WIDTH_PX = 726  # the page's plots are scaled to this width


def sweep_command(n: int, rounds: int, out: str) -> list:
    """The ``ringlet bench`` command whose output one "Collectives, N ranks" section shows."""
    base = os.path.join(out, f"all_n{n}")
    return ["ringlet", "bench", "all", "-n", str(n), "-b", "8", "-e", "256M", "-f", "8",
            "-i", "500", "--vs", "mpi,gloo", "--rounds", str(rounds), "--limits",
            "--json", base + ".json", "--plot", base + ".png"]


def _scaled_copy(src: str, dst: str, width: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    img = mpimg.imread(src)
    h, w = img.shape[:2]
    fig = plt.figure(figsize=(width / 100, round(h * width / w) / 100), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.axis("off")
    ax.imshow(img, interpolation="antialiased")
    fig.savefig(dst, dpi=100)
    plt.close(fig)


def sweep(ranks: list, rounds: int, out: str, dry_run: bool) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(REPO, "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for n in ranks:
        cmd = sweep_command(n, rounds, out)
        txt = os.path.join(out, f"all_n{n}.txt")
        print(shlex.join(cmd) + " > " + txt, flush=True)
        if dry_run:
            continue
        os.makedirs(out, exist_ok=True)
        with open(txt, "w") as f:
            subprocess.run([sys.executable, "-m", "ringlet.cli"] + cmd[1:], stdout=f, env=env,
                           check=True)
        img = os.path.join(REPO, "docs", "img", f"bench_all_n{n}.png")
        try:
            _scaled_copy(os.path.join(out, f"all_n{n}.png"), img, PAGE_WIDTH_PX)
        except ImportError:
            print(f"matplotlib is missing: {img} left as it was (pip install matplotlib)",
                  file=sys.stderr)
        main(PAGE, txt, os.path.join(out, f"all_n{n}.json"), img)
    return 0


def cli(argv: list) -> int:
    if not argv or argv[0] != "--sweep":
        if len(argv) != 4:
            sys.exit(__doc__)
        return main(*argv)
    p = argparse.ArgumentParser(description="Run the sweeps and rewrite docs/benchmarks.md.")
    p.add_argument("--sweep", action="store_true", required=True)
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    p.add_argument("--out", default=".bench-out", help="raw outputs (default .bench-out)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    a = p.parse_args(argv)
    return sweep([int(x) for x in a.ranks.split(",")], a.rounds, a.out, a.dry_run)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
