/*
 * ringlet.h - the C API of ringlet's core.
 *
 * Plain C11, no Python.h: everything here can be built, tested and profiled as
 * ordinary C.  The Cython layer (src/ringlet/_core.pyx) is the only caller.
 *
 * Objects:
 *   rl_ctx   one per process-rank: the listening socket, the thread that
 *            authenticates incoming connections, the table of every world
 *            rank's endpoint, and the job secret.
 *   rl_comm  a communicator: a set of ranks (a subset of the world), an id
 *            that every frame carries, a sequence number per operation, and
 *            lazily opened TCP connections to its peers.  A comm is used by
 *            one thread at a time for collectives; point-to-point calls on a
 *            comm may come from one sender and one receiver thread per peer.
 *
 * Every blocking call takes a timeout in milliseconds (<= 0: no deadline is
 * not allowed; callers always pass one), returns an rl_status, and on failure
 * records a human-readable message in the comm's rl_error.  After a failure a
 * comm is poisoned: later calls return RL_ERR_POISONED at once and the first
 * error stays readable through rl_comm_error().
 */
#ifndef RINGLET_H
#define RINGLET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RL_PROTOCOL_VERSION 1
#define RL_ERRMSG_MAX 768

/* ---- status codes ---------------------------------------------------- */
typedef enum {
    RL_OK = 0,
    RL_ERR_INVALID = 1,      /* bad argument (caller bug)                      */
    RL_ERR_SYSTEM = 2,       /* a system call failed; errno is recorded        */
    RL_ERR_TIMEOUT = 3,      /* the operation's deadline passed                */
    RL_ERR_PEER_CLOSED = 4,  /* a peer closed its connection or reset it       */
    RL_ERR_DESYNC = 5,       /* a peer is in a different op / dtype / size     */
    RL_ERR_AUTH = 6,         /* handshake failed                               */
    RL_ERR_PROTOCOL = 7,     /* malformed or oversized frame                   */
    RL_ERR_POISONED = 8,     /* an earlier failure poisoned the communicator  */
    RL_ERR_INTERRUPTED = 9,  /* the interrupt hook asked to stop (Ctrl-C)      */
    RL_ERR_NOMEM = 10,
    RL_ERR_ABORTED = 11      /* a peer aborted; its reason is in the message   */
} rl_status;

/* ---- element types and reduction operations ------------------------- */
typedef enum {
    RL_F16 = 0, RL_BF16 = 1, RL_F32 = 2, RL_F64 = 3,
    RL_I8 = 4, RL_U8 = 5, RL_I32 = 6, RL_I64 = 7, RL_BOOL = 8,
    RL_I16 = 9, RL_U16 = 10, RL_U32 = 11, RL_U64 = 12,
    RL_NDTYPES = 13
} rl_dtype;

typedef enum {
    RL_SUM = 0, RL_PROD = 1, RL_MIN = 2, RL_MAX = 3, RL_AVG = 4,
    RL_BAND = 5, RL_BOR = 6, RL_BXOR = 7,
    RL_NOPS = 8
} rl_redop;

/* Operation codes carried in every frame header. */
typedef enum {
    RL_OP_NONE = 0,
    RL_OP_ALL_REDUCE = 1, RL_OP_BROADCAST = 2, RL_OP_REDUCE = 3,
    RL_OP_ALL_GATHER = 4, RL_OP_REDUCE_SCATTER = 5, RL_OP_ALL_TO_ALL = 6,
    RL_OP_GATHER = 7, RL_OP_SCATTER = 8, RL_OP_BARRIER = 9,
    RL_OP_P2P = 10,
    RL_OP_ABORT = 15
} rl_opcode;

typedef struct {
    int status;          /* rl_status of the first failure               */
    int peer;            /* comm rank of the peer involved, or -1        */
    int sys_errno;       /* errno for RL_ERR_SYSTEM, else 0              */
    char msg[RL_ERRMSG_MAX];
} rl_error;

