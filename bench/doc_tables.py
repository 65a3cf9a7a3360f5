"""Regenerate the collective tables and plots of docs/benchmarks.md.

One command runs the sweeps and rewrites the page (from a source checkout; it measures the
ringlet of this checkout's src/):

    python3 bench/doc_tables.py --sweep [--ranks 2,4] [--rounds 9] [--variants batch,barrier,busy]
                                [--batch 20] [--busy 2] [--out .bench-out] [--dry-run]

Every sweep is ``ringlet bench all -n N ... --vs ringlet-tcp,mpi,gloo`` (ringlet with its
transport chosen automatically, ringlet over TCP alone, Open MPI over shared memory and
over TCP, gloo; interleaved in each round).  Three variants, each for every N:

* ``batch`` (the primary tables): ``--batch 20`` operations back to back after each
  barrier, nccl-tests' method; with ``--limits``;
* ``barrier`` (secondary): one operation per barrier, the latency of one isolated call;
  with ``--limits``;
* ``busy``: as ``batch``, beside ``--busy 2`` busy-looping processes (issue #31's busy host).

The exact commands are printed (``--dry-run`` prints only those).  Each run's text report,
JSON file and plot stay under ``--out``; the plot, scaled to the page's width, goes to
docs/img/bench_VARIANT_nN.png (needs matplotlib; the ``barrier`` plots keep their old name,
bench_all_nN.png), and the body of the section headed ``## Collectives, N ranks, ...`` for
that variant (up to the next ``## `` heading) is replaced with: when and how it was measured,
the limits block, the target tables (``bench/targets.py``), every op's side-by-side table
and the plot.  The rewrite alone, from files of an earlier run (the variant is read from
the JSON file):

    python3 bench/doc_tables.py docs/benchmarks.md .bench-out/batch_n2.txt \\
        .bench-out/batch_n2.json docs/img/bench_batch_n2.png
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
    limits = [ln for ln in lines if ln.startswith("measure") or re.match(r"^ *[A-Za-z].*  \S+  (GB/s|us|ns)$", ln)]
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


VARIANTS = ("batch", "barrier", "busy")
BATCH = 20  # nccl-tests' default iteration count, timed back to back
BUSY = 2  # target 2's busy loops
MAXBYTES = 256 << 20
MIN_ROUNDS = 5  # interleaved rounds the page's tables need (issue #31)


def variant_of(doc: dict) -> str:
    """The variant a ``ringlet bench --json`` document was measured as."""
    cfg = doc.get("config") or {}
    if cfg.get("busy", 0):
        return "busy"
    return "batch" if cfg.get("batch", 1) > 1 else "barrier"


def heading(variant: str, n: int) -> str:
    """The page's section heading for ``variant`` at ``n`` ranks."""
    if variant == "batch":
        return f"## Collectives, {n} ranks, back to back"
    if variant == "barrier":
        return f"## Collectives, {n} ranks, one operation per barrier"
    if variant == "busy":  # the section says how many loops
        return f"## Collectives, {n} ranks, back to back on a busy host"
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


def section(text: str, doc: dict, plot: str, command: str = "", commit: str = "") -> str:
    limits, tables = _blocks(text)
    n = doc["nranks"]
    cfg = doc.get("config") or {}
    env = doc.get("environment") or {}
    t = summary(doc).split("\n\n")
    k = (doc.get("limits") or {}).get("samples", 1)
    how = (f"median of {k} measurements, one before each round" if k > 1
           else "measured at the start")
    if (doc.get("limits") or {}).get("volume_bytes"):
        how += "; every link of a pattern timed carrying the same bytes, until the last ends"
    when = env.get("timestamp", "an unrecorded time")
    body = [f"Measured by the run that ended {when}"
            + (f", on commit {commit}" if commit else "")
            + (f" ({cfg['rounds']} interleaved rounds" if cfg.get("rounds", 1) > 1
               else " (1 round")
            + (f"; {cfg['busy']} busy loops beside every system's job" if cfg.get("busy") else "")
            + (f"; up to {cfg['batch']} operations back to back per barrier" if
               cfg.get("batch", 1) > 1 else "; one operation per barrier")
            + "):", ""]
    if command:
        body += ["```", command, "```", ""]
    if limits:
        body += [f"Machine ceilings of the same run (`--limits`; {how}; measured without the "
                 "busy loops):" if cfg.get("busy") else
                 f"Machine ceilings of the same run (`--limits`; {how}):", "",
                 "```", *limits, "```", ""]
    body += ["The targets of issue #31, judged by `bench/targets.py` (bold: missed):", ""]
    for part in t:
        lines = part.split("\n")
        if lines[0].startswith("# "):
            body += [f"*{lines[0][2:]}*", "", *lines[1:], ""]
        else:
            body += [part, ""]
    body += ["Every op, every system (median time of the slowest rank, and busbw):", "", "```"]
    for i, tab in enumerate(tables):
        body += tab + ([""] if i < len(tables) - 1 else [])
    body += ["```", "", f"![busbw and time against size, {n} ranks]({plot})", ""]
    return "\n".join(body)


