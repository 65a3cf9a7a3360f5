"""``ringlet bench model``: predicted times of flat and hierarchical collectives at scale.

Evaluates the alpha-beta model of ``ringlet._costmodel`` (formulas in
docs/algorithms.md, "The cost model") for 8 to 1,024 ranks on 1 to 128 hosts
and prints, per op, where the hierarchical form starts to win (the crossover
sizes) and the predicted speedup at the largest size.  Parameters come from
``--params`` (a JSON file of ``ModelParams`` fields, what ``--save`` writes), or
are fitted from ``ringlet bench limits --json`` files measured inside a host
(``--intra-limits``) and between two hosts (``--inter-limits``), else the
defaults.  Nothing is measured here.

Example::

    ringlet bench model --intra-limits limits.json --save model.json
    RINGLET_MODEL=model.json ringlet run -n 8 train.py
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import _costmodel as cm

__all__ = ["load_params", "crossovers", "model_table", "run_model"]

RANKS = [8, 16, 32, 64, 128, 256, 512, 1024]
HOSTS = [1, 2, 4, 8, 16, 32, 64, 128]


def _limits_of(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return doc.get("limits", doc) if isinstance(doc, dict) else {}


def load_params(params: Optional[str] = None, intra: Optional[str] = None,
                inter: Optional[str] = None) -> Tuple[cm.ModelParams, str]:
    """The parameters and a line saying where they came from."""
    if params:
        with open(params, encoding="utf-8") as f:
            doc = json.load(f)
        return cm.ModelParams.from_dict(doc.get("params", doc), params), f"from {params}"
    if intra or inter:
        m = cm.fit(_limits_of(intra) if intra else None, _limits_of(inter) if inter else None)
        src = ", ".join(f"{k} {v}" for k, v in (("intra-host figures", intra),
                                                ("inter-host figures", inter)) if v)
        return m, f"fitted from {src}" + ("" if inter else "; inter-host defaults")
    return cm.ModelParams(), "defaults (loopback TCP inside hosts, 1 Gbit/s between)"


def _sizes(lo: int, hi: int) -> List[int]:
    out, n = [], max(1, lo)
    while n <= hi:
        out.append(n)
        n *= 2
    return out


def crossovers(op: str, sizes: Sequence[int], layout: Sequence[int],
               m: cm.ModelParams) -> List[Tuple[int, str]]:
    """[(bytes, winner)] at the smallest size and wherever the faster form changes."""
    out: List[Tuple[int, str]] = []
    for n in sizes:
        p = cm.predict(op, n, layout, m)
        win = "hier" if p["hier"] < p["flat"] else "flat"
        if not out or out[-1][1] != win:
            out.append((n, win))
    return out


def _fmt_bytes(n: float) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g}{unit}"
    return f"{n:g}"


def _cell(cross: List[Tuple[int, str]], sizes: Sequence[int]) -> str:
    """"never", "all", ">=64K", or "4K..1M" (the smallest and largest size where
    hierarchical wins; "~" in front when flat wins somewhere in between)."""
    wins = []
    for i, n in enumerate(sizes):
        w = [x for x in cross if x[0] <= n][-1][1]
        if w == "hier":
            wins.append(i)
    if not wins:
        return "never"
    if len(wins) == len(sizes):
        return "all"
    gap = "~" if wins[-1] - wins[0] + 1 != len(wins) else ""
    if wins[-1] == len(sizes) - 1:
        return f"{gap}>={_fmt_bytes(sizes[wins[0]])}"
    return f"{gap}{_fmt_bytes(sizes[wins[0]])}..{_fmt_bytes(sizes[wins[-1]])}"


def model_table(m: cm.ModelParams, lo: int = 8, hi: int = 1 << 30,
                ops: Sequence[str] = cm.OPS) -> Dict[str, Any]:
    """Every (op, ranks, hosts) prediction: crossovers and the speedup at ``hi`` bytes."""
    sizes = _sizes(lo, hi)
    rows = []
    for op in ops:
        for p in RANKS:
            for h in HOSTS:
                if h > p or p % h:
                    continue
                layout = [p // h] * h
                big = cm.predict(op, hi, layout, m)
                rows.append({"op": op, "ranks": p, "hosts": h, "ranks_per_host": p // h,
                             "crossovers": crossovers(op, sizes, layout, m),
                             "flat_s": big["flat"], "hier_s": big["hier"],
                             "speedup": big["flat"] / big["hier"] if big["hier"] else None})
    return {"params": m.as_dict(), "min_bytes": lo, "max_bytes": hi, "rows": rows}


def format_model(table: Dict[str, Any], source: str) -> str:
    """Per op: a grid of ranks (rows) by hosts (columns) of where hierarchical wins."""
    hi = table["max_bytes"]
    pm = table["params"]

    def rate(b: float) -> float:
        return 1e-9 / b if b else float("inf")

    lines = [f"# ringlet bench model: parameters {source}",
             "# alpha_intra {:.3g} us, {:.3g} GB/s inside a host; alpha_inter {:.3g} us, "
             "{:.3g} GB/s per host link; reduction {:.3g} GB/s; phase {:.3g} us".format(
                 pm["alpha_intra"] * 1e6, rate(pm["beta_intra"]), pm["alpha_inter"] * 1e6,
                 rate(pm["beta_inter"]), rate(pm["gamma"]), pm.get("phase", 0.0) * 1e6),
             f"# cell: message sizes (bytes, K/M/G = 2^10/20/30) from which the hierarchical "
             f"form is predicted faster ('~': not at every size in that range), and "
             f"flat/hier time at {_fmt_bytes(hi)}; '-': one rank per host"]
    hosts = [h for h in HOSTS if h > 1]
    sizes = _sizes(table["min_bytes"], hi)
    by = {(r["op"], r["ranks"], r["hosts"]): r for r in table["rows"]}
    for op in dict.fromkeys(r["op"] for r in table["rows"]):
        lines += ["", f"## {op}",
                  f"{'ranks':>5} |" + "|".join(f"{f'{h} hosts':>15}" for h in hosts)]
        for p in RANKS:
            cells = []
            for h in hosts:
                r = by.get((op, p, h))
                if r is None:
                    cells.append(f"{'':>15}")
                elif p == h:
                    cells.append(f"{'-':>15}")
                else:
                    sp = r["speedup"]
                    x = f" x{sp:.2f}" if sp and sp != float("inf") else ""
                    cells.append(f"{_cell(r['crossovers'], sizes) + x:>15}")
            lines.append(f"{p:>5} |" + "|".join(cells))
    return "\n".join(lines)


def run_model(params: Optional[str], intra: Optional[str], inter: Optional[str],
              lo: int, hi: int, save: Optional[str], json_out: Optional[str]) -> str:
    """The ``ringlet bench model`` command; returns the text it prints."""
    m, source = load_params(params, intra, inter)
    table = model_table(m, lo, max(lo, hi))
    if save:
        with open(save, "w", encoding="utf-8") as f:
            json.dump({"params": m.as_dict(), "source": source}, f, indent=1)
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump({"tool": "ringlet bench model", "source": source, **table}, f, indent=1)
    return format_model(table, source)