/* ---- reduction kernels (kernels.c) ----------------------------------- */
size_t rl_dtype_size(rl_dtype dt);
const char *rl_dtype_name(rl_dtype dt);
const char *rl_op_name(rl_redop op);
/* Name of a frame op code (transport.c). */
const char *rl_opcode_name(int opcode);
/* 1 when op is defined for dt (bitwise ops: integers and bool only). */
int rl_op_valid(rl_dtype dt, rl_redop op);
/* dst[i] = a[i] op b[i] for i < n.  dst may alias a or b.  AVG reduces as SUM
 * (the caller scales once at the end).  float16 / bfloat16 are computed in
 * float32 and rounded to nearest-even once per element.  An invalid (dt, op)
 * pair does nothing. */
void rl_reduce_kernel(void *dst, const void *a, const void *b, size_t n,
                      rl_dtype dt, rl_redop op);
/* buf[i] *= factor for floating types (used to finish AVG). */
void rl_scale_kernel(void *buf, size_t n, rl_dtype dt, double factor);
/* memcpy / memmove for bulk copies, without the cases where glibc's
 * `rep movsb` path runs many times slower (a destination a few bytes past
 * the source modulo 4 KiB).  rl_copy's ranges must not overlap. */
void rl_copy(void *dst, const void *src, size_t n);
void rl_move(void *dst, const void *src, size_t n);
/* memcpy with non-temporal stores where available (large, non-overlapping
 * copies whose destination is not read again soon). */
void rl_copy_stream(void *dst, const void *src, size_t n);
/* Names of the SIMD paths the running CPU selected: "avx2,f16c" or
 * "baseline" (RINGLET_SIMD=baseline forces the portable path). */
const char *rl_simd_info(void);

/* ---- SHA-256 / HMAC (sha256.c) --------------------------------------- */
void rl_sha256(const void *msg, size_t len, uint8_t out[32]);
void rl_hmac_sha256(const uint8_t *key, size_t keylen,
                    const void *msg, size_t len, uint8_t out[32]);
/* Constant-time comparison: 1 when equal. */
int rl_ct_equal(const void *a, const void *b, size_t n);
/* Fill buf with n bytes from the OS CSPRNG (getrandom). 0 on success, -1
 * with errno set on failure. */
int rl_random_bytes(void *buf, size_t n);

/* ---- tuning (process-wide; set before creating communicators) ------- */
/* The one table of knobs: X(name, default, RINGLET_* variable or NULL, doc).
 * The struct, its defaults, rl_knobs[] (which the Python binding, init()'s
 * environment variables and docs/algorithms.md's table are derived from or
 * checked against) all expand it, so a knob is declared here only.
 * rl_set_tuning raises segment_bytes to at least 4096 and handshake_ms to
 * at least 100. */
