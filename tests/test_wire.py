"""The wire layer is one: one dtype registry that agrees with the C core."""

import os
import re

import numpy as np
import pytest

from ringlet import _core, _dtypes
from ringlet.checkpoint import format as ckpt_format
from ringlet.parallel.pipeline import _wire as pp_runtime
from ringlet.rpc import serialization as rpc_ser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def _header_enum(name):
    """{enumerator: value} of ``typedef enum {...} name;`` in csrc/ringlet.h."""
    m = re.search(r"typedef enum \{([^}]*)\}\s*" + name + r"\s*;", _read("csrc/ringlet.h"))
    assert m, f"enum {name} not found in csrc/ringlet.h"
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    return {k: int(v) for k, v in re.findall(r"(RL_\w+)\s*=\s*(\d+)", body)}


def test_registry_matches_ringlet_h():
    enum = _header_enum("rl_dtype")
    ndtypes = enum.pop("RL_NDTYPES")
    core = {e.c_name: e.core for e in _dtypes.REGISTRY if e.c_name is not None}
    assert core == enum, f"registry {core} != csrc/ringlet.h {enum}"
    assert sorted(enum.values()) == list(range(ndtypes))
    assert len(_dtypes.CORE_NAMES) == ndtypes


def test_registry_names_match_kernels_c():
    # rl_dtype_name (flight records, C error messages) says the numpy name.
    names = dict(re.findall(r"case (RL_\w+):\s*return \"(\w+)\";", _read("csrc/kernels.c")))
    for e in _dtypes.REGISTRY:
        if e.c_name is not None:
            assert names.get(e.c_name) == e.name, (e.c_name, names.get(e.c_name), e.name)


def test_reduce_ops_match_ringlet_h():
    enum = _header_enum("rl_redop")
    enum.pop("RL_NOPS")
    assert {f"RL_{op.name}": int(op) for op in _dtypes.ReduceOp} == enum


@pytest.mark.parametrize("name", _dtypes.CORE_NAMES)
def test_binding_maps_every_core_dtype_to_its_code(name):
    # _core maps numpy's built-in types itself, by type number; the registry
    # handles the rest (bfloat16).  Both must give the header's code.
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(name)
    want = _dtypes.CORE_NAMES.index(name)
    assert _core.array_code(np.zeros(3, dt), "x", False, _dtypes.dtype_code) == want
    assert _dtypes.dtype_code(dt) == want
    assert pp_runtime._dtype_code(dt) == want
    assert pp_runtime._dtype_of(want) == dt


def test_other_tables_are_the_registry():
    assert pp_runtime._DTYPES is _dtypes.CORE_NAMES
    assert rpc_ser.ALLOWED_DTYPES is _dtypes.CODEC_DTYPES
    assert ckpt_format._ST_CODES is _dtypes.SAFETENSORS_CODES
    # Every core dtype is storable; every codec dtype is a real numpy dtype.
    assert set(_dtypes.CORE_NAMES) <= set(_dtypes.SAFETENSORS_CODES)
    for s in _dtypes.CODEC_DTYPES:
        assert np.dtype(s).kind in "biufc"


def test_unsupported_dtype_named_everywhere():
    with pytest.raises(TypeError, match="complex64"):
        _dtypes.dtype_code(np.dtype(np.complex64))
    with pytest.raises(TypeError, match="complex64"):
        pp_runtime._dtype_code(np.dtype(np.complex64))
    with pytest.raises(TypeError, match="complex64"):
        ckpt_format.dtype_name(np.complex64, "w")


# ---- one handshake: docs/security.md "The handshake", checked on both sides ----------
# A reference implementation written from the spec alone (not from _auth or
# transport.c): the C core and ringlet._auth must both interoperate with it.
import hashlib  # noqa: E402
import hmac  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from ringlet import _auth, errors as _errors  # noqa: E402

DEADLINE_S = 30.0  # generous: the machine may be oversubscribed


def _mac(key, label, bound, nonce_r):
    return hmac.new(key, label + bound + nonce_r, hashlib.sha256).digest()


