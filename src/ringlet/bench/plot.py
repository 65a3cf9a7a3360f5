"""``--plot FILE.png``: busbw and latency against size for every compared system."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

__all__ = ["plot", "PlotUnavailable", "require_matplotlib"]


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise ``PlotUnavailable`` (with the pip command) unless matplotlib imports.

    Called before measuring, so a missing extra never costs a finished run.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib "
                              "(or pip install 'ringlet[plot]')") from None


def plot(path: str, rows: Sequence[Dict[str, Any]], *, title: str = "",
         ceilings: Dict[str, float] = None) -> None:
    """Draw one row of two panels per op (busbw, time; log-log) into ``path``.

    Args:
        rows: aggregated rows of every system.
        ceilings: optional op -> busbw ceiling (GB/s), drawn as a dashed line.
    Raises:
        PlotUnavailable: matplotlib is missing (``pip install matplotlib``,
            or ``pip install ringlet[plot]``).
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["op"] != "barrier"]  # no size axis for a barrier
    if not rows:
        raise ValueError("--plot: nothing to plot (a barrier has no size axis)")
    ops: List[str] = []
    systems: List[str] = []
    for r in rows:
        if r["op"] not in ops:
            ops.append(r["op"])
        if r["system"] not in systems:
            systems.append(r["system"])
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.6 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        ax_bw, ax_t = axes[i]
        for s in systems:
            pts = sorted((r["size"], r["busbw"], r["time_us"]) for r in rows
                         if r["op"] == op and r["system"] == s)
            if not pts:
                continue
            xs = [max(p[0], 1) for p in pts]
            ax_bw.plot(xs, [p[1] for p in pts], marker="o", ms=3, label=s)
            ax_t.plot(xs, [p[2] for p in pts], marker="o", ms=3, label=s)
        if ceilings and op in ceilings:
            ax_bw.axhline(ceilings[op], ls="--", color="grey", lw=1, label="TCP ceiling")
        nr = next((r["nranks"] for r in rows if r["op"] == op), "?")
        ax_bw.set_title(f"{op}, {nr} ranks: bus bandwidth")
        ax_t.set_title(f"{op}, {nr} ranks: time (median)")
        for ax in (ax_bw, ax_t):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size (bytes)")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
        ax_bw.set_ylabel("busbw (GB/s)")
        ax_t.set_ylabel("time (us)")
        ax_bw.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.6 * len(ops))))
    fig.savefig(path, dpi=110)
    plt.close(fig)
