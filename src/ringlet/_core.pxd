# Declarations of the C API (csrc/ringlet.h) for Cython.
from libc.stdint cimport uint8_t, uint32_t, int64_t, uint64_t

cdef extern from "ringlet.h" nogil:
    enum: RL_PROTOCOL_VERSION
    enum: RL_ERRMSG_MAX
    ctypedef enum rl_status:
        RL_OK, RL_ERR_INVALID, RL_ERR_SYSTEM, RL_ERR_TIMEOUT, RL_ERR_PEER_CLOSED,
        RL_ERR_DESYNC, RL_ERR_AUTH, RL_ERR_PROTOCOL, RL_ERR_POISONED,
        RL_ERR_INTERRUPTED, RL_ERR_NOMEM, RL_ERR_ABORTED
    ctypedef enum rl_dtype:
        RL_F16, RL_BF16, RL_F32, RL_F64, RL_I8, RL_U8, RL_I32, RL_I64, RL_BOOL, RL_I16, RL_U16,
        RL_U32, RL_U64, RL_NDTYPES
    ctypedef enum rl_redop:
        RL_SUM, RL_PROD, RL_MIN, RL_MAX, RL_AVG, RL_BAND, RL_BOR, RL_BXOR, RL_NOPS

    ctypedef struct rl_error:
        int status
        int peer
        int sys_errno
        char msg[RL_ERRMSG_MAX]

    ctypedef struct rl_tuning:
        pass
    ctypedef struct rl_knob:
        const char *name
        const char *env
        int64_t default_value
        size_t offset
        const char *doc
    const rl_knob rl_knobs[]
    const int rl_nknobs

    size_t rl_dtype_size(rl_dtype dt)
    const char *rl_dtype_name(rl_dtype dt)
    const char *rl_op_name(rl_redop op)
    int rl_op_valid(rl_dtype dt, rl_redop op)
    void rl_reduce_kernel(void *dst, const void *a, const void *b, size_t n, rl_dtype dt, rl_redop op)
    void rl_scale_kernel(void *buf, size_t n, rl_dtype dt, double factor)
    void rl_scale_kernel(void *buf, size_t n, rl_dtype dt, double factor)
    const char *rl_simd_info()

    int rl_host_busy()
    int64_t rl_huge_page_bytes(const void *p, size_t n)
    void rl_set_host_pids(const int *pids, int n)
    double rl_core_roundtrip_ns(int cpu_a, int cpu_b, int iters, int64_t timeout_ms)
    double rl_host_others()
    void rl_tuning_defaults(rl_tuning *t)
    void rl_set_tuning(const rl_tuning *t)
    void rl_get_tuning(rl_tuning *t)
    ctypedef int (*rl_interrupt_fn)() noexcept nogil
    void rl_set_interrupt_hook(rl_interrupt_fn fn)

    ctypedef enum rl_trace_state:
        RL_TRACE_STARTED, RL_TRACE_COMPLETED, RL_TRACE_FAILED
    enum: RL_TRACE_RECV
    ctypedef struct rl_trace_entry:
        uint64_t id
        uint64_t seq
        uint64_t bytes
        int64_t start_ns
        int64_t end_ns
        int peer
        uint32_t tag
        uint8_t opcode, dtype, redop, flags
        uint8_t state
        uint8_t status
        const char *algo
    void rl_set_log_level(int level)
    const char *rl_opcode_name(int opcode)

    ctypedef struct rl_ctx:
        pass
    ctypedef struct rl_comm:
        pass
    int rl_ctx_create(rl_ctx **out, int rank, int size, const char *bind_host,
                      const uint8_t *secret, size_t secret_len, const uint8_t *job_id,
                      rl_error *err)
    int rl_ctx_port(const rl_ctx *ctx)
    int rl_ctx_set_peer(rl_ctx *ctx, int rank, const char *host, int port)
    void rl_ctx_destroy(rl_ctx *ctx)
    int64_t rl_ctx_rejected(const rl_ctx *ctx)

    int rl_comm_create(rl_comm **out, rl_ctx *ctx, uint32_t comm_id, int rank, int size,
                       const int *world_ranks, rl_error *err)
    void rl_comm_destroy(rl_comm *c)
    void rl_comm_abort(rl_comm *c, int status, const char *reason)
    void rl_comm_cancel(rl_comm *c, int status, const char *reason)
    const rl_error *rl_comm_error(const rl_comm *c)
    uint64_t rl_comm_seq(const rl_comm *c)
    int rl_comm_connect(rl_comm *c, int peer, int64_t timeout_ms)
    int rl_comm_set_hosts(rl_comm *c, const int *host_of)
    int rl_comm_num_hosts(const rl_comm *c)
    size_t rl_shm_segment_bytes(int nranks)
    int rl_comm_attach_shm(rl_comm *c, int fd, size_t size, int create, rl_error *err)
    size_t rl_shm_p2p_segment_bytes(int nranks)
    int rl_comm_attach_shm_p2p(rl_comm *c, int fd, size_t size, int create, rl_error *err)
    int rl_comm_shm_ready(rl_comm *c, int64_t timeout_ms)
    int rl_comm_uses_shm(const rl_comm *c)
    int64_t rl_comm_shm_single_copy(const rl_comm *c, int *rank, int *peer, int *err)
    int rl_shm_set_ptracer(long pid)
    size_t rl_comm_trace(const rl_comm *c, rl_trace_entry *out, size_t max, uint64_t *total)
    size_t rl_comm_trace_capacity(const rl_comm *c)

    int rl_all_reduce(rl_comm *c, void *buf, size_t count, rl_dtype dt, rl_redop op, int64_t timeout_ms)
    int rl_broadcast(rl_comm *c, void *buf, size_t count, rl_dtype dt, int root, int64_t timeout_ms)
    int rl_reduce(rl_comm *c, void *buf, size_t count, rl_dtype dt, rl_redop op, int root, int64_t timeout_ms)
    int rl_all_gather(rl_comm *c, void *out, const void *inp, size_t count, rl_dtype dt, int64_t timeout_ms)
    int rl_reduce_scatter(rl_comm *c, void *out, const void *inp, size_t count, rl_dtype dt,
                          rl_redop op, int64_t timeout_ms)
    int rl_all_gather_v(rl_comm *c, void *out, const size_t *counts, const size_t *displs,
                        const void *inp, rl_dtype dt, int64_t timeout_ms)
    int rl_gather_v(rl_comm *c, void *out, const size_t *counts, const size_t *displs,
                    const void *inp, size_t count, rl_dtype dt, int root, int64_t timeout_ms)
    int rl_scatter_v(rl_comm *c, void *out, size_t count, const void *inp, const size_t *counts,
                     const size_t *displs, rl_dtype dt, int root, int64_t timeout_ms)
    int rl_all_to_all_v(rl_comm *c, void *out, const size_t *out_counts, const size_t *out_displs,
                        const void *inp, const size_t *in_counts, const size_t *in_displs,
                        rl_dtype dt, int64_t timeout_ms)
    int rl_all_to_all(rl_comm *c, void *out, const void *inp, size_t count, rl_dtype dt,
                      int64_t timeout_ms)
    int rl_gather(rl_comm *c, void *out, const void *inp, size_t count, rl_dtype dt, int root,
                  int64_t timeout_ms)
    int rl_scatter(rl_comm *c, void *out, const void *inp, size_t count, rl_dtype dt, int root,
                   int64_t timeout_ms)
    int rl_barrier(rl_comm *c, int64_t timeout_ms)
    int rl_send(rl_comm *c, const void *buf, size_t count, rl_dtype dt, int dst, uint32_t tag,
                int64_t timeout_ms)
    int rl_recv(rl_comm *c, void *buf, size_t count, rl_dtype dt, int src, uint32_t tag,
                int64_t timeout_ms)
    int rl_recv_any(rl_comm *c, void *buf, size_t count, rl_dtype dt, uint32_t tag,
                    int64_t timeout_ms, int *src)
