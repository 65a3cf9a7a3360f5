"""``split_model``: cut a ``Sequential`` into contiguous pipeline stages."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["split_model"]


def _layer_weight(layer: Any) -> int:
    params = getattr(layer, "parameters", None)
    return sum(int(p.size) for p in params()) if callable(params) else 0


def _balance_by_weight(weights: Sequence[int], k: int) -> List[int]:
    """Layer counts per stage: minimise the heaviest stage, then even things out.

    Step 1 finds the smallest achievable maximum stage weight M (min-max
    partition, dynamic programming over prefixes).  Step 2, among the
    partitions whose stages all weigh <= M, picks the one minimising, in this
    order: the sum of squared stage weights (spread the rest evenly), the
    number of stages that start with a parameterless layer (an activation
    stays with the layer before it), and the sum of squared layer counts.
    """
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def seg(i: int, j: int) -> int:  # weight of layers i..j-1
        return prefix[j] - prefix[i]

    inf = float("inf")
    # best_max[j][i]: smallest max weight splitting the first i layers into j stages
    best_max = [[inf] * (n + 1) for _ in range(k + 1)]
    best_max[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            best_max[j][i] = min(max(best_max[j - 1][c], seg(c, i)) for c in range(j - 1, i))
    limit = best_max[k][n]

    # cost[j][i]: best (sum sq weight, bad starts, sum sq count) with every stage <= limit
    cost: List[List[Optional[Tuple[int, int, int]]]] = [[None] * (n + 1) for _ in range(k + 1)]
    back = [[-1] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = (0, 0, 0)
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for c in range(j - 1, i):
                prev = cost[j - 1][c]
                w = seg(c, i)
                if prev is None or w > limit:
                    continue
                cand = (prev[0] + w * w, prev[1] + (1 if weights[c] == 0 and c > 0 else 0),
                        prev[2] + (i - c) ** 2)
                if cost[j][i] is None or cand < cost[j][i]:
                    cost[j][i], back[j][i] = cand, c
    counts = []
    i = n
    for j in range(k, 0, -1):
        c = back[j][i]
        counts.append(i - c)
        i = c
    return counts[::-1]


def split_model(sequential: Any, n_stages: int, balance: Optional[Sequence[int]] = None
                ) -> List[Any]:
    """Cut ``sequential`` into ``n_stages`` contiguous ``Sequential`` slices.

    The slices hold the original layer objects (nothing is copied), so on
    each rank keep only the slice(s) it runs.

    Args:
        sequential: a ``ringlet.nn.Sequential``.
        n_stages: number of slices (1 .. number of layers).
        balance: layers per stage, e.g. ``[3, 2, 2]`` (sum = number of layers,
            each >= 1).  Default: balance the parameter count: minimise the
            largest stage's parameter count, then spread the rest evenly,
            keeping parameterless layers (activations) with the layer before.
    Returns:
        List of ``n_stages`` ``ringlet.nn.Sequential``.
    Raises:
        TypeError: ``sequential`` is not a Sequential; bad types.
        ValueError: too many stages, or a bad ``balance``.

    Example::

        model = Sequential(Linear(8, 32), Tanh(), Linear(32, 32), Tanh(), Linear(32, 1))
        stages = split_model(model, 2)            # by parameter count
        stages = split_model(model, 2, [2, 3])    # by hand
    """
    from ringlet.nn import Sequential

    if not isinstance(sequential, Sequential):
        raise TypeError(f"split_model needs a ringlet.nn.Sequential, got "
                        f"{type(sequential).__name__}")
    if isinstance(n_stages, bool) or not isinstance(n_stages, (int, np.integer)):
        raise TypeError(f"n_stages must be an int, got {type(n_stages).__name__}")
    layers = list(sequential)
    n = len(layers)
    if not 1 <= n_stages <= n:
        raise ValueError(f"n_stages must be in [1, {n}] for a Sequential of {n} layers, got "
                         f"{n_stages}")
    if balance is None:
        counts = _balance_by_weight([_layer_weight(m) for m in layers], int(n_stages))
    else:
        try:
            counts = list(balance)
        except TypeError:
            raise TypeError(f"balance must be a sequence of ints, got "
                            f"{type(balance).__name__}") from None
        if any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) for c in counts):
            raise TypeError(f"balance must contain ints, got {counts!r}")
        counts = [int(c) for c in counts]
        if len(counts) != n_stages:
            raise ValueError(f"balance has {len(counts)} entries for {n_stages} stages")
        if any(c < 1 for c in counts):
            raise ValueError(f"every stage needs at least one layer, balance={counts}")
        if sum(counts) != n:
            raise ValueError(f"balance={counts} covers {sum(counts)} layers, the model has {n}")
    out, start = [], 0
    for c in counts:
        out.append(Sequential(*layers[start:start + c]))
        start += c
    return out
