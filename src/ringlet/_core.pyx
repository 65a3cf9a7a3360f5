# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin binding of the C core (csrc/ringlet.h).

Each method takes numpy arrays, checks that C may write/read them, calls the
C function with the GIL released, and turns a failed status into exactly one
Python exception (``_raise``).  Argument policy (dtype mapping, sizes, which
group, async execution) lives in the Python modules; what is checked here is
only what keeps C memory-safe.
"""
cimport cython
cimport numpy as cnp
from cpython.exc cimport PyErr_Occurred
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from ringlet._core cimport *

cdef extern from "Python.h":
    # Declared without an exception value on purpose: the hook must leave the
    # signal handler's exception (KeyboardInterrupt) set for _check to re-raise,
    # not have Cython report and clear it inside a noexcept function.
    int _check_signals_raw "PyErr_CheckSignals" ()

cdef extern from *:
    # Set by setup.py (-DRL_BUILD_FLAGS=...) and by the compiler.
    const char *RL_BUILD_FLAGS
    const char *RL_COMPILER_VERSION "__VERSION__"

import operator as _operator
import os as _os

import numpy as _np

from ringlet import errors as _errors

cnp.import_array()

PROTOCOL_VERSION = RL_PROTOCOL_VERSION

# status -> exception class; the single place where C failures become Python ones
_STATUS_CLASS = {
    RL_ERR_INVALID: ValueError,
    RL_ERR_SYSTEM: _errors.RingletError,
    RL_ERR_TIMEOUT: _errors.CollectiveTimeout,
    RL_ERR_PEER_CLOSED: _errors.PeerClosedError,
    RL_ERR_DESYNC: _errors.DesyncError,
    RL_ERR_AUTH: _errors.AuthenticationError,
    RL_ERR_PROTOCOL: _errors.ProtocolError,
    RL_ERR_POISONED: _errors.GroupPoisonedError,
    RL_ERR_NOMEM: _errors.OutOfMemoryError,  # also a MemoryError
    RL_ERR_ABORTED: _errors.RingletError,
}

STATUS = {
    "OK": RL_OK, "INVALID": RL_ERR_INVALID, "SYSTEM": RL_ERR_SYSTEM, "TIMEOUT": RL_ERR_TIMEOUT,
    "PEER_CLOSED": RL_ERR_PEER_CLOSED, "DESYNC": RL_ERR_DESYNC, "AUTH": RL_ERR_AUTH,
    "PROTOCOL": RL_ERR_PROTOCOL, "POISONED": RL_ERR_POISONED,
    "INTERRUPTED": RL_ERR_INTERRUPTED, "NOMEM": RL_ERR_NOMEM, "ABORTED": RL_ERR_ABORTED,
}


def exception_class(int status):
    """The exception class ringlet raises for a C status code."""
    return _STATUS_CLASS.get(status, _errors.RingletError)


cdef int _interrupt_hook() noexcept nogil:
    # Called by C about every 100 ms while blocked.  In the main thread this
    # runs Python signal handlers; a handler that raises (Ctrl-C) leaves its
    # exception set and makes C return RL_ERR_INTERRUPTED, which _check then
    # re-raises.  Other threads never see signals, so this is cheap there.
    with gil:
        return 1 if _check_signals_raw() != 0 else 0


rl_set_interrupt_hook(_interrupt_hook)


cdef inline void *_wptr(cnp.ndarray a, str what) except NULL:
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(f"{what} must be C-contiguous (use numpy.ascontiguousarray)")
    if not cnp.PyArray_ISWRITEABLE(a):
        raise ValueError(f"{what} is read-only; ringlet writes the result into it")
    cdef void *p = cnp.PyArray_DATA(a)
    return p if p != NULL else <void *>a  # any non-NULL for empty arrays


cdef inline const void *_rptr(cnp.ndarray a, str what) except NULL:
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(f"{what} must be C-contiguous (use numpy.ascontiguousarray)")
    cdef void *p = cnp.PyArray_DATA(a)
    return p if p != NULL else <void *>a


def check_array(x, str what, bint writable):
    """Return ``x`` if C may read it (and write it, with ``writable``); else raise.

    The same checks the collectives make before touching memory, callable up
    front so an asynchronous call fails at the call site.  Done here because
    reading numpy's flags from Python costs more than the whole C call.
    """
    if not isinstance(x, cnp.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray, got {type(x).__name__}")
    if writable:
        _wptr(<cnp.ndarray>x, what)
    else:
        _rptr(<cnp.ndarray>x, what)
    return x


cdef int _native_code(cnp.ndarray x):
    # The core's rl_dtype when x holds one of numpy's built-in types that the
    # core supports, in native byte order; else -1.  By type number and item
    # size: int64 is NPY_LONG on some platforms, NPY_LONGLONG on others.
    if not cnp.PyArray_ISNOTSWAPPED(x):
        return -1  # byte-swapped data would be reduced as garbage
    cdef int t = cnp.PyArray_TYPE(x)
    cdef Py_ssize_t n = cnp.PyArray_ITEMSIZE(x)
    if t == cnp.NPY_FLOAT:
        return RL_F32
    if t == cnp.NPY_DOUBLE:
        return RL_F64
    if t == cnp.NPY_INT or t == cnp.NPY_LONG or t == cnp.NPY_LONGLONG:
        return RL_I32 if n == 4 else (RL_I64 if n == 8 else -1)
    if t == cnp.NPY_UINT or t == cnp.NPY_ULONG or t == cnp.NPY_ULONGLONG:
        return RL_U32 if n == 4 else (RL_U64 if n == 8 else -1)
    if t == cnp.NPY_SHORT:
        return RL_I16 if n == 2 else -1
    if t == cnp.NPY_USHORT:
        return RL_U16 if n == 2 else -1
    if t == cnp.NPY_FLOAT16:
        return RL_F16
    if t == cnp.NPY_BYTE:
        return RL_I8
    if t == cnp.NPY_UBYTE:
        return RL_U8
    if t == cnp.NPY_BOOL:
        return RL_BOOL
    return -1


def array_code(x, str what, bint writable, fallback):
    """``check_array``, then the C dtype code of ``x``.

    Built-in numpy types are mapped here, in one call; any other dtype
    (ml_dtypes' bfloat16, unsupported or byte-swapped ones) goes to
    ``fallback(x.dtype, what)``, which returns a code or raises.
    """
    check_array(x, what, writable)
    cdef int code = _native_code(<cnp.ndarray>x)
    return code if code >= 0 else fallback(x.dtype, what)


cdef size_t _count_table(counts, int P, size_t *cnt, size_t *displ) except *:
    # A v-collective's count list as C arrays: cnt[i] = counts[i] and displ[i]
    # their running sum (blocks back to back); returns the total.
    cdef size_t total = 0
    cdef int i
    for i in range(P):
        cnt[i] = counts[i]
        displ[i] = total
        total += cnt[i]
    return total


def check_counts(str op, str name, counts, Py_ssize_t P, Py_ssize_t size):
    """A v-collective's per-rank count list, checked: a new list of P ints, none
    negative, their sum at most ``size`` (the array's elements); else ValueError
    naming ``op`` and ``name``.  Entries must be integers (``int`` or a numpy
    integer, not bool): any other entry, a float or string included, is a
    TypeError naming ``name`` and its index.  Here, not in Python: those checks
    were much of a small v-op's cost (docs/experiments.md)."""
    cdef list c = []
    cdef Py_ssize_t k = 0
    try:
        it = iter(counts)
    except TypeError:
        raise TypeError(f"{op}: {name} must be a sequence of integers, got "
                        f"{type(counts).__name__}") from None
    for v in it:
        if type(v) is not int:
            if isinstance(v, (bool, _np.bool_)) or not isinstance(v, (int, _np.integer)):
                raise TypeError(f"{op}: {name} must be a sequence of integers (not bool); "
                                f"{name}[{k}] is {type(v).__name__} {v!r}")
            v = _operator.index(v)
        c.append(v)
        k += 1
    cdef Py_ssize_t n = len(c)
    cdef object total = 0
    if n != P:
        raise ValueError(f"{op}: {name} has {n} entries, the group has {P} ranks")
    for v in c:
        if v < 0:
            raise ValueError(f"{op}: {name} has a negative count: {c}")
        total += v
    if total > size:
        raise ValueError(f"{op}: {name} sum to {total} elements but the array has {size}")
    return c


def overlap(cnp.ndarray a, cnp.ndarray b):
    """Whether two arrays that passed ``check_array`` (C-contiguous) share a
    byte: their address ranges meet.  numpy's shares_memory costs ~0.3 us."""
    cdef const char *x = <const char *>cnp.PyArray_DATA(a)
    cdef const char *y = <const char *>cnp.PyArray_DATA(b)
    cdef Py_ssize_t n = cnp.PyArray_NBYTES(a)
    cdef Py_ssize_t m = cnp.PyArray_NBYTES(b)
    return n > 0 and m > 0 and x < y + m and y < x + n


# How a two-array collective's sizes relate (pair_code's `kind`).
PAIR_EQUAL = 0    # output and input alike, a multiple of the group size (all_to_all)
PAIR_GATHER = 1   # output = group size x input (all_gather, gather)
PAIR_SCATTER = 2  # input = group size x output (reduce_scatter, scatter)


def pair_code(o, i, str op, Py_ssize_t P, int kind, bint disjoint, fallback):
    """``array_code`` of the output ``o`` (writable) after every check of a
    two-array collective: ``i`` readable, the same dtype, sizes related as
    ``kind`` says, no shared byte when ``disjoint``.  One call instead of a
    dozen attribute reads from Python, which cost more than the small op."""
    check_array(i, "input", False)
    code = array_code(o, "output", True, fallback)
    cdef cnp.ndarray a = <cnp.ndarray>o, b = <cnp.ndarray>i
    cdef Py_ssize_t n = cnp.PyArray_SIZE(a), m = cnp.PyArray_SIZE(b)
    if kind == PAIR_EQUAL:
        if m % P:
            raise ValueError(f"{op}: input size {m} is not divisible by the group size {P}")
        if n != m:
            raise ValueError(f"{op}: output has {n} elements, input {m}; they must be equal")
    if a.descr is not b.descr and not cnp.PyArray_EquivTypes(a.descr, b.descr):
        raise TypeError(f"{op}: output dtype {a.dtype} differs from input dtype {b.dtype}")
    if kind == PAIR_GATHER and n != m * P:
        raise ValueError(f"{op}: output has {n} elements but needs group size {P} x input "
                         f"size {m} = {m * P}")
    if kind == PAIR_SCATTER and m != n * P:
        raise ValueError(f"{op}: input has {m} elements but needs group size {P} x output "
                         f"size {n} = {n * P}")
    if disjoint and overlap(a, b):
        raise ValueError(f"{op}: output must not overlap input")
    return code


def simd_info():
    return rl_simd_info().decode()


def host_busy():
    return bool(rl_host_busy())


def set_ptracer(long pid):
    """Let process ``pid`` and its descendants read this process's memory under
    Yama's ptrace_scope 1 (0 takes it back).  Raises OSError with the kernel's errno."""
    cdef int e = rl_shm_set_ptracer(pid)
    if e:
        raise OSError(e, f"{_os.strerror(e)}: prctl(PR_SET_PTRACER, {pid})")


def huge_page_bytes(x):
    """Bytes of array ``x``'s memory that lie in huge pages now; -1 where the
    kernel cannot tell (before Linux 6.7)."""
    cdef cnp.ndarray a = check_array(x, "x", False)
    return rl_huge_page_bytes(cnp.PyArray_DATA(a), <size_t>cnp.PyArray_NBYTES(a))


def core_roundtrip_ns(int cpu_a, int cpu_b, int iters=20000, timeout=2.0):
    """Nanoseconds a cache line takes from CPU ``cpu_a`` to ``cpu_b`` and back
    (two pinned threads, best of five batches of ``iters``); None where the
    CPUs cannot be used or ``timeout`` seconds passed."""
    cdef int64_t ms = <int64_t>(timeout * 1000)
    cdef double ns
    if iters < 1 or ms < 1:
        raise ValueError(f"iters must be >= 1 and timeout >= 0.001 s, got {iters!r}, {timeout!r}")
    with nogil:
        ns = rl_core_roundtrip_ns(cpu_a, cpu_b, iters, ms)
    return None if ns < 0 else ns


def host_others():
    """Cores other processes used in the busy test's last window (-1: none yet)."""
    return rl_host_others()


def set_host_pids(pids):
    """The pids of this host's ranks, for the busy test (wait.c); [] forgets them."""
    cdef int buf[256]
    cdef int n = 0
    for p in pids[:256]:
        buf[n] = p
        n += 1
    rl_set_host_pids(buf, n if len(pids) <= 256 else 0)


def build_info():
    """Facts about this build, for ``ringlet info`` and benchmark reports."""
    return {
        "protocol_version": RL_PROTOCOL_VERSION,
        "simd": rl_simd_info().decode(),
        "compile_flags": RL_BUILD_FLAGS.decode(),
        "compiler": "gcc-compatible " + RL_COMPILER_VERSION.decode(),
        "tuning": get_tuning(),
    }


def knobs():
    """The C core's table of knobs (ringlet.h, RL_TUNING_KNOBS), in order: a
    list of dicts with name, env (the RINGLET_* variable or None), default, doc."""
    return [{"name": rl_knobs[i].name.decode(),
             "env": rl_knobs[i].env.decode() if rl_knobs[i].env != NULL else None,
             "default": rl_knobs[i].default_value, "doc": rl_knobs[i].doc.decode()}
            for i in range(rl_nknobs)]


cdef inline int64_t *_knob_field(rl_tuning *t, int i) noexcept:
    return <int64_t *>(<char *>t + rl_knobs[i].offset)


def get_tuning():
    cdef rl_tuning t
    rl_get_tuning(&t)
    return {rl_knobs[i].name.decode(): _knob_field(&t, i)[0] for i in range(rl_nknobs)}


def set_tuning(**kw):
    """Set process-wide knobs (see docs/algorithms.md); unknown names raise."""
    cdef rl_tuning t
    cdef int i
    names = [rl_knobs[i].name.decode() for i in range(rl_nknobs)]
    for k, v in kw.items():
        if k not in names:
            raise TypeError(f"unknown tuning knob {k!r}; known: {', '.join(names)}")
        if int(v) < 0:
            raise ValueError(f"tuning knob {k} must be >= 0, got {v}")
    rl_get_tuning(&t)
    for i in range(rl_nknobs):
        if names[i] in kw:
            _knob_field(&t, i)[0] = kw[names[i]]
    rl_set_tuning(&t)


def shm_segment_bytes(int nranks):
    """Bytes of a shared-memory segment for a comm of ``nranks`` (0: too many ranks)."""
    return rl_shm_segment_bytes(nranks)


def shm_p2p_segment_bytes(int nranks):
    """Bytes of the point-to-point segment of a comm of ``nranks`` ranks; 0: none."""
    return rl_shm_p2p_segment_bytes(nranks)


def set_log_level(int level):
    """The C core's diagnostics log: 0 off, 1 INFO (connections), 2 DETAIL (every op)."""
    rl_set_log_level(level)


_TRACE_STATE = {RL_TRACE_STARTED: "started", RL_TRACE_COMPLETED: "completed",
                RL_TRACE_FAILED: "failed"}
_STATUS_NAME = {v: k for k, v in STATUS.items()}


def reduce_kernel(cnp.ndarray dst, cnp.ndarray a, cnp.ndarray b, int dt, int op):
    """dst = a (op) b elementwise with the C kernels (for tests and `bench limits`)."""
    cdef size_t n = a.size
    if <size_t>b.size != n or <size_t>dst.size != n:
        raise ValueError("reduce_kernel: arrays must have equal sizes")
    if not rl_op_valid(<rl_dtype>dt, <rl_redop>op):
        raise ValueError("reduce_kernel: op not valid for dtype")
    cdef void *d = _wptr(dst, "dst")
    cdef const void *pa = _rptr(a, "a")
    cdef const void *pb = _rptr(b, "b")
    with nogil:
        rl_reduce_kernel(d, pa, pb, n, <rl_dtype>dt, <rl_redop>op)


def scale_kernel(cnp.ndarray buf, int dt, double factor):
    """buf *= factor in place with the C kernel AVG uses (floating dtypes only)."""
    if dt >= RL_NDTYPES or not rl_op_valid(<rl_dtype>dt, RL_AVG):
        raise ValueError("scale_kernel: dtype is not floating")
    cdef void *d = _wptr(buf, "buf")
    cdef size_t n = buf.size
    with nogil:
        rl_scale_kernel(d, n, <rl_dtype>dt, factor)


cdef class Context:
    """A rank's listener and endpoint table (one per rank, shared by its comms)."""
    cdef rl_ctx *ctx
    # Closed while communicators made from it were still alive (one closed while
    # another thread was inside an operation on it: Comm.close): they use it, so
    # the last of them frees it (_comm_gone).
    cdef rl_ctx *_doomed
    cdef int _comms  # rl_comms made from it and not yet destroyed
    cdef readonly int rank, size

    def __cinit__(self, int rank, int size, str bind_host, bytes secret, bytes job_id):
        cdef rl_error err
        if len(job_id) != 16:
            raise ValueError("job_id must be 16 bytes")
        cdef bytes host = bind_host.encode()
        cdef const char *h = host
        cdef const uint8_t *s = <const uint8_t *>(<const char *>secret)
        cdef size_t sl = len(secret)
        cdef const uint8_t *j = <const uint8_t *>(<const char *>job_id)
        cdef int st
        with nogil:
            st = rl_ctx_create(&self.ctx, rank, size, h, s, sl, j, &err)
        if st != RL_OK:
            raise exception_class(st)(err.msg.decode(errors="replace"))
        self.rank = rank
        self.size = size

    def __dealloc__(self):
        cdef rl_ctx *c = self.ctx if self.ctx != NULL else self._doomed
        self.ctx = self._doomed = NULL
        if c != NULL:
            rl_ctx_destroy(c)

    cdef void _comm_gone(self) noexcept:
        # A communicator of this context was destroyed (GIL held).
        cdef rl_ctx *c = NULL
        self._comms -= 1
        if self._comms == 0 and self._doomed != NULL:
            c = self._doomed
            self._doomed = NULL
            with nogil:
                rl_ctx_destroy(c)

    @property
    def port(self):
        self._live()
        return rl_ctx_port(self.ctx)

    cdef _live(self):
        if self.ctx == NULL:
            raise _errors.RingletError("context is closed")

    def set_peer(self, int rank, str host, int port):
        self._live()
        if rl_ctx_set_peer(self.ctx, rank, host.encode(), port) != RL_OK:
            raise ValueError(f"bad endpoint for rank {rank}: {host}:{port}")

    def rejected(self):
        """How many incoming connections the listener refused so far."""
        self._live()
        return rl_ctx_rejected(self.ctx)

    def close(self):
        """Stop the listener and free the context.  While a communicator made from
        it is still alive (closed while another thread was inside an operation on
        it), the free waits for the last of them; the context is unusable at once."""
        cdef rl_ctx *c = self.ctx
        self.ctx = NULL
        if c == NULL:
            return
        if self._comms > 0:
            self._doomed = c
            return
        with nogil:
            rl_ctx_destroy(c)


@cython.no_gc_clear  # __dealloc__ tells its Context (owner) that the comm is gone
cdef class Comm:
    """A communicator: the C object behind a ProcessGroup (collective or p2p side).

    Every method that calls C with the GIL released counts itself a user of the
    rl_comm for that time (_enter / _leave).  ``close()`` while another thread is
    inside an operation poisons the comm (the operation returns at once with an
    error) and leaves the free to the last user, so C memory is never freed under
    a thread still using it.  The count and the pointer change only with the GIL
    held and without releasing it in between: the GIL is their lock.
    """
    cdef rl_comm *c
    cdef rl_comm *_doomed  # closed while in use: freed by the last user (_leave)
    cdef int _users  # threads inside C on this comm (and a close still cancelling)
    cdef Context owner
    cdef readonly int rank, size
    cdef readonly unsigned int comm_id

    def __cinit__(self, Context ctx, unsigned int comm_id, int rank, world_ranks):
        cdef rl_error err
        cdef int n = len(world_ranks)
        cdef int *w = <int *>malloc(sizeof(int) * max(n, 1))
        if w == NULL:
            raise MemoryError()
        cdef int i, st
        try:
            for i in range(n):
                w[i] = world_ranks[i]
            ctx._live()
            st = rl_comm_create(&self.c, ctx.ctx, comm_id, rank, n, w, &err)
        finally:
            free(w)
        if st != RL_OK:
            raise exception_class(st)(err.msg.decode(errors="replace"))
        ctx._comms += 1
        self.owner = ctx
        self.rank = rank
        self.size = n
        self.comm_id = comm_id

    def __dealloc__(self):
        # No thread can be inside an operation here (each holds a reference).
        cdef rl_comm *c = self.c if self.c != NULL else self._doomed
        self.c = self._doomed = NULL
        if c != NULL:
            rl_comm_destroy(c)
            if self.owner is not None:
                self.owner._comm_gone()

    cdef void _destroy(self, rl_comm *c) noexcept:
        # c is no longer reachable from self; GIL held on entry.
        with nogil:
            rl_comm_destroy(c)
        if self.owner is not None:
            self.owner._comm_gone()

    def close(self):
        """Free the communicator.  A thread still inside an operation on it (a
        synchronous collective of another thread) is woken with an error
        (``RingletError``, "the communicator was closed ..."), and the last such
        thread frees it on its way out.  Idempotent."""
        cdef bytes r = (f"rank {self.rank}: the communicator was closed (ringlet.shutdown()) "
                        f"while this operation was still running in another thread").encode()
        cdef const char *rp = r
        cdef rl_comm *c = self.c
        if c == NULL:
            return
        self.c = NULL
        if self._users == 0:
            self._destroy(c)
            return
        self._doomed = c
        self._users += 1  # a user itself while it cancels without the GIL
        try:
            with nogil:
                rl_comm_cancel(c, RL_ERR_ABORTED, rp)
        finally:
            self._leave()

    cdef inline rl_comm *_h(self) except NULL:
        if self.c == NULL:
            raise _errors.RingletError("communicator is closed")
        return self.c

    cdef inline rl_comm *_enter(self) except NULL:
        # Before a call that releases the GIL: the comm stays allocated until _leave.
        if self.c == NULL:
            raise _errors.RingletError("communicator is closed")
        self._users += 1
        return self.c

    cdef inline void _leave(self) noexcept:
        cdef rl_comm *c
        self._users -= 1
        if self._users == 0 and self._doomed != NULL:
            c = self._doomed
            self._doomed = NULL
            self._destroy(c)

    cdef inline int _end(self, rl_comm *c, int st, str op) except -1:
        # After the C call of an operation entered with _enter: check, then leave.
        if st == RL_OK:
            self._leave()
            return 0
        try:
            return self._check(c, st, op)
        finally:
            self._leave()

    cdef int _check(self, rl_comm *c, int st, str op) except -1:
        # c: the comm the operation ran on (self.c may be NULL by now: close()).
        if st == RL_OK:
            return 0
        if st == RL_ERR_INTERRUPTED and PyErr_Occurred() != NULL:
            return -1  # re-raise the KeyboardInterrupt the signal handler set
        cdef const rl_error *e = rl_comm_error(c)
        status = e.status if e.status else st
        if st == RL_ERR_INVALID and not e.status:
            raise ValueError(f"{op}: invalid arguments passed to the C core")
        msg = e.msg.decode(errors="replace") if e.status else f"rank {self.rank}: {op} failed"
        if status == RL_ERR_INTERRUPTED:
            raise KeyboardInterrupt(msg)
        exc = exception_class(status)(msg)
        if isinstance(exc, _errors.RingletError):
            exc.rank = self.rank
            exc.peer = e.peer if e.peer >= 0 else None
            exc.op = op
            exc.seq = rl_comm_seq(c)
        raise exc

    def error(self):
        """(status, peer, errno, message) of the first failure, or None."""
        cdef rl_comm *c = self._enter()
        cdef const rl_error *e
        try:
            e = rl_comm_error(c)
            if not e.status:
                return None
            return (e.status, e.peer, e.sys_errno, e.msg.decode(errors="replace"))
        finally:
            self._leave()

    def cancel(self, int status, str reason):
        """Poison from any thread and wake a call blocked in this comm."""
        cdef bytes r = reason.encode()[:500]
        cdef const char *rp = r
        cdef rl_comm *c = self._enter()
        try:
            with nogil:
                rl_comm_cancel(c, status, rp)
        finally:
            self._leave()

    def abort(self, int status, str reason):
        """Poison, tell connected peers (ABORT frames) and close the sockets."""
        cdef bytes r = reason.encode()[:500]
        cdef const char *rp = r
        cdef rl_comm *c = self._enter()
        try:
            with nogil:
                rl_comm_abort(c, status, rp)
        finally:
            self._leave()

    @property
    def seq(self):
        return rl_comm_seq(self._h())

    def trace(self):
        """The flight record: ``(recorded, capacity, entries)``.

        ``recorded`` counts every op this comm ever started, ``capacity`` how
        many it keeps; ``entries`` are dicts, oldest first, with id, seq, op,
        dtype, bytes, peer, tag, recv, algorithm, state ("started",
        "completed", "failed"), status (a ``STATUS`` name or None), start_ns
        and end_ns (CLOCK_MONOTONIC, as ``time.monotonic_ns``; None while
        started).  A user of the comm meanwhile, so ``close()`` cannot free the
        ring under it; it takes no C lock, so it is safe while this comm is
        blocked in an op (from a signal handler, say).
        """
        cdef rl_comm *c = self._enter()
        cdef size_t cap = rl_comm_trace_capacity(c)
        cdef rl_trace_entry *buf = <rl_trace_entry *>malloc(sizeof(rl_trace_entry) * (cap if cap > 0 else 1))
        if buf == NULL:
            self._leave()
            raise MemoryError()
        cdef uint64_t total = 0
        cdef size_t n, i
        cdef rl_trace_entry *e
        out = []
        try:
            n = rl_comm_trace(c, buf, cap, &total)
            for i in range(n):
                e = &buf[i]
                out.append({
                    "id": e.id, "seq": e.seq, "op": rl_opcode_name(e.opcode).decode(),
                    "dtype": rl_dtype_name(<rl_dtype>e.dtype).decode(), "bytes": e.bytes,
                    "peer": e.peer, "tag": e.tag, "recv": bool(e.flags & RL_TRACE_RECV),
                    "algorithm": e.algo.decode() if e.algo != NULL else None,
                    "state": _TRACE_STATE.get(e.state, "unknown"),
                    "status": _STATUS_NAME.get(e.status, str(e.status)) if e.state == RL_TRACE_FAILED else None,
                    "start_ns": e.start_ns, "end_ns": e.end_ns if e.end_ns else None})
        finally:
            free(buf)
            self._leave()
        return total, cap, out

    def attach_shm(self, int fd, size_t size, bint create, bint p2p=False):
        """Map segment ``fd`` (``size`` bytes) for this comm's collectives, or with
        ``p2p`` for its point-to-point messages; the caller keeps and closes
        ``fd``.  ``create``: lay it out (comm rank 0)."""
        cdef rl_error err
        cdef int st
        cdef rl_comm *c = self._enter()
        with nogil:
            if p2p:
                st = rl_comm_attach_shm_p2p(c, fd, size, create, &err)
            else:
                st = rl_comm_attach_shm(c, fd, size, create, &err)
        self._leave()
        if st != RL_OK:
            raise exception_class(st)(f"rank {self.rank}: " + err.msg.decode(errors="replace"))

    def shm_ready(self, int64_t timeout_ms):
        """Wait until every rank of the comm has attached its segment."""
        cdef int st
        cdef rl_comm *c = self._enter()
        with nogil:
            st = rl_comm_shm_ready(c, timeout_ms)
        self._end(c, st, "attach shared memory")

    @property
    def transport(self):
        """"shm" when collectives run over a shared-memory segment, else "tcp"."""
        return "shm" if rl_comm_uses_shm(self._h()) else "tcp"

    @property
    def single_copy(self):
        """(bytes, rank, peer, errno): the block size from which shared-memory
        ops copy straight between processes (0: off; 0 over TCP too) and, when
        a rank's set-up probe turned it off, that rank, the peer it could not
        read and the read's errno (0: it read another word); else -1, -1, 0."""
        cdef int rank, peer, err
        cdef int64_t n = rl_comm_shm_single_copy(self._h(), &rank, &peer, &err)
        return (n, rank, peer, err)

    @property
    def num_hosts(self):
        """How many hosts ``set_hosts`` was told of (0: never told: one host)."""
        return rl_comm_num_hosts(self._h())

    def set_hosts(self, host_of):
        """Tell the comm which host each comm rank runs on (``host_of[i]``, a number
        in [0, size) for comm rank i; the same list on every member)."""
        cdef int n = len(host_of)
        cdef rl_comm *c = self._enter()
        cdef int *a = NULL
        cdef int st, i
        try:
            if n != self.size:
                raise ValueError(f"set_hosts: {n} host numbers for a comm of {self.size} ranks")
            a = <int *>malloc(sizeof(int) * n)
            if a == NULL:
                raise MemoryError()
            for i in range(n):
                a[i] = host_of[i]
            st = rl_comm_set_hosts(c, a)
        finally:
            free(a)
            self._leave()
        if st != RL_OK:
            raise ValueError(f"set_hosts: every host number must lie in [0, {n}), got {list(host_of)}")

    def connect(self, int peer, int64_t timeout_ms):
        cdef int st
        cdef rl_comm *c = self._enter()
        with nogil:
            st = rl_comm_connect(c, peer, timeout_ms)
        self._end(c, st, "connect")

    def all_reduce(self, cnp.ndarray buf, int dt, int op, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef void *p = _wptr(buf, "array")
        cdef size_t n = buf.size
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_all_reduce(c, p, n, <rl_dtype>dt, <rl_redop>op, timeout_ms)
        self._end(c, st, "all_reduce")

    def broadcast(self, cnp.ndarray buf, int dt, int root, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef void *p = _wptr(buf, "array")
        cdef size_t n = buf.size
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_broadcast(c, p, n, <rl_dtype>dt, root, timeout_ms)
        self._end(c, st, "broadcast")

    def reduce(self, cnp.ndarray buf, int dt, int op, int root, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef void *p = _wptr(buf, "array")
        cdef size_t n = buf.size
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_reduce(c, p, n, <rl_dtype>dt, <rl_redop>op, root, timeout_ms)
        self._end(c, st, "reduce")

    def all_gather(self, cnp.ndarray out, cnp.ndarray inp, int dt, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef size_t n = inp.size
        if <size_t>out.size != n * <size_t>self.size:
            raise ValueError("all_gather: output size mismatch")
        cdef void *po = _wptr(out, "output")
        cdef const void *pi = _rptr(inp, "input")
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_all_gather(c, po, pi, n, <rl_dtype>dt, timeout_ms)
        self._end(c, st, "all_gather")

    def reduce_scatter(self, cnp.ndarray out, cnp.ndarray inp, int dt, int op, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef size_t n = out.size
        if <size_t>inp.size != n * <size_t>self.size:
            raise ValueError("reduce_scatter: input size mismatch")
        cdef void *po = _wptr(out, "output")
        cdef const void *pi = _rptr(inp, "input")
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_reduce_scatter(c, po, pi, n, <rl_dtype>dt, <rl_redop>op, timeout_ms)
        self._end(c, st, "reduce_scatter")

    def all_to_all(self, cnp.ndarray out, cnp.ndarray inp, int dt, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        if out.size != inp.size or inp.size % self.size:
            raise ValueError("all_to_all: input and output need size x count elements each")
        cdef size_t n = inp.size // self.size
        cdef void *po = _wptr(out, "output")
        cdef const void *pi = _rptr(inp, "input")
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_all_to_all(c, po, pi, n, <rl_dtype>dt, timeout_ms)
        self._end(c, st, "all_to_all")

    def all_to_all_v(self, cnp.ndarray out, out_counts, cnp.ndarray inp, in_counts,
                     int dt, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef int P = self.size
        if len(out_counts) != P or len(in_counts) != P:
            raise ValueError("all_to_all_v: count lists must have one entry per rank")
        cdef size_t *buf = <size_t *>malloc(sizeof(size_t) * 4 * P)
        if buf == NULL:
            raise MemoryError()
        cdef size_t *oc = buf
        cdef size_t *od = buf + P
        cdef size_t *ic = buf + 2 * P
        cdef size_t *idp = buf + 3 * P
        cdef size_t so = 0, si = 0
        cdef void *po
        cdef const void *pi
        cdef int st
        try:
            so = _count_table(out_counts, P, oc, od)
            si = _count_table(in_counts, P, ic, idp)
            if so > <size_t>out.size or si > <size_t>inp.size:
                raise ValueError("all_to_all_v: counts exceed the arrays")
            po = _wptr(out, "output")
            pi = _rptr(inp, "input")
            c = self._enter()
            with nogil:
                st = rl_all_to_all_v(c, po, oc, od, pi, ic, idp, <rl_dtype>dt, timeout_ms)
        finally:
            free(buf)
        self._end(c, st, "all_to_all")

    def all_gather_v(self, cnp.ndarray out, counts, cnp.ndarray inp, int dt,
                     int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef int P = self.size
        if len(counts) != P:
            raise ValueError("all_gather_v: the count list must have one entry per rank")
        cdef size_t *buf = <size_t *>malloc(sizeof(size_t) * 2 * P)
        if buf == NULL:
            raise MemoryError()
        cdef size_t *oc = buf
        cdef size_t *od = buf + P
        cdef size_t so = 0
        cdef void *po
        cdef const void *pi
        cdef int st
        try:
            so = _count_table(counts, P, oc, od)
            if so > <size_t>out.size or oc[self.rank] != <size_t>inp.size:
                raise ValueError("all_gather_v: counts do not match the arrays")
            po = _wptr(out, "output")
            pi = _rptr(inp, "input")
            c = self._enter()
            with nogil:
                st = rl_all_gather_v(c, po, oc, od, pi, <rl_dtype>dt, timeout_ms)
        finally:
            free(buf)
        self._end(c, st, "all_gather")

    def rooted_v(self, bint gather, many, counts, cnp.ndarray one, int dt, int root,
                 int64_t timeout_ms):
        # gather_v (many: the root's output) or scatter_v (many: its input);
        # counts are used on root only.
        cdef rl_comm *c = self._h()
        cdef int P = self.size
        cdef size_t n = one.size
        cdef size_t *buf = NULL
        cdef size_t *oc = NULL
        cdef size_t *od = NULL
        cdef size_t so = 0
        cdef void *pm = NULL
        cdef void *po
        cdef int st
        cdef const char *name = "gather_v" if gather else "scatter_v"
        try:
            if self.rank == root:
                if len(counts) != P:
                    raise ValueError(f"{name}: the count list must have one entry per rank")
                buf = <size_t *>malloc(sizeof(size_t) * 2 * P)
                if buf == NULL:
                    raise MemoryError()
                oc = buf
                od = buf + P
                so = _count_table(counts, P, oc, od)
                if so > <size_t>(<cnp.ndarray>many).size or oc[root] != n:
                    raise ValueError(f"{name}: counts do not match the arrays")
                pm = _wptr(<cnp.ndarray>many, "output") if gather else \
                    <void *>_rptr(<cnp.ndarray>many, "input")
            po = <void *>_rptr(one, "input") if gather else _wptr(one, "output")
            c = self._enter()
            with nogil:
                if gather:
                    st = rl_gather_v(c, pm, oc, od, po, n, <rl_dtype>dt, root, timeout_ms)
                else:
                    st = rl_scatter_v(c, po, n, pm, oc, od, <rl_dtype>dt, root, timeout_ms)
        finally:
            free(buf)
        self._end(c, st, "gather" if gather else "scatter")

    def gather(self, out, cnp.ndarray inp, int dt, int root, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef size_t n = inp.size
        cdef void *po = NULL
        if self.rank == root:
            if <size_t>(<cnp.ndarray>out).size != n * <size_t>self.size:
                raise ValueError("gather: output size mismatch")
            po = _wptr(<cnp.ndarray>out, "output")
        cdef const void *pi = _rptr(inp, "input")
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_gather(c, po, pi, n, <rl_dtype>dt, root, timeout_ms)
        self._end(c, st, "gather")

    def scatter(self, cnp.ndarray out, inp, int dt, int root, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef size_t n = out.size
        cdef const void *pi = NULL
        if self.rank == root:
            if <size_t>(<cnp.ndarray>inp).size != n * <size_t>self.size:
                raise ValueError("scatter: input size mismatch")
            pi = _rptr(<cnp.ndarray>inp, "input")
        cdef void *po = _wptr(out, "output")
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_scatter(c, po, pi, n, <rl_dtype>dt, root, timeout_ms)
        self._end(c, st, "scatter")

    def barrier(self, int64_t timeout_ms, _b=None, _c=None, _d=None):
        # _b.._d: unused, so the group's fixed-arity call path can call it directly
        cdef rl_comm *c = self._h()
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_barrier(c, timeout_ms)
        self._end(c, st, "barrier")

    def send(self, cnp.ndarray buf, int dt, int dst, unsigned int tag, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef const void *p = _rptr(buf, "array")
        cdef size_t n = buf.size
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_send(c, p, n, <rl_dtype>dt, dst, tag, timeout_ms)
        self._end(c, st, "send")

    def recv(self, cnp.ndarray buf, int dt, int src, unsigned int tag, int64_t timeout_ms):
        cdef rl_comm *c = self._h()
        cdef void *p = _wptr(buf, "array")
        cdef size_t n = buf.size
        cdef int st
        c = self._enter()
        with nogil:
            st = rl_recv(c, p, n, <rl_dtype>dt, src, tag, timeout_ms)
        self._end(c, st, "recv")
        return src

    def recv_any(self, cnp.ndarray buf, int dt, int _src, unsigned int tag, int64_t timeout_ms):
        # _src: unused, so that recv's call path can call it; returns the sender
        cdef rl_comm *c = self._h()
        cdef void *p = _wptr(buf, "array")
        cdef size_t n = buf.size
        cdef int st, src = -1
        c = self._enter()
        with nogil:
            st = rl_recv_any(c, p, n, <rl_dtype>dt, tag, timeout_ms, &src)
        self._end(c, st, "recv")
        return src