#define RL_TUNING_KNOBS(X)                                                                          \
    X(segment_bytes, 512 << 10, "RINGLET_SEGMENT_BYTES",                                            \
      "pipeline segment of the ring and chain algorithms (at least 4096)")                          \
    X(allreduce_small_bytes, 64 << 10, "RINGLET_ALLREDUCE_SMALL_BYTES",                             \
      "up to this: latency algorithms of all_reduce (message), all_gather, reduce_scatter "         \
      "and all_to_all (all ranks' bytes)")                                                          \
    X(bcast_small_bytes, 64 << 10, "RINGLET_BCAST_SMALL_BYTES",                                     \
      "up to this: broadcast by flat or binomial tree, else pipelined chain")                       \
    X(bcast_flat_bytes, 8 << 10, "RINGLET_BCAST_FLAT_BYTES",                                        \
      "broadcast and reduce over TCP across hosts: up to this the root sends to (reduce: takes "   \
      "from) every rank itself (up to 4 ranks) or a rank of every other host (up to 4 hosts); "     \
      "beyond it trees that send one copy over each host's link")                                   \
    X(reduce_small_bytes, 64 << 10, "RINGLET_REDUCE_SMALL_BYTES",                                   \
      "up to this: reduce by binomial tree, else pipelined chain")                                  \
    X(spin_us, 50, "RINGLET_SPIN_US", "busy-poll this long before blocking in poll(2)")             \
    X(sockbuf_bytes, 0, "RINGLET_SOCKBUF_BYTES", "SO_SNDBUF / SO_RCVBUF; 0: the kernel autotunes")  \
    X(max_frame_bytes, (int64_t)1 << 40, NULL, "ceiling on any received frame's payload")           \
    X(handshake_ms, 5000, NULL, "deadline of one connection handshake (at least 100)")              \
    X(p2p_unexpected_bytes, (int64_t)256 << 20, NULL,                                               \
      "cap on buffered unmatched point-to-point frames per group")                                  \
    X(spin_yield, 1, "RINGLET_SPIN_YIELD",                                                          \
      "1: sched_yield between polls; init() sets 1 only when a machine's ranks outnumber its CPUs")\
    X(busy_block, 1, "RINGLET_BUSY_BLOCK",                                                          \
      "1: skip the spin and block at once while other processes want this host's CPUs")             \
    X(host_ranks, 0, NULL,                                                                          \
      "ranks of the job on this machine, which the busy test does not count as load (init() sets it)")\
    X(own_cpus, 0, NULL,                                                                            \
      "1: this rank runs on CPUs no other rank of its machine runs on (init() sets it when it "     \
      "binds the rank, or finds that a launcher bound the machine's ranks to disjoint CPUs)")                \
    X(bulk_recv_bytes, 16 << 20, "RINGLET_BULK_RECV_BYTES",                                         \
      "2-rank broadcast or p2p receive of at least this wakes once per segment; 0: never")          \
    X(local_reno, 1, "RINGLET_LOCAL_RENO",                                                          \
      "1: same-host connections use Reno congestion control (no pacing); 0: the system's")          \
    X(trace_entries, 2000, "RINGLET_TRACE_ENTRIES",                                                 \
      "flight recorder: ops kept per communicator, read when one is created; 0: off")               \
    X(shm_chunk_bytes, 256 << 10, "RINGLET_SHM_CHUNK_BYTES",                                        \
      "shared memory: bytes a rank stages per step (two buffers each; at least 4096)")              \
    X(shm_small_bytes, 16 << 10, "RINGLET_SHM_SMALL_BYTES",                                         \
      "shared memory: up to this, all_reduce and reduce (of 3 ranks or more: up to a medium "       \
      "slot) read every rank's whole slot")                                                         \
    X(shm_spin, 4000, "RINGLET_SHM_SPIN",                                                           \
      "shared memory: polls of a flag before sleeping on its futex")                                \
    X(shm_busy_poll_us, 250, "RINGLET_SHM_BUSY_POLL_US",                                            \
      "shared memory: while other processes want this host's CPUs, a rank on CPUs of its own "      \
      "(own_cpus) polls a flag this long, without yielding, before sleeping; 0: the first few "     \
      "microseconds only, as ranks that share CPUs do")                                             \
    X(shm_slots, 64, "RINGLET_SHM_SLOTS",                                                           \
      "shared memory: small-message slots per rank (a power of two up to 128; below 2: none), so a "          \
      "broadcast root or reduce leaf runs that many ops ahead")                                     \
    X(shm_slot_bytes, 4096, "RINGLET_SHM_SLOT_BYTES",                                               \
      "shared memory: payload of one small-message slot (at most 1 MiB)")                           \
    X(shm_mid_slots, 16, "RINGLET_SHM_MID_SLOTS",                                                   \
      "shared memory: medium slots per rank (a power of two up to 64; below 2: none) for a "         \
      "broadcast, scatter or gather larger than a small slot and at most one chunk, or a reduce "   \
      "of 2 ranks up to one chunk (more ranks: up to one medium slot), so its root (scatter, "       \
      "broadcast) or leaves (gather, reduce) run that many steps ahead")                            \
    X(shm_mid_slot_bytes, 64 << 10, "RINGLET_SHM_MID_SLOT_BYTES",                                   \
      "shared memory: payload of one medium slot (at most 1 MiB)")                                  \
    X(shm_p2p_cells, 32, "RINGLET_SHM_P2P_CELLS",                                                   \
      "shared memory: 8 KiB cells per ordered pair of ranks for point-to-point messages (a power "  \
      "of two; below 2: point-to-point stays on TCP)")                                              \
    X(shm_cma_bytes, 64 << 10, "RINGLET_SHM_CMA_BYTES",                                             \
      "shared memory: all_to_all blocks of at least this many bytes and larger than "              \
      "shm_chunk_bytes beyond 2 ranks (2 ranks: shm_cma_pair_bytes; all_gather: beyond 2 ranks "    \
      "blocks larger than two chunks, each rank writing its block into its peers' outputs; "        \
      "scatter: beyond 2 ranks also larger than "                                                   \
      "shm_chunk_bytes; a 2-rank "                                                                  \
      "broadcast: "                                                                                 \
      "from twice this, the root writing half into the reader; gather: also larger than "           \
      "shm_chunk_bytes beyond 2 ranks, each leaf writing its block into the root's output; "        \
      "reduce_scatter and reduce: blocks larger than "                                              \
      "shm_chunk_bytes, when every rank's input lies in huge pages or within shm_cma_any_bytes, "   \
      "a reduce's leaves writing their results into the root's buffer; "                            \
      "a point-to-point message: also larger than its ring, as shm_p2p_direct allows) "             \
      "are read straight from the peer's buffer "                                                   \
      "(process_vm_readv, one copy instead of two); 0: never")                                      \
    X(shm_cma_pair_bytes, 8 << 10, "RINGLET_SHM_CMA_PAIR_BYTES",                                    \
      "shared memory: in 2-rank groups all_gather and all_to_all blocks of at least this many "     \
      "bytes (and of more than one small slot) are read straight from the peer, when "              \
      "shm_cma_bytes is not 0; 0: from shm_cma_bytes as in larger groups")                          \
    X(shm_cma_all_reduce_bytes, 32 << 20, "RINGLET_SHM_CMA_ALL_REDUCE_BYTES",                      \
      "shared memory: an all_reduce of at most this many bytes (any size while the host "          \
      "is busy, by the busy_block test) whose blocks a reduce would read straight from the "       \
      "peers does so too, each rank writing its block's result into every peer; 0: never")         \
    X(shm_cma_any_bytes, 4 << 20, "RINGLET_SHM_CMA_ANY_BYTES",                                      \
      "shared memory: up to this, an idle point-to-point "                                          \
      "message beyond twice its ring and a reduce_scatter's input are read straight from the "      \
      "peer's buffer "                                                                              \
      "whatever its pages; beyond, only from huge pages; 0: only from huge pages")                  \
    X(shm_p2p_direct, 1, "RINGLET_SHM_P2P_DIRECT",                                                  \
      "shared memory: when a point-to-point message larger than its ring is read straight from "    \
      "the sender (single copy): 0 never, 1 while other processes want this host's CPUs (the "      \
      "busy_block test), when most of the sender's buffer lies in huge pages or when it is at "     \
      "most shm_cma_any_bytes (else an idle host copies through the ring on both cores), 2 "        \
      "always")                                                                                     \
    X(shm_p2p_split, 1, "RINGLET_SHM_P2P_SPLIT",                                                    \
      "shared memory: a point-to-point message read straight from the sender is split: 1 the "      \
      "receiver reads chunks of the sender's buffer while the sender writes others into the "       \
      "receiver's (both cores copy), 0 the receiver reads it all (the sender's choice)")

