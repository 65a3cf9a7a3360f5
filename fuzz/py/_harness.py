"""What the Python fuzz harnesses share.

Each harness is a module with ``test_one_input(data: bytes)`` that feeds
``data`` to one parser and raises only when that parser broke its contract
(an exception other than its documented error, a hang, a wrong answer).
Run as a script it fuzzes with atheris, coverage-guided, taking libFuzzer's
arguments (``-max_total_time=45 CORPUS_DIR SEED_DIR``); the test suite
imports it and replays the seed corpus without atheris.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Callable

try:
    import atheris
except ImportError:  # replaying seeds needs no atheris
    atheris = None


def instrumented():
    """Context manager for the imports atheris should trace (a no-op without it)."""
    return atheris.instrument_imports() if atheris is not None else contextlib.nullcontext()


def main(test_one_input: Callable[[bytes], None]) -> None:
    if atheris is None:
        sys.exit("atheris is not installed: pip install atheris")
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


class Reader:
    """Draws small integers and byte strings from fuzz input (0 when exhausted)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def rest(self) -> bytes:
        return self.take(len(self.data))


def mutate_json(obj, r: Reader, steps: int = 3):
    """``obj`` (parsed JSON) with a few values swapped for odd ones that ``r`` picks.

    Structure-aware mutation: random bytes almost never parse as JSON, so the
    manifest and safetensors harnesses mostly fuzz the values in a valid
    document (wrong types, negative or huge numbers, missing keys).
    """
    odd = [None, True, -1, 0, 1, 2 ** 63, -(2 ** 63), 2 ** 64, 1.5, float("nan"), "", "x" * 70,
           "../../etc/passwd", [], [0], [-1, 5], {}, {"a": 1}, 63, 64, 4096]
    for _ in range(steps):
        # Walk down to a random container, then replace, drop or add one entry.
        node, depth = obj, 0
        while depth < 8:
            kids = (list(node.keys()) if isinstance(node, dict)
                    else list(range(len(node))) if isinstance(node, list) else [])
            if not kids:
                break
            k = kids[r.byte() % len(kids)]
            child = node[k]
            if not isinstance(child, (dict, list)) or not child or r.byte() % 3 == 0:
                action = r.byte() % 4
                if action == 0 and isinstance(node, dict):
                    del node[k]
                elif action == 1:
                    node[k] = copy.deepcopy(odd[r.byte() % len(odd)])
                elif action == 2 and isinstance(child, int) and not isinstance(child, bool):
                    node[k] = child + (r.byte() - 128)
                else:
                    node[k] = [child] if r.byte() & 1 else {"k": child}
                break
            node, depth = child, depth + 1
    return obj
