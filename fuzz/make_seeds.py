"""Write the seed corpora of fuzz/corpus/ (run from the repository root).

Each seed is a small valid (or nearly valid) input, so the fuzzers start
past the magic numbers and lengths.  The frame seeds are recorded from real
traffic instead: ``cc -DFRAME_MAKE_SEEDS ... fuzz/c/frame.c`` (see
fuzz/run.sh).  Re-running this rewrites the files it owns; the fuzzers'
own finds go to a scratch directory, never here.

Usage: PYTHONPATH=src python fuzz/make_seeds.py
"""

from __future__ import annotations

import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "py"))


def _write(harness: str, seeds: dict) -> None:
    d = os.path.join(HERE, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


def handshake() -> dict:
    job = bytes(range(1, 17))  # fuzz/c/handshake.c's job id

    def hello(src=0, dst=1, comm=7, magic=0x48544C52, ver=1, kind=1, jid=job):
        return struct.pack("<IHH16sIII32s", magic, ver, kind, jid, comm, src, dst, b"\x11" * 32)

    return {
        "good_proof": b"\x01" + hello(),
        "good_proof_split": b"\x05" + hello(src=2, comm=9),
        "bad_proof": b"\x00" + hello(src=3) + b"\x00" * 32,
        "short_proof": b"\x00" + hello() + b"\x01" * 5,
        "wrong_job": b"\x00" + hello(jid=b"\x00" * 16),
        "wrong_job_fixed": b"\x03" + hello(jid=b"\x00" * 16, src=3),
        "wrong_dst": b"\x01" + hello(dst=2),
        "self_src": b"\x01" + hello(src=1),
        "src_out_of_range": b"\x01" + hello(src=4),
        "bad_magic": b"\x01" + hello(magic=0x31544C52),
        "bad_version": b"\x01" + hello(ver=2),
        "bad_kind": b"\x01" + hello(kind=0),
        "short_hello": b"\x00" + hello()[:30],
        "empty": b"\x00",
        "good_then_garbage": b"\x01" + hello(comm=11) + b"GET / HTTP/1.1\r\n\r\n",
    }


def rpc_codec() -> dict:
    from ringlet.rpc import serialization as ser

    values = {
        "none": None, "int": -5, "bigint": 2 ** 80, "float": 1.5, "str": "héllo",
        "bytes": b"\x00\x01", "list": [1, "a", None], "tuple": (1, 2.0), "dict": {"k": [1, {2: 3}]},
        "array": np.arange(6, dtype=np.float32).reshape(2, 3), "scalar": np.int64(7),
        "complex": 1 + 2j, "nested": [[[[1]]]], "bool": [True, False],
        "big_array": np.zeros(20000, np.uint8),  # out-of-band
    }
    return {k: ser.dumps(v) for k, v in values.items()}


def store() -> dict:
    from ringlet import _auth
    from ringlet.store import protocol as st

    def req(op, key=b"", value=b"", tmo=0):
        return struct.pack("!BIQQ", op, len(key), len(value), tmo) + key + value

    keys = st.encode_keys([b"a", b"b"])
    return {
        "hello_only": b"\x00" + _auth.encode_hello(b"", b"\x22" * 32),
        "garbage_preauth": b"\x00GET / HTTP/1.1\r\n\r\n",
        "set_get": b"\x01" + req(st.OP_SET, b"a", b"1") + req(st.OP_GET, b"a"),
        "get_timeout": b"\x01" + req(st.OP_GET, b"missing", tmo=0),
        "add": b"\x01" + req(st.OP_ADD, b"n", struct.pack("!q", 5)) + req(st.OP_ADD, b"a", b"x"),
        "check_delete": b"\x01" + req(st.OP_CHECK, b"a") + req(st.OP_DELETE, b"a"),
        "wait": b"\x01" + req(st.OP_WAIT, value=keys, tmo=0),
        "info": b"\x01" + req(st.OP_INFO),
        "will": b"\x01" + req(st.OP_WILL, b"gone", b"lost") + req(st.OP_WILL, b"", b"x"),
        "unknown_op": b"\x01" + req(99, b"a"),
        "parked_get": b"\x01" + req(st.OP_GET, b"never", tmo=60000),
    }


def pipeline() -> dict:
    from ringlet.pipeline import runtime as rt

    decl = rt._declaration(3, 1, (4, 5), np.dtype(np.float32)).tobytes()
    frame = rt._frame(3, 1, 2, np.ones((4, 5), np.float32), 80).tobytes()
    return {
        "declaration": bytes([3, 1, 2]) + decl,
        "poison_declaration": bytes([3, 1, 2]) + rt._poison_declaration(3, 1, 0).tobytes(),
        "frame": bytes([3, 1, 2]) + frame,
        "poison_frame": bytes([3, 1, 2]) + rt._frame(3, 1, 2, None, 0, origin=1).tobytes(),
        "wrong_step": bytes([4, 1, 2]) + decl,
    }


def checkpoint() -> dict:
    import fuzz_checkpoint as fc

    fc._setup()
    try:
        return {"manifest_as_is": b"\x00" + fc._manifest,
                "manifest_mut": b"\x01" + bytes(range(0, 64, 3)),
                "manifest_mut2": b"\x01\x05\x07\x01\x09\x02\x01",
                "shard_head": b"\x02" + fc._shard[:64],
                "shard_header_mut": b"\x03\x01\x02\x03\x04\x05\x06",
                "shard_header_mut2": b"\x03\x00\x00\x00\x01\x07"}
    finally:
        fc.cleanup()


if __name__ == "__main__":
    for name, make in (("handshake", handshake), ("rpc_codec", rpc_codec), ("store", store),
                       ("pipeline", pipeline), ("checkpoint", checkpoint)):
        seeds = make()
        _write(name, seeds)
        print(f"{name}: {len(seeds)} seeds")