typedef struct {
#define RL_KNOB_FIELD(name, def, env, doc) int64_t name;
    RL_TUNING_KNOBS(RL_KNOB_FIELD)
#undef RL_KNOB_FIELD
} rl_tuning;

/* The table as data, for bindings: rl_nknobs entries in declaration order. */
typedef struct {
    const char *name;
    const char *env; /* NULL: set only through rl_set_tuning */
    int64_t default_value;
    size_t offset; /* of the int64_t field within rl_tuning */
    const char *doc;
} rl_knob;
extern const rl_knob rl_knobs[];
extern const int rl_nknobs;

/* Nonzero while the wait policy sees a busy host (other processes want its
 * CPUs; wait.c), with the busy_block knob on: then waiters block at once.
 * Measured over 100 ms windows; does not block. */
int rl_host_busy(void);
/* Bytes of [p, p + len) that lie in huge pages (transparent or hugetlb), as
 * the kernel's page tables say now (PAGEMAP_SCAN, Linux 6.7); -1 where the
 * kernel cannot tell. */
int64_t rl_huge_page_bytes(const void *p, size_t len);
/* Nanoseconds a cache line takes to go from CPU cpu_a to cpu_b and back (the
 * best of five batches of iters round trips, two pinned threads); -1 where
 * the CPUs cannot be used or timeout_ms passed.  Blocks the caller. */
double rl_core_roundtrip_ns(int cpu_a, int cpu_b, int iters, int64_t timeout_ms);
/* The pids of this host's ranks (this process included), whose CPU time the
 * busy test does not count as load; n = 0 forgets them (the host then
 * counts as idle). */
