/*
 * internal.h - structures shared by the C files of the core; not installed.
 */
#ifndef RINGLET_INTERNAL_H
#define RINGLET_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <sys/uio.h>

#include "ringlet.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ringlet's wire format is little-endian; big-endian hosts are not supported"
#endif

#define RL_MAGIC 0x31544c52u /* "RLT1" */
#define RL_HANDSHAKE_MAGIC 0x48544c52u /* "RLTH" */
#define RL_ABORT_REASON_MAX 512
#define RL_HOST_MAX 64
/* Own blocks of at least this many bytes are copied, and reduce_scatter
 * outputs (and 2-rank all_gather receives, and a shared-memory scatter
 * root's own block) of at least RL_STREAM_OUT_MIN written, with non-temporal
 * stores (rl_copy_stream): the op does not read them again. */
#define RL_STREAM_COPY_MIN ((size_t)4 << 20)
#define RL_STREAM_OUT_MIN ((size_t)16 << 20)

/* Every frame starts with this 48-byte header, then `nbytes` of payload.
 * The receiver always knows what it expects and compares field by field
 * (rl_check_header), so a peer in another op, dtype, size, root or step
 * is reported at the first frame instead of corrupting data. */
typedef struct {
    uint32_t magic;
    uint8_t version;
    uint8_t opcode;
    uint8_t dtype;
    uint8_t redop;
    uint32_t comm_id;
    int32_t root;    /* root of rooted ops, else -1                          */
    uint64_t seq;    /* per-comm op sequence number (p2p: per-peer counter)  */
    uint64_t total;  /* op-level byte count as the sender sees it (0: n/a)   */
    uint64_t nbytes; /* payload bytes of this frame                           */
    uint32_t tag;    /* segment index (collectives) or user tag (p2p)        */
    uint32_t flags;  /* ABORT: the rl_status that caused it                   */
} rl_hdr;

_Static_assert(sizeof(rl_hdr) == 48, "frame header must be 48 bytes");

typedef struct {
    char host[RL_HOST_MAX];
    int port;
} rl_endpoint;

/* A connection the listener authenticated, waiting for its comm to claim it. */
typedef struct rl_pending_conn {
    uint32_t comm_id;
    int src; /* world rank */
    int fd;
    struct rl_pending_conn *next;
} rl_pending_conn;

struct rl_ctx {
    int rank, size;
    int listen_fd;
    int port;
    int wake_pipe[2];
    pthread_t thread;
    int thread_started;
    uint8_t key[32]; /* HMAC key: SHA-256 of the secret */
    uint8_t job_id[16];
    rl_endpoint *peers;
    /* Handshakes the listener runs at once: 256, and no more than an eighth
     * of RLIMIT_NOFILE (at least 16), as the store (docs/security.md). */
    int max_pending;

    pthread_mutex_t lock; /* guards everything below */
    pthread_cond_t cond;  /* on CLOCK_MONOTONIC */
    rl_pending_conn *mailbox;
    uint64_t *claimed; /* (comm_id << 32 | src) of every delivered connection */
    size_t nclaimed, capclaimed;
    int64_t rejected;
    int stopping;
    int listener_errno; /* nonzero once the listener thread stopped on this error */
};

typedef struct rl_unexpected {
    uint32_t tag;
    uint8_t dtype;
    uint64_t nbytes;
    char *data;
    const char *algo; /* how the message came (the receive that takes it reports it) */
    struct rl_unexpected *next;
} rl_unexpected;

struct rl_comm {
    rl_ctx *ctx;
    uint32_t id;
    int rank, size;
    int *world; /* comm rank -> world rank */
    int *fds;   /* comm rank -> socket, -1 until connected */
    pthread_mutex_t *peer_locks; /* serialises connection set-up per peer */
    uint64_t seq;
    /* The last rooted collective (see rl_note_rooted). */
    uint64_t rooted_seq;
    int rooted_op, rooted_root;

    pthread_mutex_t err_lock;
    /* Held by a collective from rl_begin_op to rl_end_op: the sequence
     * numbers, steps and scratch below are one op's at a time. */
    pthread_mutex_t op_lock;
    volatile int poisoned;
    rl_error err;

    /* point to point */
    pthread_mutex_t *send_locks, *recv_locks;
    uint64_t *p2p_send_seq, *p2p_recv_seq;
    rl_unexpected **unexpected;
    uint64_t unexpected_bytes;
    /* receives from any source (p2p.c): one at a time (any_lock); while one
     * waits (any_waiting), a receive that releases a peer's lock wakes it
     * through the segment's bell or, over TCP, any_efd (an eventfd, made by
     * the first such receive) */
    pthread_mutex_t any_lock;
    int any_waiting, any_efd, any_next;