def main(md: str, txt: str, js: str, plot: str, commit: str = "") -> int:
    with open(txt) as f:
        text = f.read()
    with open(js) as f:
        doc = json.load(f)
    with open(md) as f:
        page = f.read()
    cfg = doc.get("config") or {}
    variant = variant_of(doc)
    head = heading(variant, doc["nranks"]) + "\n"
    try:
        a = page.index(head) + len(head)
    except ValueError:
        sys.exit(f"{md} has no section headed {head.strip()!r} for this run")
    b = page.index("\n## ", a) + 1
    rel = os.path.relpath(plot, os.path.dirname(os.path.abspath(md)))
    cmd = sweep_command(doc["nranks"], cfg.get("rounds") or 1, os.path.dirname(js) or ".",
                        variant, batch=cfg.get("batch", 1), busy=cfg.get("busy", 0),
                        maxbytes=cfg.get("maxbytes", MAXBYTES))
    shown = shlex.join(cmd) + " > " + txt
    page = page[:a] + "\n" + section(text, doc, rel, shown, commit) + "\n" + page[b:]
    with open(md, "w") as f:
        f.write(page)
    return 0


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PAGE = os.path.join(REPO, "docs", "benchmarks.md")
PAGE_WIDTH_PX = 726  # the page's plots are scaled to this width


def sweep_command(n: int, rounds: int, out: str, variant: str = "barrier", *,
                  batch: int = BATCH, busy: int = BUSY, maxbytes: int = MAXBYTES) -> list:
    """The ``ringlet bench`` command whose output one "Collectives, N ranks, ..." section shows."""
    heading(variant, n)  # rejects an unknown variant
    base = os.path.join(out, f"{variant}_n{n}")
    extra = {"batch": ["--batch", str(batch), "--limits"],
             "barrier": ["--limits"],
             "busy": ["--batch", str(batch), "--busy", str(busy)]}[variant]
    top = "256M" if maxbytes == MAXBYTES else str(maxbytes)
    return ["ringlet", "bench", "all", "-n", str(n), "-b", "8", "-e", top, "-f", "8",
            "-i", "500", "--vs", "ringlet-tcp,mpi,gloo", "--rounds", str(rounds), *extra,
            "--json", base + ".json", "--plot", base + ".png"]


def image(variant: str, n: int, page: str = "") -> str:
    """Where the plot of ``variant`` at ``n`` ranks lives: img/ beside the page."""
    name = "all" if variant == "barrier" else variant  # the barrier plots keep their name
    return os.path.join(os.path.dirname(os.path.abspath(page or PAGE)), "img",
                        f"bench_{name}_n{n}.png")


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return sha + (" with uncommitted changes" if dirty.strip() else "")


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


def sweep(ranks: list, rounds: int, out: str, dry_run: bool, variants: tuple = VARIANTS,
          batch: int = BATCH, busy: int = BUSY, maxbytes: int = MAXBYTES,
          page: str = "") -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(REPO, "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # "ringlet" is the automatic choice; ringlet-tcp sets its own
    env.pop("RINGLET_TRANSPORT", None)
    commit = "" if dry_run else _commit()
    for variant in variants:
        for n in ranks:
            cmd = sweep_command(n, rounds, out, variant, batch=batch, busy=busy,
                                maxbytes=maxbytes)
            base = os.path.join(out, f"{variant}_n{n}")
            txt = base + ".txt"
            print(shlex.join(cmd) + " > " + txt, flush=True)
            if dry_run:
                continue
            os.makedirs(out, exist_ok=True)
            with open(txt, "w") as f:
                subprocess.run([sys.executable, "-m", "ringlet.cli"] + cmd[1:], stdout=f, env=env,
                               check=True)
            img = image(variant, n, page)
            os.makedirs(os.path.dirname(img), exist_ok=True)
            try:
                _scaled_copy(base + ".png", img, PAGE_WIDTH_PX)
            except ImportError:
                print(f"matplotlib is missing: {img} left as it was (pip install matplotlib)",
                      file=sys.stderr)
            main(page or PAGE, txt, base + ".json", img, commit)
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
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated, from batch (primary), barrier, busy (default all)")
    p.add_argument("--batch", type=int, default=BATCH,
                   help=f"operations back to back per barrier in batch and busy (default {BATCH})")
    p.add_argument("--busy", type=int, default=BUSY,
                   help=f"busy loops beside every job in the busy variant (default {BUSY})")
    p.add_argument("--out", default=".bench-out", help="raw outputs (default .bench-out)")
    p.add_argument("--page", default=PAGE,
                   help="the page to rewrite, its plots in img/ beside it (default "
                        "docs/benchmarks.md; a copy for a trial run)")
    p.add_argument("-e", "--maxbytes", default="256M",
                   help="largest size (default 256M; smaller only for a trial run)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    a = p.parse_args(argv)
    variants = tuple(v for v in a.variants.split(",") if v)
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        p.error(f"--variants: unknown {', '.join(bad) or '(none given)'}; choose from "
                f"{', '.join(VARIANTS)}")
    if a.rounds < 1 or a.batch < 2 or a.busy < 1:
        p.error("--rounds must be >= 1, --batch >= 2 and --busy >= 1")
    from ringlet.bench.sweep import parse_size

    maxbytes = parse_size(a.maxbytes)
    trial = a.rounds < MIN_ROUNDS or maxbytes != MAXBYTES
    if trial and not a.dry_run and os.path.abspath(a.page) == os.path.abspath(PAGE):
        p.error(f"the page's tables need >= {MIN_ROUNDS} rounds up to 256M; fewer rounds or "
                "a smaller -e only for a trial run on a copy (--page)")
    return sweep([int(x) for x in a.ranks.split(",")], a.rounds, a.out, a.dry_run, variants,
                 a.batch, a.busy, maxbytes, a.page)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