void rl_set_host_pids(const int *pids, int n);
/* Cores that processes other than this host's ranks used in the busy test's
 * last window (samples first, as rl_host_busy); -1 before a window ends. */
double rl_host_others(void);

void rl_tuning_defaults(rl_tuning *t);
void rl_set_tuning(const rl_tuning *t);
void rl_get_tuning(rl_tuning *t);

/* Interrupt hook: called about every 100 ms while a call is blocked, without
 * any ringlet lock held.  A nonzero return aborts the call with
 * RL_ERR_INTERRUPTED (and poisons the comm).  Set once per process. */
typedef int (*rl_interrupt_fn)(void);
void rl_set_interrupt_hook(rl_interrupt_fn fn);

/* ---- context: listener, endpoints, secret (transport.c) -------------- */
typedef struct rl_ctx rl_ctx;
typedef struct rl_comm rl_comm;

/* Create a context for world rank `rank` of `size`, listening on bind_host
 * (numeric IPv4/IPv6 address) port 0.  The secret keys the HMAC handshake;
 * job_id (16 bytes) binds it to this job.  Starts the listener thread. */
int rl_ctx_create(rl_ctx **out, int rank, int size, const char *bind_host,
                  const uint8_t *secret, size_t secret_len,
                  const uint8_t job_id[16], rl_error *err);
/* The port the listener bound. */
int rl_ctx_port(const rl_ctx *ctx);
/* Record the endpoint of world rank `rank` (numeric host, port). */
int rl_ctx_set_peer(rl_ctx *ctx, int rank, const char *host, int port);
/* Stop the listener, close every pending connection, free.  Comms created
 * from ctx must be destroyed first. */
void rl_ctx_destroy(rl_ctx *ctx);
/* Number of connections the listener refused (bad magic, wrong secret,
 * duplicate claims, garbage).  For tests and diagnostics. */
int64_t rl_ctx_rejected(const rl_ctx *ctx);

/* ---- communicators ---------------------------------------------------- */
/* A communicator of `size` ranks; this process is comm rank `rank`;
 * world_ranks[i] is the world rank of comm rank i (copied).  comm_id must be
 * the same on every member and unique in the job.  No connection is opened
 * here: the lower comm rank of a pair connects when the pair first talks. */
int rl_comm_create(rl_comm **out, rl_ctx *ctx, uint32_t comm_id, int rank,
                   int size, const int *world_ranks, rl_error *err);
void rl_comm_destroy(rl_comm *c);
/* Poison the comm with `reason`, send an ABORT frame to every connected
 * peer (best effort, non-blocking) and close the connections, so peers
 * blocked on this rank fail fast.  Idempotent. */
void rl_comm_abort(rl_comm *c, int status, const char *reason);
/* Poison the comm from ANY thread (e.g. a watcher that learned another rank
 * failed) and shut its sockets down so a call blocked in it returns at once.
 * Sends nothing: another thread may be in the middle of a frame. */
void rl_comm_cancel(rl_comm *c, int status, const char *reason);
const rl_error *rl_comm_error(const rl_comm *c);
uint64_t rl_comm_seq(const rl_comm *c);
/* Open (or wait for) the connection to comm rank `peer` now. */
int rl_comm_connect(rl_comm *c, int peer, int64_t timeout_ms);
/* Which host each comm rank runs on: host_of[i] in [0, size) for comm rank i,
 * the same table on every member (equal numbers: one host).  TCP trees that
 * know the hosts send one copy over each host's link (bcast.c).  Call before
 * the comm's first collective; without it every rank counts as one host.
 * RL_ERR_INVALID for a number out of range. */
int rl_comm_set_hosts(rl_comm *c, const int *host_of);
/* The number of hosts rl_comm_set_hosts was given (0: never set). */
int rl_comm_num_hosts(const rl_comm *c);

/* ---- shared memory (shm.c) ------------------------------------------ */
/* Ranks of one comm on one host can share a segment (a memfd that the
 * binding creates and hands over); collectives then run over it instead of
 * TCP, and a point-to-point comm's messages over a
 * segment of rings (rl_comm_attach_shm_p2p).
 * Bytes of the segment for a comm of nranks ranks (from the knobs now). */