    /* scratch for algorithms that need a staging area (grown on demand;
     * page-aligned, scratch_len usable bytes after any in-page offset) */
    char *scratch;
    size_t scratch_len;

    /* flight recorder (flight.c): a ring of trace_mask + 1 entries (a power
     * of two), of which the newest trace_keep are reported; trace_head
     * counts every op ever recorded. */
    rl_trace_entry *trace;
    uint64_t trace_mask, trace_keep;
    uint64_t trace_head;

    /* shared-memory transport (shm.c), NULL when the comm runs over TCP */
    struct rl_shm *shm;

    /* rl_comm_set_hosts (NULL and 0 until set): hosts numbered 0..nhosts-1
     * in order of their lowest comm rank; host_of: comm rank -> host;
     * host_rank[host_off[h] + i]: host h's i-th rank in comm rank order;
     * local_idx: comm rank -> its i there (one allocation, host_of first) */
    int *host_of, *host_off, *host_rank, *local_idx;
    int nhosts;
};

/* What the running operation is; used to build and check headers and to
 * write error messages. */
typedef struct {
    int opcode;
    int dtype;
    int redop;
    int root;
    uint64_t seq;
    uint64_t total;
    int64_t deadline_ns; /* CLOCK_MONOTONIC */
    int64_t start_ns;
    int locked;              /* holds the comm's op_lock                    */
    const char *algo;        /* set by the algorithm chosen, for the record */
    rl_trace_entry *trace;   /* this op's flight-recorder entry, or NULL    */
    uint64_t trace_id;
} rl_opdesc;

/* A stream is an ordered sequence of frames to or from one peer.  An
 * algorithm describes its data movement as a few streams plus callbacks; the
 * engine (engine.c) drives all of them concurrently with non-blocking I/O,
 * so a rank sends to one peer while receiving from another. */
typedef struct rl_stream rl_stream;
struct rl_stream {
    int peer;     /* comm rank */
    int is_send;
    int nseg;     /* frames in this stream */
    uint32_t tag_base; /* frame i carries tag tag_base + i */
    /* May frame `seg` start now?  NULL = always. */
    int (*ready)(void *alg, rl_stream *s, int seg);
    /* Where frame `seg`'s payload lives (send) or lands (recv). */
    void (*where)(void *alg, rl_stream *s, int seg, char **ptr, size_t *len);
    /* Called once frame `seg` is fully sent / received.  NULL = nothing. */
    int (*done)(void *alg, rl_stream *s, int seg);
    /* Nonzero: the byte count this stream's headers carry (send) or must
     * carry (recv) in place of op->total; all_to_all_v's pairs differ. */
    uint64_t total;
    /* Nonzero (recv streams): the peer does nothing but send this stream,
     * so this rank may take it in bulk (engine.c, "Bulk receive"). */
    int bulk;
    /* engine state */
    int fd;
    int cur;
    int active;
    size_t off; /* bytes of header+payload moved for the current frame */
    size_t lowat; /* SO_RCVLOWAT the engine set on fd (0: the default) */
    char *ptr;
    size_t len;
    rl_hdr hdr;
};

/* ---- time ---- */
int64_t rl_now_ns(void);
int64_t rl_deadline_ns(int64_t timeout_ms);
/* The same deadline counted from a clock reading the caller already has. */
int64_t rl_deadline_from(int64_t now_ns, int64_t timeout_ms);

/* ---- errors (transport.c) ---- */
/* Record the first error on the comm (later ones are ignored) and return
 * `status`.  Formats "rank R: <op> seq=S: <message>". */