def _recv(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return buf
        buf += chunk
    return buf


# The data profile (C core): K = SHA-256(secret); the HELLO is bound verbatim.
def _data_hello(job_id, comm_id, src, dst, nonce_i):
    return struct.pack("<4sHH16sIII32s", b"RLTH", 1, 1, job_id, comm_id, src, dst, nonce_i)


def _data_bound(hello):
    return hello


# The service profile (_auth): K = the channel's key; bound = len16 purpose |
# purpose | len16 claim | claim | nonce_i.
def _service_hello(claim, nonce_i):
    return struct.pack("!4sHH64s32s", b"RLH1", 1, len(claim), claim.ljust(64, b"\0"), nonce_i)


def _service_bound(purpose, claim, nonce_i):
    return (struct.pack("!H", len(purpose)) + purpose + struct.pack("!H", len(claim)) + claim
            + nonce_i)


def _status(sock):
    raw = _recv(sock, 4)
    assert len(raw) == 4, raw
    return raw


def _ctx(rank, size, secret, job_id):
    return _core.Context(rank, size, "127.0.0.1", secret, job_id)


def test_c_acceptor_follows_the_spec():
    secret, job_id = os.urandom(32), os.urandom(16)
    key = hashlib.sha256(secret).digest()
    ctx = _ctx(1, 2, secret, job_id)
    try:
        def initiate(hello_job, proof_key):
            s = socket.create_connection(("127.0.0.1", ctx.port), timeout=DEADLINE_S)
            try:
                hello = _data_hello(hello_job, 5, 0, 1, os.urandom(32))
                s.sendall(hello)
                reply = _recv(s, 64)
                if len(reply) < 64:
                    return "refused", reply
                nonce_r, mac_r = reply[:32], reply[32:]
                assert hmac.compare_digest(mac_r, _mac(key, b"ringlet/acc", _data_bound(hello),
                                                       nonce_r)), "C acceptor's proof"
                s.sendall(_mac(proof_key, b"ringlet/con", _data_bound(hello), nonce_r))
                return "status", _status(s)
            finally:
                s.close()

        ok = (0).to_bytes(4, "little")
        assert initiate(job_id, key) == ("status", ok)
        rejected = ctx.rejected()
        assert initiate(job_id, hashlib.sha256(b"other").digest()) == \
            ("status", (1).to_bytes(4, "little"))
        assert initiate(os.urandom(16), key) == ("refused", (3).to_bytes(4, "little"))
        deadline = time.monotonic() + DEADLINE_S
        while ctx.rejected() < rejected + 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the listener counts after replying; bounded wait on its counter
        assert ctx.rejected() == rejected + 2
    finally:
        ctx.close()


def _respond(listener, key, label_r, label_i, parse, out):
    """Responder half of the spec, run on a thread: record what the initiator proved."""
    conn, _ = listener.accept()
    conn.settimeout(DEADLINE_S)
    try:
        hello = _recv(conn, parse[0])
        bound = parse[1](hello)
        nonce_r = os.urandom(32)
        conn.sendall(nonce_r + _mac(key, label_r, bound, nonce_r))
        proof = _recv(conn, 32)
        out["hello"] = hello
        out["proof_ok"] = hmac.compare_digest(proof, _mac(key, label_i, bound, nonce_r))
        if out.get("die_before_verdict"):
            return
        conn.sendall((0).to_bytes(4, out.get("order", "little")))
        _recv(conn, 1)  # until the initiator closes
    finally:
        conn.close()


def _listener():
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    ls.settimeout(DEADLINE_S)
    return ls


def _c_connector_against(out):
    """Connect a C comm to the Python responder (told by ``out``); the
    exception its connect raised, or None, once the responder is done."""
    secret, job_id = os.urandom(32), os.urandom(16)
    key = hashlib.sha256(secret).digest()
    ls = _listener()
    t = threading.Thread(target=_respond, args=(ls, key, b"ringlet/acc", b"ringlet/con",
                                                (68, _data_bound), out))
    t.start()
    ctx = _ctx(0, 2, secret, job_id)
    err = None
    try:
        ctx.set_peer(1, "127.0.0.1", ls.getsockname()[1])
        comm = _core.Comm(ctx, 9, 0, [0, 1])
        try:
            comm.connect(1, int(DEADLINE_S * 1000))
        except Exception as exc:  # noqa: BLE001 - the caller judges it
            err = exc
        comm.close()
    finally:
        ctx.close()
        t.join(DEADLINE_S)
        ls.close()
    assert not t.is_alive()
    return err, job_id


def test_c_connector_follows_the_spec():
    out = {}
    err, job_id = _c_connector_against(out)
    assert err is None, err
    magic, version, kind, job, comm_id, src, dst = struct.unpack("<4sHH16sIII", out["hello"][:36])
    assert (magic, version, kind, job, comm_id, src, dst) == (b"RLTH", 1, 1, job_id, 9, 0, 1)
    assert out["proof_ok"], "the C connector's proof does not follow the spec"


def test_an_acceptor_gone_before_its_verdict_is_a_closed_peer_not_a_bad_secret():
    # A rank killed between proving the secret and answering our proof: the
    # secrets matched, so the error must say the peer went, not "secret mismatch".
    out = {"die_before_verdict": True}
    err, _job_id = _c_connector_against(out)
    assert out["proof_ok"]
    assert isinstance(err, _errors.PeerClosedError), repr(err)
    msg = str(err)
    assert "peer 1" in msg and "verdict" in msg and "exited or was killed" in msg, msg
    assert "mismatch" not in msg, msg


def test_python_client_follows_the_spec():
    key, purpose, claim = os.urandom(32), b"store", b"rank 3"
    ls, out = _listener(), {"order": "big"}
    t = threading.Thread(target=_respond, args=(
        ls, key, b"ringlet/server/", b"ringlet/client/",
        (104, lambda h: _service_bound(purpose, h[8:8 + struct.unpack("!H", h[6:8])[0]],
                                       h[72:104])), out))
    t.start()
    try:
        with socket.create_connection(ls.getsockname()) as s:
            assert _auth.client_handshake(s, key, purpose, claim=claim,
                                          deadline=time.monotonic() + DEADLINE_S) == claim
    finally:
        t.join(DEADLINE_S)
        ls.close()
    assert out["hello"][:8] == b"RLH1" + struct.pack("!HH", 1, len(claim))
    assert out["proof_ok"], "_auth's client proof does not follow the spec"


def test_python_server_follows_the_spec():
    key, purpose, claim = os.urandom(32), b"ringlet-rpc", b"7"
    ls = _listener()
    got = {}

    def serve():
        conn, _ = ls.accept()
        with conn:
            got["claim"] = _auth.server_handshake(conn, key, purpose,
                                                  deadline=time.monotonic() + DEADLINE_S)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with socket.create_connection(ls.getsockname(), timeout=DEADLINE_S) as s:
            nonce_i = os.urandom(32)
            s.sendall(_service_hello(claim, nonce_i))
            reply = _recv(s, 64)
            bound = _service_bound(purpose, claim, nonce_i)
            nonce_r = reply[:32]
            assert hmac.compare_digest(reply[32:], _mac(key, b"ringlet/server/", bound, nonce_r))
            s.sendall(_mac(key, b"ringlet/client/", bound, nonce_r))
            assert _status(s) == (0).to_bytes(4, "big")
    finally:
        t.join(DEADLINE_S)
        ls.close()
    assert got["claim"] == claim



# ---- the stream and the codec hold a large payload once ------------------------------
import signal  # noqa: E402
import tracemalloc  # noqa: E402

from ringlet._wire import codec as _codec, stream as _stream  # noqa: E402


def _tcp_pair():
    with socket.create_server(("127.0.0.1", 0)) as ls:
        a = socket.create_connection(ls.getsockname(), timeout=DEADLINE_S)
        b, _ = ls.accept()
    return a, b


def _send_later(sock, parts, *, gap=0.0, between=None, close=False):
    """Thread: send ``parts`` with ``gap`` s between them, calling ``between()`` in each gap."""
    def run():
        try:
            for i, part in enumerate(parts):
                if i:
                    time.sleep(gap)
                    if between is not None:
                        between()
                    time.sleep(gap)
                sock.sendall(part)
            if close:
                sock.close()
        except OSError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _peak_above_start(fn):
    """(fn's result, the most memory Python held during fn above what it held before)."""
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    out = fn()
    return out, tracemalloc.get_traced_memory()[1] - base


def test_recv_exact_holds_a_large_payload_once():
    # Received straight into the bytes object returned; a bytearray that was
    # then copied into bytes held the payload twice.
    n = 16 << 20
    payload = os.urandom(n)
    parts = [payload[i:i + (1 << 20)] for i in range(0, n, 1 << 20)]
    a, b = _tcp_pair()
    with a, b:
        t = _send_later(b, parts)
        tracemalloc.start()
        try:
            got, peak = _peak_above_start(
                lambda: _stream.recv_exact(a, n, time.monotonic() + DEADLINE_S))
        finally:
            tracemalloc.stop()
        t.join(DEADLINE_S)
    assert type(got) is bytes and got == payload
    assert peak < 1.5 * n, f"recv_exact held {peak / n:.2f}x the payload"


def test_recv_exact_keeps_its_deadline_and_reports_eof():
    n = 1 << 20
    a, b = _tcp_pair()
    with a, b:
        b.sendall(bytes(n // 2))  # then silence
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):
            _stream.recv_exact(a, n, t0 + 0.5)
        took = time.monotonic() - t0
        assert 0.45 <= took < 10, took
    a, b = _tcp_pair()
    with a:
        b.sendall(bytes(100_000))
        b.close()
        with pytest.raises(_stream.ShortRead) as info:
            _stream.recv_exact(a, n, time.monotonic() + DEADLINE_S)
        assert (info.value.got, info.value.n) == (100_000, n)
    a, b = _tcp_pair()
    with a:
        b.close()
        with pytest.raises(_stream.ShortRead) as info:
            _stream.recv_exact(a, n, time.monotonic() + DEADLINE_S)
        assert info.value.got == 0


def test_recv_exact_finishes_a_payload_a_signal_cut():
    # A signal whose handler returns ends the in-place receive part way; the
    # rest must still be read, not reported as EOF.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread only")
    n = 4 << 20
    payload = os.urandom(n)
    hits = []
    main = threading.main_thread().ident
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    a, b = _tcp_pair()
    try:
        with a, b:
            t = _send_later(b, [payload[:n // 2], payload[n // 2:]], gap=0.2,
                            between=lambda: signal.pthread_kill(main, signal.SIGUSR1))
            got = _stream.recv_exact(a, n, time.monotonic() + DEADLINE_S)
            t.join(DEADLINE_S)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert hits == [1]
    assert got == payload


def test_codec_copies_large_bytes_once():
    # dumps: each out-of-band buffer joined as it is (it was copied, then
    # joined); loads: meta read where it lies, bytes sliced out once (they
    # went through a bytearray, then were copied).
    n = 16 << 20
    value = {"blob": os.urandom(n), "step": 3}
    tracemalloc.start()
    try:
        frame, dumps_peak = _peak_above_start(lambda: _codec.dumps(value))
        out, loads_peak = _peak_above_start(lambda: _codec.loads(frame))
    finally:
        tracemalloc.stop()
    assert out == value
    assert dumps_peak < 1.5 * n, f"dumps held {dumps_peak / n:.2f}x the value"
    assert loads_peak < 1.5 * n, f"loads held {loads_peak / n:.2f}x the value"


def test_decode_payload_reads_out_of_band_bytes_with_read_bytes():
    value = {"blob": os.urandom(1 << 20), "a": np.arange(50_000, dtype=np.int32), "s": "x"}
    frame = _codec.dumps(value)
    a, b = _tcp_pair()
    with a, b:
        b.sendall(frame)
        deadline = time.monotonic() + DEADLINE_S
        header = _codec.parse_header(_stream.recv_exact(a, _codec.HEADER_SIZE, deadline))
        calls = []

        def read_bytes(k):
            calls.append(k)
            return _stream.recv_exact(a, k, deadline)

        out = _codec.decode_payload(
            header, lambda mv: _stream.recv_exact_into(a, mv, deadline), read_bytes=read_bytes)
    assert calls == [1 << 20]
    assert out["blob"] == value["blob"] and out["s"] == "x"
    assert np.array_equal(out["a"], value["a"])
    # Out-of-band bytes longer than what the frame still carries are refused
    # before anything is read for them.
    bad = bytearray(_codec.dumps(b"x" * (1 << 17))[:-1])
    struct.pack_into("<Q", bad, 24, len(bad) - _codec.HEADER_SIZE)  # the header's payload_len
    with pytest.raises(_errors.ProtocolError, match="out-of-band bytes left"):
        _codec.loads(bad)