size_t rl_shm_segment_bytes(int nranks);
/* The same for a point-to-point comm; 0 when it gets none (more than 8
 * ranks: its rings grow with nranks^2, or the shm_p2p_cells knob is 0). */
size_t rl_shm_p2p_segment_bytes(int nranks);
/* Map fd (size bytes) as this comm's segment.  create: this rank lays the
 * segment out (rank 0, before handing fd to the others); else the layout is
 * checked against the comm.  Records this rank's pid and counts it attached;
 * the caller may close fd afterwards.  Does not block. */
int rl_comm_attach_shm(rl_comm *c, int fd, size_t size, int create, rl_error *err);
/* The same for a comm that carries only point-to-point messages. */
int rl_comm_attach_shm_p2p(rl_comm *c, int fd, size_t size, int create, rl_error *err);
/* Wait (deadline-bounded) until every rank of the comm has attached, then
 * watch the peers' processes (pidfd) so a killed peer fails waiters fast,
 * and wait until every rank watches.  Its errors read "shared-memory set-up
 * timed out" (or "failed") and name the ranks still awaited; a timeout's
 * peer is the lowest of them. */
int rl_comm_shm_ready(rl_comm *c, int64_t timeout_ms);
/* 1 when collectives of c run over shared memory. */
int rl_comm_uses_shm(const rl_comm *c);
/* Over shared memory: the block size from which ops copy straight between
 * processes (process_vm_readv), 0 when off.  Off because a rank's set-up
 * probe failed: *rank is that comm rank, *peer the one it could not read and
 * *err the read's errno (0: it read another word); else all three -1, -1, 0. */
int64_t rl_comm_shm_single_copy(const rl_comm *c, int *rank, int *peer, int *err);
/* Declare process `pid` (and so its descendants) allowed to read this process's
 * memory under Yama's ptrace_scope 1 (prctl PR_SET_PTRACER; 0 undeclares).
 * 0, or the errno: EINVAL where Yama is absent or pid does not exist. */
int rl_shm_set_ptracer(long pid);

/* ---- collectives (algorithms in allreduce.c, bcast.c, ...) ----------- */
/* All buffers are contiguous.  `count` is in elements of dt. */
int rl_all_reduce(rl_comm *c, void *buf, size_t count, rl_dtype dt,
                  rl_redop op, int64_t timeout_ms);
int rl_broadcast(rl_comm *c, void *buf, size_t count, rl_dtype dt, int root,
                 int64_t timeout_ms);
/* The result lands in buf on root; other ranks' buf is left unchanged. */
int rl_reduce(rl_comm *c, void *buf, size_t count, rl_dtype dt, rl_redop op,
              int root, int64_t timeout_ms);
/* out holds size*count elements in rank order; in holds count (may point at
 * this rank's slot of out). */
int rl_all_gather(rl_comm *c, void *out, const void *in, size_t count,
                  rl_dtype dt, int64_t timeout_ms);
/* in holds size*count elements (left unchanged); out receives this rank's
 * reduced chunk of count elements. */
int rl_reduce_scatter(rl_comm *c, void *out, const void *in, size_t count,
                      rl_dtype dt, rl_redop op, int64_t timeout_ms);
/* Per-peer element counts and displacements (in elements).  Over the comm's
 * segment where it has one and in and out do not overlap, else pairwise over
 * TCP. */
int rl_all_to_all_v(rl_comm *c, void *out, const size_t *out_counts,
                    const size_t *out_displs, const void *in,
                    const size_t *in_counts, const size_t *in_displs,
                    rl_dtype dt, int64_t timeout_ms);
/* out holds rank p's counts[p] elements at displs[p] (elements); in holds this
 * rank's counts[rank].  Over the comm's segment where it has one, else
 * pairwise over TCP.  in may be this rank's block of out, and overlap no other. */
int rl_all_gather_v(rl_comm *c, void *out, const size_t *counts, const size_t *displs,
                    const void *in, rl_dtype dt, int64_t timeout_ms);
/* Equal blocks of count elements per peer (in and out hold size*count, must
 * not overlap).  Small messages take Bruck's algorithm, others the pairwise
 * exchange of rl_all_to_all_v. */
int rl_all_to_all(rl_comm *c, void *out, const void *in, size_t count, rl_dtype dt,
                  int64_t timeout_ms);