int rl_fail(rl_comm *c, const rl_opdesc *op, int status, int peer,
            int sys_errno, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
int rl_begin_op(rl_comm *c, rl_opdesc *op, int opcode, int dtype, int redop,
                int root, uint64_t total, int64_t timeout_ms);
/* Close op's flight-recorder entry; abort peers and poison after a failed
 * op.  Every op that rl_begin_op started ends here.  Returns status. */
int rl_end_op(rl_comm *c, const rl_opdesc *op, int status);
const char *rl_peer_host(const rl_comm *c, int peer, int *port);

/* ---- connections (transport.c) ---- */
int rl_peer_fd(rl_comm *c, const rl_opdesc *op, int peer, int *fd_out);
/* The peer's socket if connected, or taken now from the listener's mailbox
 * when the peer dialled; -1 otherwise.  Never waits. */
int rl_peer_fd_try(rl_comm *c, int peer);
/* RL_OK while this rank's listener thread runs; once it stopped on an error
 * (no peer can dial this rank any more), fails the op with that error. */
int rl_listener_check(rl_comm *c, const rl_opdesc *op);
/* Wake a receive from any source waiting on c (p2p.c). */
void rl_p2p_wake_any(rl_comm *c);

/* ---- engine (engine.c) ---- */
int rl_run_streams(rl_comm *c, const rl_opdesc *op, rl_stream *s, int n,
                   void *alg);
/* A local copy (a rank's own block) that the engine performs in slices
 * whenever no socket can move, and finishes before it returns: the copy
 * then overlaps the transfers instead of delaying them.  Neither range may
 * overlap a buffer that a stream reads or writes. */
typedef struct {
    char *dst;
    const char *src;
    size_t len, done;
} rl_idle_copy;
int rl_run_streams_copy(rl_comm *c, const rl_opdesc *op, rl_stream *s, int n,
                        void *alg, rl_idle_copy *cp);
/* Whether [a, a+al) and [b, b+bl) share a byte. */
int rl_overlap(const void *a, size_t al, const void *b, size_t bl);
/* Blocking helpers for p2p, on top of the same wait policy. */
int rl_send_frame(rl_comm *c, const rl_opdesc *op, int peer, rl_hdr *h,
                  const void *payload, size_t len);
int rl_recv_bytes(rl_comm *c, const rl_opdesc *op, int peer, void *buf,
                  size_t len);
/* Check a received header against what this rank expects. */
int rl_check_header(rl_comm *c, const rl_opdesc *op, int peer,
                    const rl_hdr *got, const rl_hdr *want);
/* "op(seq=.., dtype=.., ...)" of a header, as desync messages print it. */
void rl_describe_header(char *buf, size_t n, const rl_hdr *h);
/* Read the remainder of an ABORT frame and record it. */
int rl_handle_abort(rl_comm *c, const rl_opdesc *op, int peer, int fd,
                    const rl_hdr *h, const char *have, size_t nhave);
void rl_fill_header(rl_hdr *h, const rl_comm *c, const rl_opdesc *op,
                    uint32_t tag, uint64_t nbytes);

/* ---- helpers for algorithms ---- */
/* A staging area of len bytes for the running operation (contents not kept
 * between calls).  `near` is the user buffer it will be copied to and from,
 * or NULL: the area starts half a page away from near's offset within a
 * page (see transport.c). */
int rl_scratch(rl_comm *c, const rl_opdesc *op, size_t len, const void *near, char **out);
/* Building blocks shared between algorithm files (allreduce.c). */
int rl_exchange(rl_comm *c, const rl_opdesc *op, int to, const void *sbuf,
                int from, void *rbuf, size_t len, uint32_t tag);
/* The broadcast's tree (bcast.c): this rank's parent (-1 at the root) and
 * children, returned as their count: at most RL_TREE_KIDS_MAX (log2 of the
 * hosts plus log2 of a host's ranks, each at most 31). */
#define RL_TREE_KIDS_MAX 64
int rl_tree_shape(const rl_comm *c, size_t len, int root, int *parent, int *kids);
/* Recursive-doubling all-reduce of buf in place, under `op`'s header; uses
 * the comm's scratch. */
int rl_rd_all_reduce(rl_comm *c, const rl_opdesc *op, void *buf, size_t count,
                     rl_dtype dt, rl_redop rop);
/* Split count elements into `parts` near-equal blocks: block i has
 * count/parts elements, plus one for i < count%parts. */
/* Remember a rooted collective's seq, opcode and root.  Ranks that disagree
 * on the root of a broadcast or scatter can all return (each root only
 * sends); the frame left behind reaches the next collective, and its header
 * check then names both roots instead of only the peer's. */
void rl_shm_note_rooted(rl_comm *c);
static inline void rl_note_rooted(rl_comm *c, const rl_opdesc *op) {
    c->rooted_seq = op->seq;
    c->rooted_op = op->opcode;
    c->rooted_root = op->root;
    if (c->shm) rl_shm_note_rooted(c); /* peers over shared memory compare it */
}

static inline size_t rl_block_count(size_t count, int parts, int i) {
    size_t q = count / (size_t)parts, r = count % (size_t)parts;
    return q + ((size_t)i < r ? 1 : 0);
}
static inline size_t rl_block_start(size_t count, int parts, int i) {
    size_t q = count / (size_t)parts, r = count % (size_t)parts;
    return q * (size_t)i + ((size_t)i < r ? (size_t)i : r);
}
/* Number of segments a block of `bytes` is cut into (at least 1, so an
 * empty block still sends one header and stays in step). */
static inline int rl_nseg(size_t bytes, size_t seg) {
    if (bytes == 0) return 1;
    return (int)((bytes + seg - 1) / seg);
}
static inline int rl_mod(int a, int n) { int m = a % n; return m < 0 ? m + n : m; }

/* ---- shared memory (shm.c) ---- */
/* The op entry points hand a comm with a segment to these; each runs the
 * whole op (count > 0, size > 1) and returns its status. */
int rl_shm_all_reduce(rl_comm *c, rl_opdesc *op, void *buf, size_t count,
                      rl_dtype dt, rl_redop rop, int root);
int rl_shm_broadcast(rl_comm *c, rl_opdesc *op, void *buf, size_t len, int root);
int rl_shm_barrier(rl_comm *c, rl_opdesc *op);
int rl_shm_all_gather(rl_comm *c, rl_opdesc *op, void *out, const void *in,
                      size_t count, rl_dtype dt);
/* Uneven blocks (counts[q] elements at displs[q] of out), staged through the
 * segment's slots in pieces of the lane, as many steps as the largest block. */
int rl_shm_all_gather_v(rl_comm *c, rl_opdesc *op, void *out, const size_t *counts,
                        const size_t *displs, const void *in, rl_dtype dt);
int rl_shm_reduce_scatter(rl_comm *c, rl_opdesc *op, void *out, const void *in,
                          size_t count, rl_dtype dt, rl_redop rop);
int rl_shm_rooted(rl_comm *c, rl_opdesc *op, int gather, void *many, void *one, size_t blk,
                  int root);
/* gather_v / scatter_v: counts and displs (elements) are read on the root only;
 * n_own is this rank's block in bytes. */
int rl_shm_rooted_v(rl_comm *c, rl_opdesc *op, int gather, void *many, const size_t *counts,
                    const size_t *displs, void *one, size_t n_own, size_t esz, int root);
int rl_shm_all_to_all(rl_comm *c, rl_opdesc *op, void *out, const void *in, size_t blk);
int rl_shm_all_to_all_v(rl_comm *c, rl_opdesc *op, void *out, const size_t *out_counts,
                        const size_t *out_displs, const void *in, const size_t *in_counts,
                        const size_t *in_displs, rl_dtype dt);
/* Point to point over a SHM_P2P segment (p2p.c holds the comm's locks). */
int rl_shm_send_frame(rl_comm *c, rl_opdesc *op, int dst, const rl_hdr *h,
                      const void *buf, size_t len);
int rl_shm_recv_header(rl_comm *c, const rl_opdesc *op, int src, rl_hdr *h);
int rl_shm_recv_body(rl_comm *c, rl_opdesc *op, int src, void *buf, size_t len);
/* Receives from any source: whether src's ring holds a message for this
 * rank; the bell's count (read before looking at the rings); a wait until a
 * ring not in skip may hold one or the bell moved past `bell`, bounded by
 * the op's deadline; a failed or departed peer fails it. */
int rl_shm_p2p_ready(rl_comm *c, int src);
uint32_t rl_shm_bell(rl_comm *c);
int rl_shm_wait_any(rl_comm *c, const rl_opdesc *op, const unsigned char *skip, uint32_t bell);
/* Publish c's error in the segment and wake every waiter (rl_comm_abort);
 * wake this rank's waiters only (rl_comm_cancel); unmap (rl_comm_destroy). */
void rl_shm_abort(rl_comm *c);
void rl_shm_wake_all(rl_comm *c);
void rl_shm_detach(rl_comm *c);

/* ---- flight recorder and log (flight.c) ---- */
/* Allocate / free the comm's ring (size from rl_tune.trace_entries). */
int rl_trace_init(rl_comm *c);
void rl_trace_free(rl_comm *c);
/* Open an entry for op (from rl_begin_op) / close it (from rl_end_op). */
void rl_trace_begin(rl_comm *c, rl_opdesc *op);
void rl_trace_end(rl_comm *c, const rl_opdesc *op, int status);
/* Record the peer, tag and direction of a p2p op in its entry. */
void rl_trace_p2p(const rl_opdesc *op, int peer, uint32_t tag, int recv);
extern int rl_log_level;
void rl_log(int level, const rl_comm *c, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define RL_LOG_INFO 1
#define RL_LOG_DETAIL 2

extern rl_tuning rl_tune;

/* ---- wait policy (wait.c) ---- */
/* Nonzero while other processes want the host's CPUs (and the busy_block
 * knob is on): a waiter should block instead of spinning.  Cheap
 * between samples (two atomic loads); `now_ns` is rl_now_ns(). */
int rl_host_contended(int64_t now_ns);
int rl_call_interrupt_hook(void);

#endif
