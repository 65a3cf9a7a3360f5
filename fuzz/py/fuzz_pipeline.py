"""Fuzz the pipeline's header parsers (``ringlet.parallel.pipeline._wire``).

A pipeline channel opens with a 128-byte declaration (magic, kind, step,
stage, dtype, ndim, dims) and every microbatch travels as a frame with a
128-byte header.  Contract: ``_parse_declaration`` and ``_parse_frame``
never raise on any 128 bytes (a malformed header comes back with ``error``
set); a declaration accepted as data names a dtype and a shape whose byte
count is exact (no int64 wrap-around) and small enough to allocate, since
the receiver allocates that many bytes for each frame.

Input: step u8 | stage u8 | microbatch u8 | 128 header bytes (zero padded).
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import instrumented, main  # noqa: E402

with instrumented():
    from ringlet.parallel.pipeline import _wire as rt

import numpy as np  # noqa: E402

MAX_FRAME_BYTES = 1 << 40  # the C core's ceiling on one frame's payload


def test_one_input(data: bytes) -> None:
    if len(data) < 3:
        return
    step, stage, mb = data[0], data[1], data[2]
    raw = (data[3:3 + rt._HDR_BYTES]).ljust(rt._HDR_BYTES, b"\0")
    h = np.frombuffer(raw, np.int64)
    decl = rt._parse_declaration(h, step, stage, "fuzz")
    if decl.kind == rt._KIND_DATA:
        exact = math.prod(decl.shape) * decl.dtype.itemsize
        if decl.nbytes != exact or not 0 <= exact <= MAX_FRAME_BYTES:
            raise AssertionError(f"declaration accepted with shape {decl.shape} of "
                                 f"{decl.dtype}: {decl.nbytes} bytes (exactly {exact})")
    elif decl.kind == rt._KIND_POISON:
        assert decl.error is None
    else:
        assert decl.kind == 0 and decl.error, decl
    buf = np.frombuffer(raw + data[3 + rt._HDR_BYTES:], np.uint8)
    kind, origin, error = rt._parse_frame(buf, step, stage, mb, "fuzz")
    assert (kind == 0) == (error is not None), (kind, error)


if __name__ == "__main__":
    main(test_one_input)