/* out (size*count elements) is used on root only. */
int rl_gather(rl_comm *c, void *out, const void *in, size_t count,
              rl_dtype dt, int root, int64_t timeout_ms);
/* in (size*count elements) is used on root only. */
int rl_scatter(rl_comm *c, void *out, const void *in, size_t count,
               rl_dtype dt, int root, int64_t timeout_ms);
/* Uneven blocks (MPI's Gatherv / Scatterv): on root, rank p's block is
 * counts[p] elements at displs[p] of out (gather) or in (scatter), and
 * counts[root] must equal count; elsewhere counts and displs are unused and
 * may be NULL, and the rank's block is its count elements. */
int rl_gather_v(rl_comm *c, void *out, const size_t *counts, const size_t *displs,
                const void *in, size_t count, rl_dtype dt, int root, int64_t timeout_ms);
int rl_scatter_v(rl_comm *c, void *out, size_t count, const void *in, const size_t *counts,
                 const size_t *displs, rl_dtype dt, int root, int64_t timeout_ms);
int rl_barrier(rl_comm *c, int64_t timeout_ms);

/* ---- point to point (p2p.c) ------------------------------------------- */
/* Frames are matched on (source, tag) in send order; a frame with another
 * tag is buffered (up to rl_tuning.p2p_unexpected_bytes) until asked for. */
int rl_send(rl_comm *c, const void *buf, size_t count, rl_dtype dt, int dst,
            uint32_t tag, int64_t timeout_ms);
int rl_recv(rl_comm *c, void *buf, size_t count, rl_dtype dt, int src,
            uint32_t tag, int64_t timeout_ms);
/* The first message carrying tag from any peer; *src gets its sender.  Per
 * sender, messages still match in send order.  A peer that closed or died
 * fails it, as does any peer's abort.  One runs at a time per comm. */
int rl_recv_any(rl_comm *c, void *buf, size_t count, rl_dtype dt, uint32_t tag,
                int64_t timeout_ms, int *src);

/* ---- flight recorder (flight.c) ------------------------------------- */
/* Every comm keeps its last rl_tuning.trace_entries operations: written by
 * the calling thread at the start and end of each op (no lock), read by
 * rl_comm_trace from any thread, also while an op is blocked. */
typedef enum {
    RL_TRACE_STARTED = 1,   /* entered, not finished (blocked, or running) */
    RL_TRACE_COMPLETED = 2,
    RL_TRACE_FAILED = 3     /* `status` says why                           */
} rl_trace_state;
#define RL_TRACE_RECV 1u    /* flags: a p2p receive (else a send)          */

typedef struct {
    uint64_t id;       /* 0, 1, 2, ...: position in the comm's history     */
    uint64_t seq;      /* the op's sequence number (p2p: 0)                */
    uint64_t bytes;    /* the op's byte count as in its frame headers      */
    int64_t start_ns;  /* CLOCK_MONOTONIC                                  */
    int64_t end_ns;    /* 0 while started                                  */
    int32_t peer;      /* root of rooted ops, peer of p2p, else -1         */
    uint32_t tag;      /* p2p tag                                          */
    uint8_t opcode, dtype, redop, flags;
    uint8_t state;     /* rl_trace_state                                   */
    uint8_t status;    /* rl_status of a failed op                         */
    uint8_t pad_[2];
    const char *algo;  /* the algorithm that ran (static string), or NULL  */
} rl_trace_entry;

/* Copy the comm's recorded ops, oldest first, into out (at most max);
 * returns how many.  *total (optional) receives the number of ops ever
 * recorded, so total - returned were dropped by the ring.  An entry that a
 * thread is overwriting at that moment is left out.  Takes no lock: safe
 * from an interrupt hook while this comm is blocked. */
size_t rl_comm_trace(const rl_comm *c, rl_trace_entry *out, size_t max,
                     uint64_t *total);
/* How many ops the comm keeps (its trace_entries when it was created). */
size_t rl_comm_trace_capacity(const rl_comm *c);

/* ---- diagnostics log (flight.c) ------------------------------------- */
/* 0: silent, 1: INFO (connections), 2: DETAIL (also every op's end with
 * its algorithm).  Lines go to stderr, prefixed "ringlet[rank R] LEVEL:". */
void rl_set_log_level(int level);

#ifdef __cplusplus
}
#endif
#endif /* RINGLET_H */
