/*
 * shm.c - the shared-memory transport: collectives of a comm whose ranks
 * share a host, over one segment that every rank maps.
 *
 * Segment (laid out by comm rank 0; docs/algorithms.md, "Shared memory"):
 *   header page   magic, layout, attach count, the abort record, the bell
 *   control       one 256-byte block per rank: its step flags (in, out, ack),
 *                 closed mark, pid and process start time, last rooted op,
 *                 and the descriptors of its two buffers
 *   data          two buffers per rank (steps alternate between them), each
 *                 an input area of `chunk` bytes and a result area of
 *                 chunk/P bytes
 *
 * Steps.  Every op is a fixed sequence of steps, the same on every rank, so
 * all ranks number steps alike (1, 2, ...: rl_shm.step, one count per lane,
 * "Steps and lanes" below).  Step s of the big lane uses buffer s & 1.  A rank that writes its buffer for step s first waits until
 * every rank's `ack` reached s - 2 (all finished reading the step that used
 * that buffer last), writes the data and the buffer's descriptor, then
 * release-stores s into its `in` flag.  Readers wait for `in` >= s, compare
 * the descriptor with their own (a desync names both sides, as over TCP),
 * read, and store s into their own `ack`.  `out` marks a result area ready.
 * Flags are 32-bit and compared modulo 2^32: ranks are never more than two
 * steps apart.
 *
 * Waiting.  A reader polls the flag up to rl_tune.shm_spin times (only
 * the first few microseconds' worth while other processes keep the host
 * busy, as wait.c tells; after
 * the first few microseconds yielding the core every 64 polls, and sooner
 * when rl_tune.spin_yield says ranks outnumber cores: at every one of the
 * first polls of an op up to a chunk), then sleeps on the
 * segment's bell with FUTEX_WAIT in slices of at most 50 ms.  It counts
 * itself first in the `waiters` of the rank that writes the flag; that rank
 * rings the bell (bump + FUTEX_WAKE) when it publishes only while its count
 * is nonzero, so the fast path makes no system call.
 * Aborts, closes and attaches ring it too.  Before each sleep it checks the
 * abort record, peers that closed or died (pidfds), the op's deadline and
 * the interrupt hook.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define SHM_MAGIC 0x4d48534cu /* "LSHM" */
#define SHM_VERSION 9u
#define SHM_MAX_RANKS 1024
#define SHM_PAGE ((size_t)4096)
#define SHM_SLICE_NS 50000000LL
#define SHM_SPIN_HOT 512
#define SHM_YIELD_LOST_NS 50000
#define SHM_YIELD_FIRST 64
/* wait_copy polls for a peer's single copy at up to this rate's time, and
 * at most this long: beyond, a wake-up is small beside the copy. */
#define SHM_COPY_BYTES_PER_NS 5
#define SHM_COPY_SPIN_MAX_NS 2000000LL
#define SHM_SLOT_HDR ((size_t)64) /* a slot's descriptor, then its payload */
#define SHM_LOG 256u /* op log entries per rank: more than a writer can run ahead */
#define SHM_COLL 0u
#define SHM_P2P 1u
#define SHM_CELL ((size_t)8192)    /* payload of one point-to-point cell */
#define SHM_P2P_MAX_RANKS 8        /* rings grow with P^2 */
#define SHM_FRAME_DIRECT 1u        /* rl_hdr.flags of a point-to-point frame: read the sender's buffer */
#define SHM_FRAME_SPLIT 2u         /* ... and the sender copies pieces of it too (send_direct) */

typedef struct {
    uint32_t magic, version;
    uint32_t nranks, comm_id;
    uint64_t size;       /* bytes of the segment                        */
    uint64_t chunk;      /* input area of one buffer                    */
    uint64_t result;     /* result area of one buffer                   */
    uint64_t stride;     /* bytes from one buffer to the next           */
    uint64_t small;      /* all_reduce up to this reads every whole slot */
    uint64_t data_off;   /* offset of rank 0's first buffer              */
    uint64_t slot_off;   /* offset of rank 0's first slot (small lane)    */
    uint64_t log_off;    /* offset of rank 0's op log                     */
    uint64_t slot_bytes; /* payload of one slot; 0: no small lane         */
    uint32_t slots;      /* slots per rank, a power of two                */
    uint32_t attached;   /* ranks that mapped the segment                */
    uint32_t kind;       /* SHM_COLL or SHM_P2P                            */
    uint32_t cells;      /* SHM_P2P: cells per ring, a power of two        */
    uint32_t watching;   /* ranks that opened a pidfd on every peer        */
    uint32_t cma_bytes;  /* single copy (process_vm_readv) from blocks of this
                            many bytes (shm_cma_bytes of rank 0); 0: never */
    uint32_t mid_slots;  /* medium slots per rank, a power of two; 0: none  */
    uint32_t cma_pair;   /* 2 ranks: all_gather and all_to_all single copy from
                            blocks of this many bytes (shm_cma_pair_bytes of rank 0) */
    uint64_t mid_bytes;  /* payload of one medium slot                     */
    uint64_t mid_off;    /* offset of rank 0's first medium slot           */
    /* The one futex word: every event a sleeper may wait for (a flag that a
     * publisher moved while someone slept, an abort, a close, an attach)
     * bumps it, so no wake-up is lost between a check and the sleep. */
    uint32_t bell __attribute__((aligned(64)));
    uint32_t sleepers; /* ranks sleeping on `bell` */
    uint32_t abort_claim; /* 0 -> 1 by the first rank to abort           */
    uint32_t abort_set;   /* 1 once the record below is complete         */
    int32_t abort_status, abort_rank;
    char abort_reason[RL_ABORT_REASON_MAX];
} shm_header;

typedef struct {
    /* line 0: written by the owner only */
    uint32_t in;     /* last step whose input (and descriptor) is published */
    uint32_t out;    /* last step whose result area is published            */
    uint32_t ack;    /* last step this rank finished reading                */
    uint32_t closed; /* 1: the owner destroyed its comm                     */
    int32_t pid;
    uint32_t watched; /* set-up: 1 once this rank watches every peer        */
    uint32_t m_ack;  /* medium lane: last step finished reading             */
    uint32_t pad_r[2];
    uint32_t s_ack;  /* small lane: last step finished reading              */
    uint32_t cma_ok; /* 1: this rank read every peer's probe; 2: it could not */
    uint32_t cma_why; /* cma_ok 2: the first peer it could not read << 16 | the
                         read's errno (0: the read worked but found another word) */
    /* Single copy: the address, in the owner's memory, of the input that
     * peers read directly for the big-lane step that uses buffer i (and of
     * its probe word during set-up). */
    uint64_t xaddr[2];
    /* line 1: written by other ranks, off the owner's flags' line */
    uint32_t waiters; /* ranks asleep on the bell waiting for one of this rank's flags */
    uint32_t pad2[15];
    /* lines 2-3: written by the owner in big-lane steps and rooted ops */
    rl_hdr desc[2];
    /* The owner's last rooted op: seq << 24 | opcode << 16 | root.  Ranks
     * that disagree on a root may all return from that op (the roots only
     * write); the next op's reader compares records and names both roots.
     * Off line 0, which the owner writes every step: readers of the record
     * then take no line that changes between ops that are not rooted. */
    uint64_t rooted;
    /* Who `pid` is, written with it at attach: the process's start time
     * (proc_start_time) and the inode numbers of its pid and time namespaces
     * (0: unknown).  A pid can be reused once its process is gone; these
     * cannot, so a rank that opens a pidfd on `pid` checks it got the peer. */
    uint64_t start;
    uint32_t pidns, timens;
    char pad3[8];
} shm_ctrl;

/* One entry of a rank's op log: the ops it entered lately, at seq % SHM_LOG
 * (a seqlock: odd `ver` while it is rewritten).  Read only before a sleep:
 * ranks in different lanes never meet at a flag, and a writer may have run
 * ops ahead, so a desync between them is found here. */
typedef struct {
    uint32_t ver;
    uint32_t pad;
    rl_hdr op;
    char pad2[8];
} shm_logent;

_Static_assert(sizeof(shm_logent) == 64, "shm op log entry must be 64 bytes");
_Static_assert(sizeof(shm_header) <= SHM_PAGE, "shm header must fit a page");
_Static_assert(sizeof(shm_ctrl) == 256, "shm control block must be 256 bytes");

/* The slots of a small or medium lane: per rank `slots` of a descriptor line
 * and `bytes` of payload, `stride` apart. */
typedef struct {
    char *base;
    size_t bytes, stride;
    uint32_t slots;
} shm_pool;

typedef struct rl_shm rl_shm;
struct rl_shm {
    char *base;
    size_t size;
    shm_header *hdr;
    shm_ctrl *ctrl;
    char *data;
    size_t chunk, result, stride, small;
    shm_logent *log;
    shm_pool pool[3]; /* per lane; the big lane's is unused */
    uint64_t step[3]; /* per lane; the segment's flags carry the low 32 bits */
    /* SHM_P2P: ring (s, d) carries messages from s to d */
    uint32_t kind, cells;
    char *rings;
    size_t ring_stride;
    /* per peer: cells this rank published / consumed; the peer's tail as last read */
    uint32_t *tx_head, *rx_tail, *tx_seen;
    /* per lane and peer: the step through which the peer's ack was last read,
     * kept in 64 bits so a rank that only reads in a lane for 2^31 steps
     * cannot see a stale value wrap into a fresh one (step_begin) */
    uint64_t *ack_seen;
    int *pidfds; /* comm rank -> pidfd, -1: none (self, same process) */
    int npidfds;
    pid_t mapper; /* the process that mapped it: a fork()ed child has no mapping */
    uint64_t probe;  /* what a peer's process_vm_readv must find at xaddr[0] */
    size_t cma_min;  /* single copy from this many bytes per block; 0: off  */
    size_t cma_pair; /* 2 ranks' all_gather and all_to_all: from this many; 0: off */
};

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* The layout every rank derives from (nranks, chunk, then slots and bytes
 * per slot of the small and the medium lane). */
typedef struct {
    size_t result, stride, data_off, slot_stride, slot_off, mid_stride, mid_off, log_off, total;
} shm_layout;
/* A slot's descriptor line starts a 128-byte pair, its payload right after.
 * Its stamp (the step whose input it holds) relies on a new segment reading
 * zero, as memfd_create's does. */
#define SLOT_STAMP 48
_Static_assert(sizeof(rl_hdr) <= SLOT_STAMP, "a slot's descriptor must end before its stamp");
static size_t slot_stride_of(size_t slot_bytes) { return round_up(SHM_SLOT_HDR + slot_bytes, 128); }

enum { BIG = 0, SMALL = 1, MID = 2 }; /* lanes */

static void layout(int P, size_t chunk, size_t slots, size_t slot_bytes, size_t mid_slots,
                   size_t mid_bytes, shm_layout *l) {
    l->result = round_up(chunk / (size_t)P + 64, 64);
    l->stride = round_up(chunk + l->result, SHM_PAGE);
    l->data_off = SHM_PAGE + round_up(sizeof(shm_ctrl) * (size_t)P, SHM_PAGE);
    l->slot_stride = slot_stride_of(slot_bytes);
    l->slot_off = l->data_off + l->stride * 2 * (size_t)P;
    l->mid_stride = slot_stride_of(mid_bytes);
    l->mid_off = l->slot_off + round_up(l->slot_stride * slots * (size_t)P, SHM_PAGE);
    l->log_off = l->mid_off + round_up(l->mid_stride * mid_slots * (size_t)P, SHM_PAGE);
    l->total = l->log_off + round_up(sizeof(shm_logent) * SHM_LOG * (size_t)P, SHM_PAGE);
}

/* Slots per rank: the knob rounded down to a power of two (steps index them
 * modulo 2^32) and capped so that the op log outlasts any run-ahead (small
 * lane + medium lane + the big lane's 2 < SHM_LOG); 0 when there is no such
 * lane. */
static size_t pow2_slots(int64_t v, int64_t bytes, int64_t cap) {
    if (v < 2 || bytes < 1) return 0;
    if (v > cap) v = cap;
    size_t n = 1;
    while (n * 2 <= (size_t)v) n *= 2;
    return n;
}
static size_t knob_slots(void) {
    return pow2_slots(rl_tune.shm_slots, rl_tune.shm_slot_bytes, SHM_LOG / 2);
}
static size_t knob_mid_slots(void) {
    return pow2_slots(rl_tune.shm_mid_slots, rl_tune.shm_mid_slot_bytes, SHM_LOG / 4);
}

/* ---- point-to-point rings (SHM_P2P) ---------------------------------------
 * A ring per ordered pair: `tail` (cells consumed, written by the receiver)
 * on a line of its own, then `cells` cells of a 64-byte header and SHM_CELL
 * bytes.  A message takes ceil(max(len, 1) / SHM_CELL) cells in a row; its
 * first cell's header holds the frame header (rl_hdr), as over TCP.  Each
 * cell's header line also holds its stamp (the sender's count of cells
 * published, once the cell is full) and up to 8 bytes of payload, so a
 * small message crosses between cores as one cache line: the receiver polls
 * the line it will read, and the sender reads `tail` only when the ring
 * looks full by the last value it saw. */
typedef struct {
    uint32_t tail;
    uint32_t pad0[15]; /* two lines: the adjacent-line prefetcher fetches pairs */
    /* A split message (send_direct): the receiver posts its buffer for the
     * message whose stamp is `posted`; both sides take pieces of it, counted
     * in `claims` (the receiver's from the front in the high half, the
     * sender's from the back in the low) and, once copied, in `copied`. */
    uint32_t posted, copied;
    uint64_t claims;
    uint64_t dst;
    uint32_t pad1[10];
} shm_ring;
_Static_assert(sizeof(shm_ring) == 128, "a ring's header is two cache lines");

#define CELL_STAMP 48  /* offsets in a cell's 64-byte header line, after the rl_hdr */
#define CELL_INLINE 56
#define CELL_INLINE_MAX ((size_t)8)
_Static_assert(sizeof(rl_hdr) <= CELL_STAMP, "a cell's frame header must end before its stamp");

static size_t knob_cells(void) {
    int64_t v = rl_tune.shm_p2p_cells;
    if (v < 2) return 0;
    if (v > 1024) v = 1024;
    size_t n = 1;
    while (n * 2 <= (size_t)v) n *= 2;
    return n;
}

static size_t ring_stride(size_t cells) {
    return sizeof(shm_ring) + cells * (SHM_SLOT_HDR + SHM_CELL);
}

static size_t knob_slot_bytes(void) {
    int64_t v = rl_tune.shm_slot_bytes;
    if (v > 1 << 20) v = 1 << 20;
    return knob_slots() ? round_up((size_t)v, 64) : 0;
}

static size_t knob_mid_bytes(void) {
    int64_t v = rl_tune.shm_mid_slot_bytes;
    if (v > 1 << 20) v = 1 << 20;
    return knob_mid_slots() ? round_up((size_t)v, 64) : 0;
}

static size_t knob_chunk(void) {
    int64_t v = rl_tune.shm_chunk_bytes;
    if (v < 4096) v = 4096;
    if (v > ((int64_t)1 << 30)) v = (int64_t)1 << 30;
    return round_up((size_t)v, 64);
}

size_t rl_shm_p2p_segment_bytes(int nranks) {
    size_t cells = knob_cells();
    if (nranks < 2 || nranks > SHM_P2P_MAX_RANKS || cells == 0) return 0;
    size_t data_off = SHM_PAGE + round_up(sizeof(shm_ctrl) * (size_t)nranks, SHM_PAGE);
    return data_off + round_up(ring_stride(cells) * (size_t)nranks * (size_t)nranks, SHM_PAGE);
}

size_t rl_shm_segment_bytes(int nranks) {
    shm_layout l;
    if (nranks < 1 || nranks > SHM_MAX_RANKS) return 0;
    layout(nranks, knob_chunk(), knob_slots(), knob_slot_bytes(), knob_mid_slots(),
           knob_mid_bytes(), &l);
    return l.total;
}

int rl_comm_uses_shm(const rl_comm *c) { return c->shm != NULL; }

/* ---- futex ------------------------------------------------------------- */
static void futex_wake(uint32_t *w) {
    syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void futex_wait(uint32_t *w, uint32_t v, int64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    syscall(SYS_futex, w, FUTEX_WAIT, v, &ts, NULL, 0);
}

static inline int reached(uint32_t v, uint32_t target) { return (int32_t)(v - target) >= 0; }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void ring_bell(shm_header *h) {
    __atomic_fetch_add(&h->bell, 1, __ATOMIC_SEQ_CST);
    futex_wake(&h->bell);
}

/* Store v into one of this rank's flags, then ring the bell if anyone
 * sleeps waiting for one of them (this rank's `waiters`: a rank asleep on
 * another rank's flag needs no system call from this one).  Both sides are
 * sequentially consistent (store flag / load waiters here; add waiters,
 * read bell, load flag in the waiter), so either the waiter sees v or this
 * rank sees the waiter and changes the bell it is about to sleep on. */
static void publish(rl_shm *s, int me, uint32_t *flag, uint32_t v) {
    __atomic_store_n(flag, v, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&s->ctrl[me].waiters, __ATOMIC_SEQ_CST)) ring_bell(s->hdr);
}

/* The store of publish() without its bell, for a flag this rank publishes
 * right before another: the later publish()'s load of `waiters` follows
 * both stores, so its bell covers a sleeper on either, and a rank asleep
 * on the later flag is not woken twice. */
static void publish_quiet(uint32_t *flag, uint32_t v) {
    __atomic_store_n(flag, v, __ATOMIC_SEQ_CST);
}

void rl_shm_wake_all(rl_comm *c) {
    if (c->shm) ring_bell(c->shm->hdr);
}

/* ---- failure checks between sleeps -------------------------------------- */
static int abort_status_of(int st) {
    /* Keep the class of the original failure, as over TCP (rl_handle_abort). */
    if (st != RL_ERR_TIMEOUT && st != RL_ERR_PEER_CLOSED && st != RL_ERR_DESYNC &&
        st != RL_ERR_AUTH && st != RL_ERR_PROTOCOL)
        st = RL_ERR_ABORTED;
    return st;
}

/* Ranks that disagree on a root can all return from that op (the roots only
 * write); each rank's last rooted op is in its control block, and a peer
 * that recorded the same op (seq) with another root is a desync, reported
 * as soon as this rank looks at that peer. */
static int rooted_check(rl_comm *c, const rl_opdesc *op, int q) {
    if (!c->rooted_seq) return RL_OK;
    uint64_t rec = __atomic_load_n(&c->shm->ctrl[q].rooted, __ATOMIC_ACQUIRE);
    int proot = (int)(int16_t)(rec & 0xffff), pop = (int)((rec >> 16) & 0xff);
    if ((rec >> 24) != (c->rooted_seq & ((1ull << 40) - 1)) ||
        (pop == c->rooted_op && proot == c->rooted_root))
        return RL_OK;
    rl_hdr want;
    char a[256];
    rl_fill_header(&want, c, op, 0, 0);
    rl_describe_header(a, sizeof a, &want);
    return rl_fail(c, op, RL_ERR_DESYNC, q, 0,
                   "desync: ranks passed different roots to %s seq=%llu: root %d on this rank, "
                   "root %d on the peer; seen over shared memory while this rank expects %s "
                   "(the peer sent %s(seq=%llu, root=%d) last)",
                   rl_opcode_name(c->rooted_op), (unsigned long long)c->rooted_seq,
                   c->rooted_root, proot, a, rl_opcode_name(pop),
                   (unsigned long long)c->rooted_seq, proot);
}

/* Whether the op can still finish: no abort, no peer gone.  A peer
 * publishes before it closes or exits, so a flag that reached target by the
 * time a peer is seen gone was published in time: re-read it before failing
 * (a peer may well finish its part of the last op and leave). */
static int op_check(rl_comm *c, const rl_opdesc *op, int q);

/* The comm ranks the set-up still waits for, listed in buf ("2, 5"; "" for
 * none): those that have not attached the segment (*attaching = 1), or once
 * all have, those that do not watch their peers yet.  Returns the lowest. */
static int setup_pending(const rl_comm *c, char *buf, size_t n, int *attaching, int *count) {
    const rl_shm *s = c->shm;
    int first = -1, cut = 0;
    size_t len = 0;
    *attaching = 0;
    *count = 0;
    buf[0] = 0;
    for (int q = 0; q < c->size; q++)
        if (!__atomic_load_n(&s->ctrl[q].pid, __ATOMIC_ACQUIRE)) *attaching = 1;
    for (int q = 0; q < c->size; q++) {
        int late = *attaching ? !__atomic_load_n(&s->ctrl[q].pid, __ATOMIC_ACQUIRE)
                              : !__atomic_load_n(&s->ctrl[q].watched, __ATOMIC_ACQUIRE);
        if (!late || q == c->rank) continue;
        if (first < 0) first = q;
        if (len + 16 < n && !cut) /* ", " and a rank number fit */
            len += (size_t)snprintf(buf + len, n - len, "%s%d", *count ? ", " : "", q);
        else if (!cut && len + 6 < n) {
            len += (size_t)snprintf(buf + len, n - len, ", ...");
            cut = 1;
        }
        (*count)++;
    }
    return first;
}

/* rl_fail for the waits of ops and of the set-up (rl_comm_shm_ready, an op
 * without an opcode), whose failures say it was the set-up, not "unknown-op
 * seq=0", and name the ranks it still waited for; a timeout blames the
 * lowest of them. */
static int shm_fail(rl_comm *c, const rl_opdesc *op, int status, int peer, int e,
                    const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static int shm_fail(rl_comm *c, const rl_opdesc *op, int status, int peer, int e,
                    const char *fmt, ...) {
    char detail[RL_ERRMSG_MAX / 2], list[96];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    if (!op || op->opcode != RL_OP_NONE) return rl_fail(c, op, status, peer, e, "%s", detail);
    int attaching, count, late = setup_pending(c, list, sizeof list, &attaching, &count);
    const char *plural = count > 1 ? "s" : "";
    double waited = (rl_now_ns() - op->start_ns) / 1e9;
    if (status == RL_ERR_TIMEOUT && late >= 0 && attaching)
        return rl_fail(c, NULL, status, late, e,
                       "shared-memory set-up timed out after %.3fs: comm rank%s %s did not "
                       "attach the segment (not at this group's set-up: not started, hung, "
                       "stopped, or failed before it)", waited, plural, list);
    if (status == RL_ERR_TIMEOUT && late >= 0)
        return rl_fail(c, NULL, status, late, e,
                       "shared-memory set-up timed out after %.3fs: comm rank%s %s attached the "
                       "segment but did not finish the set-up (hung or stopped)", waited, plural,
                       list);
    if (late >= 0 && attaching)
        return rl_fail(c, NULL, status, peer, e,
                       "shared-memory set-up failed after %.3fs: %.300s; comm rank%s %s had not "
                       "attached the segment", waited, detail, plural, list);
    return rl_fail(c, NULL, status, peer, e, "shared-memory set-up %s after %.3fs: %s",
                   status == RL_ERR_TIMEOUT ? "timed out" : "failed", waited, detail);
}

/* The failure a peer's abort record gives this op. */
static int peer_aborted(rl_comm *c, const rl_opdesc *op) {
    shm_header *h = c->shm->hdr;
    char reason[RL_ABORT_REASON_MAX];
    memcpy(reason, h->abort_reason, sizeof reason);
    reason[sizeof reason - 1] = 0;
    int who = h->abort_rank;
    return shm_fail(c, op, abort_status_of(h->abort_status), who >= 0 && who < c->size ? who : -1,
                    0, "peer aborted the operation: [%s]", reason);
}

static int check_peers(rl_comm *c, const rl_opdesc *op, uint32_t *flag, uint32_t target,
                       int owner) {
    rl_shm *s = c->shm, *sh = s;
    /* Only the flag's writer matters: others may well have finished their
     * part and closed or exited (a scatter leaf, while the root waits for a
     * slower leaf's ack); a peer that failed is reported by its abort record,
     * or by the writer, which then fails on it in turn. */
    int only = owner;
#define SHM_DONE_ANYWAY() \
    if (reached(__atomic_load_n(flag, __ATOMIC_ACQUIRE), target)) return RL_OK
    for (int q = 0; q < c->size && s->kind == SHM_COLL; q++) {
        int st = q == c->rank ? RL_OK : rooted_check(c, op, q);
        if (st == RL_OK && q != c->rank) st = op_check(c, op, q);
        if (st != RL_OK) return st;
    }
    if (__atomic_load_n(&sh->hdr->abort_set, __ATOMIC_ACQUIRE)) {
        SHM_DONE_ANYWAY();
        return peer_aborted(c, op);
    }
    for (int q = 0; q < c->size; q++) {
        if (q == c->rank || (only >= 0 && q != only)) continue;
        if (__atomic_load_n(&s->ctrl[q].closed, __ATOMIC_ACQUIRE)) {
            SHM_DONE_ANYWAY();
            return shm_fail(c, op, RL_ERR_PEER_CLOSED, q, 0,
                            "the peer closed its communicator (shared memory)");
        }
    }
    if (s->npidfds) {
        struct pollfd pf[64];
        int idx[64];
        for (int q0 = 0; q0 < c->size; q0 += 64) {
            int n = 0;
            for (int q = q0; q < c->size && q < q0 + 64; q++) {
                if (s->pidfds[q] < 0 || (only >= 0 && q != only)) continue;
                pf[n].fd = s->pidfds[q];
                pf[n].events = POLLIN;
                pf[n].revents = 0;
                idx[n++] = q;
            }
            if (n && poll(pf, (nfds_t)n, 0) > 0) {
                SHM_DONE_ANYWAY();
                for (int i = 0; i < n; i++)
                    if (pf[i].revents)
                        return shm_fail(c, op, RL_ERR_PEER_CLOSED, idx[i], 0,
                                        "the peer's process (pid %d) exited or was killed "
                                        "(shared memory)", (int)s->ctrl[idx[i]].pid);
            }
        }
    }
    return RL_OK;
#undef SHM_DONE_ANYWAY
}

/* Before each sleep (counted in `sleepers`, the bell read): SHM_REACHED
 * when the flag got there, RL_OK to sleep, else the op's failure. */
#define SHM_REACHED (-1)
static int sleep_check(rl_comm *c, const rl_opdesc *op, uint32_t *flag, uint32_t target,
                       int owner, int64_t *last_hook) {
    if (reached(__atomic_load_n(flag, __ATOMIC_SEQ_CST), target)) return SHM_REACHED;
    int st = check_peers(c, op, flag, target, owner);
    if (st != RL_OK) return st;
    if (reached(__atomic_load_n(flag, __ATOMIC_ACQUIRE), target)) return SHM_REACHED;
    if (c->poisoned) /* rl_comm_cancel from another thread */
        return c->err.status ? c->err.status : RL_ERR_POISONED;
    int64_t now = rl_now_ns();
    if (now >= op->deadline_ns)
        return shm_fail(c, op, RL_ERR_TIMEOUT, owner, 0,
                        "timed out (the peer is hung, stopped, or never called this op; "
                        "shared memory)");
    if (now - *last_hook >= 90000000LL) {
        *last_hook = now;
        if (rl_call_interrupt_hook())
            return shm_fail(c, op, RL_ERR_INTERRUPTED, -1, 0, "interrupted");
    }
    return RL_OK;
}

/* Wait until *flag reaches target (modulo 2^32).  `owner` is the comm rank
 * that writes the flag (blamed on timeout).  spin_ns: poll at least this long
 * before sleeping, under the same rules (wait_copy). */
static int wait_flag_for(rl_comm *c, const rl_opdesc *op, uint32_t *flag, uint32_t target,
                         int owner, int64_t spin_ns) {
    if (reached(__atomic_load_n(flag, __ATOMIC_ACQUIRE), target)) return RL_OK;
    /* The first SHM_SPIN_HOT polls (a few microseconds) only poll, unless ranks
     * outnumber cores: a peer running on another core answers within them.
     * Later polls yield every 64, so a peer (or another job) that shares this
     * core on a busy host gets it instead of waiting for our time slice. */
    int64_t spin = rl_tune.shm_spin, hot = rl_tune.spin_yield ? 0 : SHM_SPIN_HOT;
    if (spin <= 0 || rl_tune.spin_yield) spin_ns = 0;
    /* Other processes want the cores (wait.c).  A rank that shares its CPU
     * with a peer keeps only the hot polls (a peer running now answers within
     * them), then sleeps: its polls would hold the core that peer needs.  A
     * rank on CPUs of its own polls longer without yielding: it takes time only
     * from the other processes, and each sleep costs a wake-up behind them and
     * its caches (docs/experiments.md, "Polling longer on a busy host"). */
    if ((spin > hot || spin_ns > 0) && rl_host_contended(rl_now_ns())) {
        spin = spin < hot ? spin : hot;
        spin_ns = rl_tune.own_cpus && !rl_tune.spin_yield ? rl_tune.shm_busy_poll_us * 1000 : 0;
        if (spin_ns > 0) hot = INT64_MAX; /* no yield: it would hand the core to them */
    }
    int64_t until = spin_ns > 0 ? rl_now_ns() + spin_ns : 0;
    /* When the job's own ranks outnumber the cores, the rank this one waits
     * for is often queued on this core: the first polls of an op up to a
     * chunk each yield, handing it over at once.  Larger ops keep polling
     * between yields, where handing over on every poll cost their caches
     * (docs/experiments.md, "Yielding at once when ranks outnumber cores"). */
    int64_t eager = rl_tune.spin_yield && op->total <= c->shm->chunk ? SHM_YIELD_FIRST : 0;
    for (int64_t i = 0; i < spin || until; i++) {
        cpu_relax();
        if (reached(__atomic_load_n(flag, __ATOMIC_ACQUIRE), target)) return RL_OK;
        if (i < eager || (i & 63) == 63) {
            /* An abort or a cancel ends the spin at once: a yield can cost a
             * time slice on a busy host, and the spin holds several. */
            if (__atomic_load_n(&c->shm->hdr->abort_set, __ATOMIC_RELAXED) || c->poisoned) break;
            if (until && rl_now_ns() > until) until = 0;
            if (i >= hot) {
                /* A yield that took a while handed the core to someone: the
                 * host is busy, and a futex sleep wakes exactly when the flag
                 * moves instead of after further slices. */
                int64_t t0 = rl_now_ns();
                sched_yield();
                if (rl_now_ns() - t0 > SHM_YIELD_LOST_NS) break;
            }
        }
    }
    int64_t last_hook = rl_now_ns();
    shm_header *h = c->shm->hdr;
    /* Counted where the flag's writer looks when it publishes; a flag that
     * every rank writes (the attach count) has no one writer: its events
     * ring the bell unconditionally. */
    uint32_t *count = owner >= 0 ? &c->shm->ctrl[owner].waiters : &h->sleepers;
    for (;;) {
        __atomic_fetch_add(count, 1, __ATOMIC_SEQ_CST);
        uint32_t bell = __atomic_load_n(&h->bell, __ATOMIC_SEQ_CST);
        int st = sleep_check(c, op, flag, target, owner, &last_hook);
        if (st == RL_OK) {
            int64_t left = op->deadline_ns - rl_now_ns();
            futex_wait(&h->bell, bell, left < SHM_SLICE_NS ? (left > 0 ? left : 0) : SHM_SLICE_NS);
        }
        __atomic_fetch_sub(count, 1, __ATOMIC_SEQ_CST);
        if (st == SHM_REACHED) return RL_OK;
        if (st != RL_OK) return st;
    }
}

static int wait_flag(rl_comm *c, const rl_opdesc *op, uint32_t *flag, uint32_t target,
                     int owner) {
    return wait_flag_for(c, op, flag, target, owner, 0);
}

/* A wait for a peer that is reading nbytes straight from this rank's buffer:
 * poll for about as long as that copy takes before sleeping, so that this
 * rank does not sleep through it and the next operation does not wait for its
 * wake-up (docs/experiments.md, "Waiting out a single copy"). */
static int wait_copy(rl_comm *c, const rl_opdesc *op, uint32_t *flag, uint32_t target,
                     int owner, uint64_t nbytes) {
    uint64_t ns = nbytes / SHM_COPY_BYTES_PER_NS;
    return wait_flag_for(c, op, flag, target, owner,
                         ns < SHM_COPY_SPIN_MAX_NS ? (int64_t)ns : SHM_COPY_SPIN_MAX_NS);
}

/* ---- who a pid is ------------------------------------------------------ */
/* The start time of process pid: field 22 of /proc/<pid>/stat, in clock
 * ticks since boot as this process's time namespace counts them; 0 when it
 * cannot be read.  Unlike the pid, no later process gets the same. */
static uint64_t proc_start_time(pid_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    /* The command name (field 2) may hold spaces and parentheses: count the
     * fields after its last ')'. */
    char *p = strrchr(buf, ')');
    for (int field = 2; p && field < 22; field++) p = strchr(p + 1, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* The inode number of this process's namespace of one kind ("pid", "time"),
 * 0 when there is none to read (no /proc, or a kernel without the kind). */
static uint32_t ns_inode(const char *kind) {
    char path[64];
    struct stat st;
    snprintf(path, sizeof path, "/proc/self/ns/%s", kind);
    return stat(path, &st) == 0 ? (uint32_t)st.st_ino : 0;
}

/* ---- attach ------------------------------------------------------------ */
static int attach_fail(rl_error *err, int status, const char *fmt, const char *a, long x, long y) {
    err->status = status;
    snprintf(err->msg, sizeof err->msg, fmt, a, x, y);
    return status;
}

/* Write once, at attach, the areas only this rank writes (its big buffers and
 * slot payloads, still zero): their first writes in the first ops would
 * otherwise each take a fault and lines from memory (docs/experiments.md).
 * The segment is mapped with MAP_POPULATE for the same reason on the side
 * that reads. */
static void warm_own(rl_shm *s, int r) {
    memset(s->data + (size_t)r * 2 * s->stride, 0, 2 * s->stride);
    for (int lane = SMALL; lane <= MID; lane++) {
        shm_pool *p = &s->pool[lane];
        char *mine = p->base + (size_t)r * p->slots * p->stride;
        for (size_t i = 0; i < p->slots; i++)
            memset(mine + i * p->stride + SHM_SLOT_HDR, 0, p->bytes);
    }
}

static int attach(rl_comm *c, int fd, size_t size, int create, uint32_t kind, rl_error *err) {
    memset(err, 0, sizeof *err);
    if (c->shm) return attach_fail(err, RL_ERR_INVALID, "%scommunicator already has a segment",
                                   "", 0, 0);
    if (c->size > (kind == SHM_P2P ? SHM_P2P_MAX_RANKS : SHM_MAX_RANKS))
        return attach_fail(err, RL_ERR_INVALID, "%s%ld ranks exceed the shared-memory limit of %ld",
                           "", c->size, kind == SHM_P2P ? SHM_P2P_MAX_RANKS : SHM_MAX_RANKS);
    struct stat stt;
    if (fstat(fd, &stt) != 0 || (size_t)stt.st_size < size || size < SHM_PAGE)
        return attach_fail(err, RL_ERR_INVALID, "%ssegment fd is shorter than %ld bytes (%ld)", "",
                           (long)size, (long)stt.st_size);
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (m == MAP_FAILED) {
        err->sys_errno = errno;
        return attach_fail(err, RL_ERR_SYSTEM, "mmap of the shared-memory segment: %s", strerror(errno),
                           0, 0);
    }
    /* Not inherited across fork(): a child (a data-loader worker) must not
     * keep the segment alive after every rank is gone, nor reach into it. */
    if (madvise(m, size, MADV_DONTFORK) != 0) {
        err->sys_errno = errno;
        munmap(m, size);
        return attach_fail(err, RL_ERR_SYSTEM, "madvise(MADV_DONTFORK) of the shared-memory "
                           "segment: %s", strerror(err->sys_errno), 0, 0);
    }
    shm_header *h = m;
    int P = c->size;
    shm_layout l;
    size_t p2p_off = SHM_PAGE + round_up(sizeof(shm_ctrl) * (size_t)P, SHM_PAGE);
    if (create) {
        size_t chunk = knob_chunk(), slots = knob_slots(), slot_bytes = knob_slot_bytes();
        size_t mid_slots = knob_mid_slots(), mid_bytes = knob_mid_bytes();
        size_t cells = knob_cells();
        size_t need;
        if (kind == SHM_P2P) {
            need = rl_shm_p2p_segment_bytes(P);
        } else {
            layout(P, chunk, slots, slot_bytes, mid_slots, mid_bytes, &l);
            need = l.total;
        }
        if (need == 0 || need > size) {
            munmap(m, size);
            return attach_fail(err, RL_ERR_INVALID, "%ssegment of %ld bytes, layout needs %ld", "",
                               (long)size, (long)need);
        }
        memset(m, 0, kind == SHM_P2P ? need : l.data_off);
        if (kind == SHM_COLL) memset((char *)m + l.log_off, 0, l.total - l.log_off);
        h->version = SHM_VERSION;
        h->nranks = (uint32_t)P;
        h->comm_id = c->id;
        h->size = size;
        h->kind = kind;
        h->abort_rank = -1;
        if (kind == SHM_P2P) {
            h->cells = (uint32_t)cells;
            h->data_off = p2p_off;
        } else {
            h->chunk = chunk;
            h->result = l.result;
            h->stride = l.stride;
            h->slots = (uint32_t)slots;
            h->slot_bytes = slot_bytes;
            h->slot_off = l.slot_off;
            h->mid_slots = (uint32_t)mid_slots;
            h->mid_bytes = mid_bytes;
            h->mid_off = l.mid_off;
            h->log_off = l.log_off;
            int64_t small = rl_tune.shm_small_bytes;
            h->small = small < 0 ? 0 : ((size_t)small > chunk ? chunk : (size_t)small);
            h->data_off = l.data_off;
        }
        int64_t cma = rl_tune.shm_cma_bytes;
        h->cma_bytes = cma <= 0 ? 0 : (cma > UINT32_MAX ? UINT32_MAX : (uint32_t)cma);
        int64_t pair = rl_tune.shm_cma_pair_bytes;
        h->cma_pair = pair <= 0 ? h->cma_bytes : (pair > UINT32_MAX ? UINT32_MAX : (uint32_t)pair);
        __atomic_store_n(&h->magic, SHM_MAGIC, __ATOMIC_RELEASE);
    } else {
        int ok = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == SHM_MAGIC &&
                 h->version == SHM_VERSION && h->nranks == (uint32_t)P &&
                 h->comm_id == c->id && h->size == size && h->kind == kind;
        if (ok && kind == SHM_P2P) {
            ok = h->cells >= 2 && h->cells <= 1024 && (h->cells & (h->cells - 1)) == 0 &&
                 h->data_off == p2p_off &&
                 p2p_off + ring_stride(h->cells) * (size_t)P * (size_t)P <= size;
        } else if (ok) {
            ok = h->chunk >= 4096 && h->slots <= SHM_LOG / 2 &&
                 (h->slots & (h->slots - 1)) == 0 && h->slot_bytes <= (1u << 20) &&
                 (h->slots == 0) == (h->slot_bytes == 0) && h->mid_slots <= SHM_LOG / 4 &&
                 (h->mid_slots & (h->mid_slots - 1)) == 0 && h->mid_bytes <= (1u << 20) &&
                 (h->mid_slots == 0) == (h->mid_bytes == 0);
            if (ok) {
                layout(P, (size_t)h->chunk, h->slots, (size_t)h->slot_bytes, h->mid_slots,
                       (size_t)h->mid_bytes, &l);
                ok = l.result == h->result && l.stride == h->stride &&
                     l.data_off == h->data_off && l.slot_off == h->slot_off &&
                     l.mid_off == h->mid_off && l.log_off == h->log_off && l.total <= size &&
                     h->small <= h->chunk;
            }
        }
        if (!ok) {
            long got_p = (long)h->nranks, got_id = (long)h->comm_id;
            munmap(m, size);
            return attach_fail(err, RL_ERR_PROTOCOL,
                               "%sshared-memory segment does not match this communicator "
                               "(%ld ranks, comm id %ld in the segment)", "", got_p, got_id);
        }
    }
    rl_shm *s = calloc(1, sizeof *s);
    int *pidfds = malloc(sizeof(int) * (size_t)P);
    uint32_t *pos = calloc(3 * (size_t)P, sizeof *pos);
    uint64_t *acks = calloc(3 * (size_t)P, sizeof *acks);
    if (!s || !pidfds || !pos || !acks) {
        free(s);
        free(pidfds);
        free(pos);
        free(acks);
        munmap(m, size);
        return attach_fail(err, RL_ERR_NOMEM, "%sout of memory", "", 0, 0);
    }
    for (int q = 0; q < P; q++) pidfds[q] = -1;
    s->base = m;
    s->size = size;
    s->hdr = h;
    s->ctrl = (shm_ctrl *)((char *)m + SHM_PAGE);
    s->kind = kind;
    s->tx_head = pos;
    s->rx_tail = pos + P;
    s->tx_seen = pos + 2 * (size_t)P;
    s->ack_seen = acks;
    if (kind == SHM_P2P) {
        s->cells = h->cells;
        s->rings = (char *)m + h->data_off;
        s->ring_stride = ring_stride(h->cells);
    } else {
        s->data = (char *)m + h->data_off;
        s->chunk = h->chunk;
        s->result = h->result;
        s->stride = h->stride;
        s->small = h->small;
        s->pool[SMALL].slots = h->slots;
        s->pool[SMALL].bytes = h->slot_bytes;
        s->pool[SMALL].stride = slot_stride_of(h->slot_bytes);
        s->pool[SMALL].base = (char *)m + h->slot_off;
        s->pool[MID].slots = h->mid_slots;
        s->pool[MID].bytes = h->mid_bytes;
        s->pool[MID].stride = slot_stride_of(h->mid_bytes);
        s->pool[MID].base = (char *)m + h->mid_off;
        s->log = (shm_logent *)((char *)m + h->log_off);
    }
    if (kind == SHM_COLL) warm_own(s, c->rank);
    s->pidfds = pidfds;
    s->mapper = getpid();
    s->ctrl[c->rank].start = proc_start_time(s->mapper);
    s->ctrl[c->rank].pidns = ns_inode("pid");
    s->ctrl[c->rank].timens = ns_inode("time");
    s->ctrl[c->rank].pid = (int32_t)s->mapper;
    s->probe = (uint64_t)SHM_MAGIC << 32 | c->id;
    s->ctrl[c->rank].xaddr[0] = (uint64_t)(uintptr_t)&s->probe;
    c->shm = s;
    __atomic_fetch_add(&h->attached, 1, __ATOMIC_SEQ_CST);
    ring_bell(h);
    return RL_OK;
}

int rl_comm_attach_shm(rl_comm *c, int fd, size_t size, int create, rl_error *err) {
    return attach(c, fd, size, create, SHM_COLL, err);
}

int rl_comm_attach_shm_p2p(rl_comm *c, int fd, size_t size, int create, rl_error *err) {
    return attach(c, fd, size, create, SHM_P2P, err);
}

/* ---- single copy (process_vm_readv) ------------------------------------
 * A rank reads a peer's input straight into its own output: one copy where
 * the staged path makes two.  The kernel allows it between processes that
 * could ptrace each other (same user, no Yama restriction); each rank probes
 * every peer in set-up and the comm uses it only if all could. */
static int cma_read_raw(pid_t pid, void *dst, uint64_t src, size_t n) {
    while (n) {
        struct iovec l = {dst, n}, r = {(void *)(uintptr_t)src, n};
        ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (got == 0) return EFAULT;
        dst = (char *)dst + got;
        src += (uint64_t)got;
        n -= (size_t)got;
    }
    return 0;
}

int rl_shm_set_ptracer(long pid) {
#ifdef PR_SET_PTRACER
    return prctl(PR_SET_PTRACER, (unsigned long)pid, 0UL, 0UL, 0UL) == 0 ? 0 : errno;
#else
    (void)pid;
    return ENOSYS;
#endif
}

static void cma_probe(rl_comm *c) {
    rl_shm *s = c->shm;
    uint32_t ok = 1, why = 0;
    for (int q = 0; q < c->size && ok == 1; q++) {
        uint64_t got = 0;
        pid_t pid = (pid_t)__atomic_load_n(&s->ctrl[q].pid, __ATOMIC_ACQUIRE);
        uint64_t at = __atomic_load_n(&s->ctrl[q].xaddr[0], __ATOMIC_ACQUIRE);
        int e = pid <= 0 ? ESRCH : cma_read_raw(pid, &got, at, sizeof got);
        if (e || got != s->probe) {
            ok = 2;
            why = (uint32_t)q << 16 | (uint32_t)(e & 0xffff);
        }
    }
    s->ctrl[c->rank].cma_why = why;
    __atomic_store_n(&s->ctrl[c->rank].cma_ok, ok, __ATOMIC_RELEASE);
}

int64_t rl_comm_shm_single_copy(const rl_comm *c, int *rank, int *peer, int *err) {
    rl_shm *s = c->shm;
    *rank = *peer = -1;
    *err = 0;
    if (!s || s->cma_min) return s ? (int64_t)s->cma_min : 0;
    for (int q = 0; q < c->size && s->hdr->cma_bytes; q++)
        if (__atomic_load_n(&s->ctrl[q].cma_ok, __ATOMIC_ACQUIRE) == 2) {
            uint32_t why = s->ctrl[q].cma_why;
            *rank = q;
            *peer = (int)(why >> 16);
            *err = (int)(why & 0xffff);
            break;
        }
    return 0;
}

/* The op's status after a direct read or write of n bytes with the peer q
 * ended in errno e (0: it worked).  A peer that failed may have left the op
 * and freed or reused its buffer (a scatter root acknowledges before it
 * waits): what was read is then not trusted, even when the read worked.  It
 * aborted before it left. */
static int cma_outcome(rl_comm *c, const rl_opdesc *op, int q, int e, const char *verb, size_t n,
                       const char *what, const char *call) {
    rl_shm *s = c->shm;
    if (__atomic_load_n(&s->hdr->abort_set, __ATOMIC_ACQUIRE)) return peer_aborted(c, op);
    if (e == 0) return RL_OK;
    if (e == ESRCH)
        return rl_fail(c, op, RL_ERR_PEER_CLOSED, q, 0,
                       "the peer's process (pid %d) exited or was killed (shared memory)",
                       (int)s->ctrl[q].pid);
    return rl_fail(c, op, e == EFAULT ? RL_ERR_PROTOCOL : RL_ERR_SYSTEM, q, e,
                   "%s %zu bytes %s directly (%s) failed: %s", verb, n, what, call, strerror(e));
}

/* Read n bytes at the peer's address src into dst, or fail the op naming the peer. */
static int cma_read(rl_comm *c, const rl_opdesc *op, int q, void *dst, uint64_t src, size_t n) {
    int e = cma_read_raw((pid_t)c->shm->ctrl[q].pid, dst, src, n);
    return cma_outcome(c, op, q, e, "reading", n, "of the peer's input", "process_vm_readv");
}

/* Write n bytes of src into the peer's memory at dst (a reduce's leaf into
 * its root's output), or fail the op naming the peer.  A root that failed
 * aborted before it left: no write starts after that is seen. */
static int cma_write(rl_comm *c, const rl_opdesc *op, int q, uint64_t dst, const void *src,
                     size_t n) {
    rl_shm *s = c->shm;
    size_t all = n;
    int e = 0;
    while (n && e == 0) {
        if (__atomic_load_n(&s->hdr->abort_set, __ATOMIC_ACQUIRE)) return peer_aborted(c, op);
        struct iovec l = {(void *)src, n}, r = {(void *)(uintptr_t)dst, n};
        ssize_t put = process_vm_writev((pid_t)s->ctrl[q].pid, &l, 1, &r, 1, 0);
        if (put < 0) {
            if (errno != EINTR) e = errno;
            continue;
        }
        if (put == 0) e = EFAULT;
        src = (const char *)src + put;
        dst += (uint64_t)put;
        n -= (size_t)put;
    }
    return cma_outcome(c, op, q, e, "writing", all, "into the peer's output", "process_vm_writev");
}

/* Open a pidfd on peer q's process, so that a wait notices its death within
 * a slice (check_peers).  No peer leaves set-up before every rank watches it,
 * so a peer already gone failed set-up (or died): its pid names no process
 * (ESRCH), a thread of another (EINVAL), an exited one, or one started since
 * (pid reused; told by the start time the peer published).  That fails the
 * set-up naming the peer, as does a system limit (EMFILE).  RL_OK without a
 * pidfd where pidfd_open is missing (Linux < 5.3) or refused (a seccomp
 * filter), or the peer's pid belongs to another pid namespace: a killed peer
 * is then noticed at the deadline, as a stopped one is. */
static int watch_peer(rl_comm *c, int q) {
    rl_shm *s = c->shm;
    const shm_ctrl *me = &s->ctrl[c->rank], *peer = &s->ctrl[q];
    pid_t pid = (pid_t)__atomic_load_n(&peer->pid, __ATOMIC_ACQUIRE);
    if (pid == getpid() || pid <= 0) return RL_OK; /* ranks as threads of one process */
    if (peer->pidns && me->pidns && peer->pidns != me->pidns) return RL_OK;
#ifdef SYS_pidfd_open
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    int e = fd < 0 ? errno : 0;
#else
    int fd = -1, e = ENOSYS;
#endif
    if (e == ENOSYS || e == EPERM) return RL_OK;
    if (fd < 0 && e != ESRCH && e != EINVAL)
        return rl_fail(c, NULL, RL_ERR_SYSTEM, q, e,
                       "shared-memory set-up: pidfd_open of the peer's process (pid %d), "
                       "which tells its death, failed: %s", (int)pid, strerror(e));
    int reused = 0, gone = fd < 0;
    if (fd >= 0) {
        s->pidfds[q] = fd;
        s->npidfds++;
        /* Read while the pidfd's process still runs (polled next), the start
         * time is its own: its pid cannot have passed to another meanwhile. */
        uint64_t start = proc_start_time(pid);
        struct pollfd pf = {fd, POLLIN, 0};
        gone = poll(&pf, 1, 0) > 0;
        reused = !gone && peer->start && start && peer->timens == me->timens &&
                 start != peer->start;
    }
    if (!gone && !reused) return RL_OK;
    if (__atomic_load_n(&s->hdr->abort_set, __ATOMIC_ACQUIRE)) return peer_aborted(c, NULL);
    return rl_fail(c, NULL, RL_ERR_PEER_CLOSED, q, 0,
                   "shared-memory set-up: the peer's process (pid %d) exited or was killed "
                   "before this rank could watch it%s", (int)pid,
                   reused ? " (the pid now names another process)" : "");
}

int rl_comm_shm_ready(rl_comm *c, int64_t timeout_ms) {
    rl_shm *s = c->shm;
    if (!s) return RL_ERR_INVALID;
    rl_opdesc op;
    memset(&op, 0, sizeof op);
    op.opcode = RL_OP_NONE; /* the set-up: its failures say so (shm_fail) */
    op.start_ns = rl_now_ns();
    op.deadline_ns = rl_deadline_from(op.start_ns, timeout_ms);
    op.seq = c->seq;
    int st = wait_flag(c, &op, &s->hdr->attached, (uint32_t)c->size, -1);
    if (st != RL_OK) return st;
    if (s->hdr->attached != (uint32_t)c->size)
        return shm_fail(c, &op, RL_ERR_PROTOCOL, -1, 0,
                        "%u ranks attached the shared-memory segment of a %d-rank communicator",
                        s->hdr->attached, c->size);
    for (int q = 0; q < c->size; q++) {
        st = q == c->rank ? RL_OK : watch_peer(c, q);
        if (st != RL_OK) {
            rl_shm_abort(c); /* the ranks waiting below for this one fail at once */
            return st;
        }
    }
    if (s->hdr->cma_bytes) cma_probe(c);
    /* No rank leaves before every rank watches every peer: a rank that went
     * on at once could finish its part (a send) and exit before a slower
     * one opened its pidfd, which would then never learn of the exit.  (Nor
     * before every rank probed every peer: the probe word's address is then
     * overwritten by the first big-lane op.) */
    __atomic_store_n(&s->ctrl[c->rank].watched, 1, __ATOMIC_RELEASE);
    __atomic_fetch_add(&s->hdr->watching, 1, __ATOMIC_SEQ_CST);
    ring_bell(s->hdr);
    st = wait_flag(c, &op, &s->hdr->watching, (uint32_t)c->size, -1);
    if (st != RL_OK) return st;
    /* Single copy only when every rank can read every peer, so that all
     * ranks take the same path (and number their steps alike). */
    s->cma_min = s->hdr->cma_bytes;
    for (int q = 0; q < c->size && s->cma_min; q++)
        if (__atomic_load_n(&s->ctrl[q].cma_ok, __ATOMIC_ACQUIRE) != 1) s->cma_min = 0;
    s->cma_pair = s->cma_min ? s->hdr->cma_pair : 0;
    return RL_OK;
}

void rl_shm_note_rooted(rl_comm *c) {
    uint64_t rec = (c->rooted_seq & ((1ull << 40) - 1)) << 24 |
                   (uint64_t)(c->rooted_op & 0xff) << 16 | (uint16_t)c->rooted_root;
    __atomic_store_n(&c->shm->ctrl[c->rank].rooted, rec, __ATOMIC_RELEASE);
}

void rl_shm_abort(rl_comm *c) {
    rl_shm *s = c->shm;
    if (!s) return;
    shm_header *h = s->hdr;
    uint32_t zero = 0;
    if (__atomic_compare_exchange_n(&h->abort_claim, &zero, 1, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED)) {
        h->abort_status = c->err.status ? c->err.status : RL_ERR_ABORTED;
        h->abort_rank = c->rank;
        size_t n = strnlen(c->err.msg, sizeof h->abort_reason - 1);
        memcpy(h->abort_reason, c->err.msg, n);
        h->abort_reason[n] = 0;
        __atomic_store_n(&h->abort_set, 1, __ATOMIC_RELEASE);
    }
    rl_shm_wake_all(c);
}

void rl_shm_detach(rl_comm *c) {
    rl_shm *s = c->shm;
    if (!s) return;
    /* In a fork()ed child the segment is not mapped (MADV_DONTFORK): free
     * only this process's copies, and leave the rank's mark alone. */
    int mapped = getpid() == s->mapper;
    if (mapped) {
        __atomic_store_n(&s->ctrl[c->rank].closed, 1, __ATOMIC_RELEASE);
        rl_shm_wake_all(c);
    }
    for (int q = 0; q < c->size; q++)
        if (s->pidfds[q] >= 0) close(s->pidfds[q]);
    free(s->pidfds);
    free(s->tx_head);
    free(s->ack_seen);
    if (mapped) munmap(s->base, s->size);
    free(s);
    c->shm = NULL;
}

/* ---- steps ------------------------------------------------------------- */
/* Three lanes of steps, each numbered alike on every rank.  The big lane has
 * two buffers per rank (step s uses buffer s & 1) and carries chunked
 * messages; the small lane has `slots` slots per rank and carries every op
 * whose bytes fit a slot, so a rank that only writes (a broadcast root, a
 * reduce leaf) runs up to `slots` ops ahead of its readers; the medium lane
 * does the same for rooted ops between a slot and a chunk (lane_rooted). */
static inline char *slot_at(rl_shm *s, int q, int lane, uint32_t step) {
    shm_pool *p = &s->pool[lane];
    return p->base + ((size_t)q * p->slots + (step & (p->slots - 1))) * p->stride;
}
/* The flag q publishes a step's input with: in the big lane `in`; in a
 * slotted lane the stamp in the slot's descriptor line (SLOT_STAMP), so a
 * reader polls the line it reads next, and the slot's first payload line is
 * that line's pair for the adjacent-line prefetcher. */
static inline uint32_t *lane_in(rl_shm *s, int q, int lane, uint32_t step) {
    if (lane == BIG) return &s->ctrl[q].in;
    return (uint32_t *)(slot_at(s, q, lane, step) + SLOT_STAMP);
}
static inline uint32_t *lane_ack(rl_shm *s, int q, int lane) {
    return lane == SMALL ? &s->ctrl[q].s_ack : lane == MID ? &s->ctrl[q].m_ack : &s->ctrl[q].ack;
}
static inline char *in_area(rl_shm *s, int q, int lane, uint32_t step) {
    if (lane != BIG) return slot_at(s, q, lane, step) + SHM_SLOT_HDR;
    return s->data + ((size_t)q * 2 + (step & 1)) * s->stride;
}
static inline rl_hdr *in_desc(rl_shm *s, int q, int lane, uint32_t step) {
    return lane != BIG ? (rl_hdr *)slot_at(s, q, lane, step) : &s->ctrl[q].desc[step & 1];
}
static inline char *res_area(rl_shm *s, int q, uint32_t step) {
    return in_area(s, q, BIG, step) + s->chunk;
}
static inline const char *lane_algo(int lane) {
    return lane == SMALL ? "shm_slot" : lane == MID ? "shm_mid_slot" : "shm_copy";
}
/* What one step of a lane carries at most. */
static inline size_t lane_bytes(const rl_shm *s, int lane) {
    return lane == BIG ? s->chunk : s->pool[lane].bytes;
}
/* The small lane when `bytes` (what one rank publishes) fit a slot. */
static inline int lane_for(const rl_shm *s, size_t bytes) {
    return s->pool[SMALL].slots && bytes <= s->pool[SMALL].bytes ? SMALL : BIG;
}
/* A rooted op's lane: beyond a small slot and up to `most` bytes, the medium
 * lane, whose many slots let the side that writes (a scatter's or
 * broadcast's root, a gather's leaves) run steps ahead of the side that reads
 * where the big lane's two buffers hold it at every op: on a busy host each
 * hand-over there costs a wake-up.  Each step carries at least 64 bytes per
 * rank. */
static inline int lane_rooted(const rl_shm *s, size_t bytes, size_t most, int P) {
    int lane = lane_for(s, bytes);
    if (lane == BIG && s->pool[MID].slots && bytes <= most && s->pool[MID].bytes >= (size_t)P * 64)
        return MID;
    return lane;
}

static inline shm_logent *log_at(rl_shm *s, int q, uint64_t seq) {
    return &s->log[(size_t)q * SHM_LOG + (seq % SHM_LOG)];
}

/* Log the op this rank enters. */
static void note_op(rl_comm *c, const rl_opdesc *op) {
    shm_logent *e = log_at(c->shm, c->rank, op->seq);
    uint32_t v = e->ver;
    __atomic_store_n(&e->ver, v + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    rl_fill_header(&e->op, c, op, 0, 0);
    __atomic_store_n(&e->ver, v + 2, __ATOMIC_RELEASE);
}

/* A peer that entered this same op (seq) with another opcode, dtype, size or
 * root: a desync, named with both sides.  Other ops are skipped. */
static int op_check(rl_comm *c, const rl_opdesc *op, int q) {
    shm_logent *e = log_at(c->shm, q, op->seq);
    uint32_t v = __atomic_load_n(&e->ver, __ATOMIC_ACQUIRE);
    if (v & 1) return RL_OK;
    rl_hdr got, want;
    memcpy(&got, (const void *)&e->op, sizeof got);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&e->ver, __ATOMIC_RELAXED) != v) return RL_OK;
    if (got.magic != RL_MAGIC || got.seq != op->seq || op->opcode == 0) return RL_OK;
    rl_fill_header(&want, c, op, 0, 0);
    if (memcmp(&got, &want, sizeof got) == 0) return RL_OK;
    return rl_check_header(c, op, q, &got, &want);
}

/* Next step of a lane; a rank about to write its buffer (or descriptor)
 * first waits until every rank has finished reading the step that used it
 * last. */
static int step_begin(rl_comm *c, const rl_opdesc *op, int lane, int writes, uint32_t *out) {
    rl_shm *s = c->shm;
    uint64_t step64 = ++s->step[lane];
    uint32_t step = (uint32_t)step64, depth = lane == BIG ? 2 : s->pool[lane].slots;
    *out = step;
    if (!writes) return RL_OK;
    /* A peer's ack is read again only when the value last read is too old:
     * the read takes the line from the peer, which writes it every step. */
    uint64_t *seen = s->ack_seen + (size_t)lane * (size_t)c->size;
    for (int q = 0; q < c->size; q++) {
        if (seen[q] + depth >= step64) continue;
        int st = wait_flag(c, op, lane_ack(s, q, lane), step - depth, q);
        if (st != RL_OK) return st;
        /* Ranks are a few steps apart at most: the ack is near this step. */
        uint32_t a = __atomic_load_n(lane_ack(s, q, lane), __ATOMIC_ACQUIRE);
        seen[q] = step64 + (uint64_t)(int64_t)(int32_t)(a - step);
    }
    return RL_OK;
}

static void publish_in(rl_comm *c, const rl_opdesc *op, int lane, uint32_t step, uint32_t part,
                       uint64_t nbytes) {
    rl_shm *s = c->shm;
    rl_fill_header(in_desc(s, c->rank, lane, step), c, op, part, nbytes);
    publish(s, c->rank, lane_in(s, c->rank, lane, step), step);
}

/* In big step `step`, begun as a writer: publish this rank's buffer at
 * `addr` for its peers' direct reads or writes, n in the descriptor. */
static void publish_addr(rl_comm *c, const rl_opdesc *op, uint32_t step, const void *addr,
                         uint64_t n) {
    c->shm->ctrl[c->rank].xaddr[step & 1] = (uint64_t)(uintptr_t)addr;
    publish_in(c, op, BIG, step, 0, n);
}

/* The next big step, begun as a writer, publishing `addr` (publish_addr). */
static int open_addr(rl_comm *c, const rl_opdesc *op, const void *addr, uint64_t n,
                     uint32_t *step) {
    int st = step_begin(c, op, BIG, 1, step);
    if (st == RL_OK) publish_addr(c, op, *step, addr, n);
    return st;
}

/* The buffer address peer q published in big step `step`. */
static inline uint64_t peer_addr(const rl_shm *s, int q, uint32_t step) {
    return __atomic_load_n(&s->ctrl[q].xaddr[step & 1], __ATOMIC_RELAXED);
}

/* Wait for q's input of this step; its descriptor into *got. */
static int peek_in(rl_comm *c, const rl_opdesc *op, int lane, int q, uint32_t step,
                   rl_hdr *got) {
    rl_shm *s = c->shm;
    int st = rooted_check(c, op, q);
    if (st == RL_OK) st = wait_flag(c, op, lane_in(s, q, lane, step), step, q);
    if (st == RL_OK) memcpy(got, in_desc(s, q, lane, step), sizeof *got);
    return st;
}

/* Wait for q's input of this step and compare its descriptor with ours. */
static int wait_in(rl_comm *c, const rl_opdesc *op, int lane, int q, uint32_t step,
                   uint32_t part, uint64_t nbytes) {
    rl_hdr got, want;
    int st = peek_in(c, op, lane, q, step, &got);
    if (st != RL_OK) return st;
    rl_fill_header(&want, c, op, part, nbytes);
    if (memcmp(&got, &want, sizeof got) != 0) return rl_check_header(c, op, q, &got, &want);
    return rooted_check(c, op, q); /* the peer may have recorded it while we waited */
}

static int wait_all_in(rl_comm *c, const rl_opdesc *op, int lane, uint32_t step, uint32_t part,
                       uint64_t nbytes) {
    for (int q = 0; q < c->size; q++) {
        if (q == c->rank) continue;
        int st = wait_in(c, op, lane, q, step, part, nbytes);
        if (st != RL_OK) return st;
    }
    return RL_OK;
}

static void step_ack(rl_comm *c, int lane, uint32_t step) {
    publish(c->shm, c->rank, lane_ack(c->shm, c->rank, lane), step);
}

/* After a single copy: wait until every peer has acknowledged big step
 * `step`, having read up to nbytes of this rank's buffer (or written them). */
static int wait_peers_ack(rl_comm *c, const rl_opdesc *op, uint32_t step, uint64_t nbytes) {
    for (int q = 0; q < c->size; q++) {
        if (q == c->rank) continue;
        int st = wait_copy(c, op, lane_ack(c->shm, q, BIG), step, q, nbytes);
        if (st != RL_OK) return st;
    }
    return RL_OK;
}

/* dst = slot(0) op slot(1) op ... op slot(P-1), element range [off, off+n),
 * in rank order, so every rank that computes it gets the same bits. */
static void reduce_slots(rl_comm *c, int lane, uint32_t step, size_t off_bytes, char *dst,
                         size_t n, rl_dtype dt, rl_redop rop) {
    rl_shm *s = c->shm;
    if (n == 0) return;
    rl_reduce_kernel(dst, in_area(s, 0, lane, step) + off_bytes,
                     in_area(s, 1, lane, step) + off_bytes, n, dt, rop);
    for (int q = 2; q < c->size; q++)
        rl_reduce_kernel(dst, dst, in_area(s, q, lane, step) + off_bytes, n, dt, rop);
    if (rop == RL_AVG) rl_scale_kernel(dst, n, dt, 1.0 / c->size);
}

/* ---- all_reduce and reduce ---------------------------------------------- */
/* root < 0: all_reduce (every rank gets the result); else reduce to root
 * (other ranks' buf is left unchanged).
 *
 * Small (bytes <= small; a reduce of 3 or more ranks up to a medium slot):
 * one step.  Every rank copies buf into its input area and publishes; then
 * each rank that wants the result reduces all P areas in rank order into buf.
 * Reads P*N bytes, writes 2N.  A reduce's leaves leave at once; in the small
 * and medium lanes they run ahead of the root.
 *
 * Chunked, 3 or more ranks (2: reduce_pair): per step, a chunk of up to
 * `chunk` bytes.  Every rank copies its chunk in and publishes; rank r
 * reduces block r of the chunk (P near-equal blocks) from all P input areas,
 * in rank order, into its result area and publishes `out`; then every rank
 * that wants the result copies the P blocks from the result areas.  Per
 * rank: writes N (in) + N/P (result) + N (out), reads N (reduce) + N (copy
 * out).  Two buffers let a rank start the next chunk while slower ranks
 * finish this one. */
/* Two ranks, chunked: every rank that contributes stages its chunk, and every
 * rank that wants the result reduces its own buffer with the peer's staged
 * chunk, in rank order (both ranks of an all_reduce compute the same bits).
 * A reduce's leaf only stages and runs ahead: up to one chunk in the medium
 * lane, whose many slots let it run ops ahead of a root that lost its CPU
 * (the big lane's two buffers hold it at every op).  Per rank: writes N (in)
 * + N, reads 2N (N of it staged by the peer): no result area and no copy
 * out, which the split reduce below needs (docs/algorithms.md). */
static int reduce_pair(rl_comm *c, rl_opdesc *op, void *buf, size_t count, rl_dtype dt,
                       rl_redop rop, int root) {
    rl_shm *s = c->shm;
    int r = c->rank, peer = 1 - r;
    size_t esz = rl_dtype_size(dt);
    int lane = root >= 0 ? lane_rooted(s, count * esz, s->chunk, 2) : BIG;
    size_t ce = lane_bytes(s, lane) / esz;
    uint32_t step;
    int st;
    op->algo = lane == MID ? "shm_pair_mid_slot" : "shm_pair";
    for (size_t k = 0, part = 0; k < count; k += ce, part++) {
        size_t n = count - k < ce ? count - k : ce;
        char *base = (char *)buf + k * esz;
        if ((st = step_begin(c, op, lane, r != root, &step)) != RL_OK) return st;
        if (r != root) { /* an all_reduce (root < 0) stages on both ranks */
            rl_copy(in_area(s, r, lane, step), base, n * esz);
            publish_in(c, op, lane, step, (uint32_t)part, n * esz);
        }
        if (root < 0 || r == root) {
            if ((st = wait_in(c, op, lane, peer, step, (uint32_t)part, n * esz)) != RL_OK)
                return st;
            const char *theirs = in_area(s, peer, lane, step);
            if (r == 0) rl_reduce_kernel(base, base, theirs, n, dt, rop);
            else rl_reduce_kernel(base, theirs, base, n, dt, rop);
            if (rop == RL_AVG) rl_scale_kernel(base, n, dt, 0.5);
        }
        step_ack(c, lane, step);
    }
    return RL_OK;
}

static int cma_reduce(rl_comm *c, rl_opdesc *op, char *buf, size_t count, rl_dtype dt,
                      rl_redop rop, int root, int *done);

int rl_shm_all_reduce(rl_comm *c, rl_opdesc *op, void *buf, size_t count, rl_dtype dt,
                      rl_redop rop, int root) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank, want = root < 0 || root == r;
    size_t esz = rl_dtype_size(dt), bytes = count * esz;
    uint32_t step;
    int st;
    note_op(c, op);
    /* A reduce of 3 or more ranks stays in one step up to a medium slot, where
     * its leaves run ahead: a busy host's chunked form waits for every rank. */
    size_t flat_most = s->small;
    if (root >= 0 && P > 2 && s->pool[MID].bytes > flat_most) flat_most = s->pool[MID].bytes;
    if (bytes <= flat_most || lane_for(s, bytes) == SMALL) {
        int lane = root >= 0 ? lane_rooted(s, bytes, s->pool[MID].bytes, P) : lane_for(s, bytes);
        op->algo = lane == SMALL ? "shm_slot" : lane == MID ? "shm_mid_slot" : "shm_flat";
        if ((st = step_begin(c, op, lane, 1, &step)) != RL_OK) return st;
        rl_copy(in_area(s, r, lane, step), buf, bytes);
        publish_in(c, op, lane, step, 0, bytes);
        if (want) {
            if ((st = wait_all_in(c, op, lane, step, 0, bytes)) != RL_OK) return st;
            reduce_slots(c, lane, step, 0, buf, count, dt, rop);
        }
        step_ack(c, lane, step);
        return RL_OK;
    }
    size_t blk = (count / (size_t)P) * esz;
    if (P > 1 && s->cma_min && blk > s->chunk && blk >= s->cma_min &&
        (root >= 0 || rl_tune.shm_cma_all_reduce_bytes)) {
        int done;
        if ((st = cma_reduce(c, op, buf, count, dt, rop, root, &done)) != RL_OK || done) return st;
    }
    if (P == 2) return reduce_pair(c, op, buf, count, dt, rop, root);
    op->algo = "shm_chunked";
    size_t ce = s->chunk / esz;
    for (size_t k = 0, part = 0; k < count; k += ce, part++) {
        size_t n = count - k < ce ? count - k : ce;
        char *base = (char *)buf + k * esz;
        if ((st = step_begin(c, op, BIG, 1, &step)) != RL_OK) return st;
        rl_copy(in_area(s, r, BIG, step), base, n * esz);
        publish_in(c, op, BIG, step, (uint32_t)part, n * esz);
        if ((st = wait_all_in(c, op, BIG, step, (uint32_t)part, n * esz)) != RL_OK) return st;
        size_t bs = rl_block_start(n, P, r), bn = rl_block_count(n, P, r);
        reduce_slots(c, BIG, step, bs * esz, res_area(s, r, step), bn, dt, rop);
        shm_ctrl *me = &s->ctrl[r];
        publish(s, r, &me->out, step);
        if (want) {
            for (int i = 0; i < P; i++) {
                int q = (r + i) % P; /* start at our own block: it is in cache */
                if (q != r && (st = wait_flag(c, op, &s->ctrl[q].out, step, q)) != RL_OK)
                    return st;
                rl_copy(base + rl_block_start(n, P, q) * esz, res_area(s, q, step),
                       rl_block_count(n, P, q) * esz);
            }
        }
        step_ack(c, BIG, step);
    }
    return RL_OK;
}

/* A rank's own block, copied between its own buffers while its peers copy
 * theirs: streamed from `min` bytes on, so it neither reads each destination
 * line first nor evicts the lines the other copies move.  Below, the op's
 * buffers fit in the caches and plain stores leave them there for the next
 * op (docs/experiments.md).  The ranges must not overlap. */
static void copy_own(void *dst, const void *src, size_t n, size_t min) {
    if (n >= min) rl_copy_stream(dst, src, n);
    else rl_copy(dst, src, n);
}

/* ---- broadcast ------------------------------------------------------------
 * Per step the root copies a chunk into its input area and publishes; every
 * other rank checks the root's descriptor and copies the chunk out, all at
 * once.  The root writes N, each other rank reads N.  A message that fits a
 * slot goes in the small lane, one up to a chunk in the medium lane: the root
 * runs ahead of its readers.  Two ranks from 2*cma_min: each copies half
 * (cma_split).  More ranks beyond two chunks, from a root in huge pages:
 * every reader reads it directly (cma_scatter with stride 0). */
static int cma_scatter(rl_comm *c, rl_opdesc *op, void *many, void *one, size_t blk, int root,
                       size_t stride);

/* At least half of the buffer lies in huge pages (rl_huge_page_bytes). */
static int mostly_huge(const void *buf, size_t len) {
    return rl_huge_page_bytes(buf, len) >= (int64_t)(len / 2);
}

/* Whether a reader's single copy of this buffer beats the staged copy pair
 * of a point-to-point message or a reduce_scatter's input: from
 * huge pages always; from 4 KiB pages up to shm_cma_any_bytes, beyond which
 * the kernel's page-by-page pinning costs more than the second copy
 * (docs/experiments.md).  Only the rank that owns the buffer can ask. */
static int reads_fast(const void *buf, size_t len) {
    int64_t any = rl_tune.shm_cma_any_bytes;
    return (any > 0 && len <= (uint64_t)any) || mostly_huge(buf, len);
}

/* Whether an op takes the single copy, as only the rank `decider` (whose
 * buffer it is) can tell: it passes its verdict `mine`; every other rank
 * waits for its first descriptor of the next big step and reads the size
 * there (n: single copy; one chunk: staged). */
static int follow_decider(rl_comm *c, const rl_opdesc *op, int decider, int mine, uint64_t n,
                          int *direct) {
    if (c->rank == decider) {
        *direct = mine;
        return RL_OK;
    }
    rl_hdr first;
    int st = peek_in(c, op, BIG, decider, (uint32_t)c->shm->step[BIG] + 1, &first);
    *direct = st == RL_OK && first.nbytes == n;
    return st;
}

/* A 2-rank broadcast split between its two ranks: the reader reads the first
 * half of the root's buffer (process_vm_readv) while the root writes the rest
 * into the reader's (process_vm_writev); each publishes its buffer's address
 * in one big-lane step.  Both cores copy, each half the bytes, so the root
 * neither idles nor sleeps through a long copy on a busy host. */
static int cma_split(rl_comm *c, rl_opdesc *op, char *buf, size_t len, int root) {
    rl_shm *s = c->shm;
    int r = c->rank, q = 1 - r;
    size_t h = (len / 2 + 4095) & ~(size_t)4095; /* whole pages to each side */
    uint32_t step;
    int st;
    op->algo = "shm_split_copy";
    if ((st = open_addr(c, op, buf, len, &step)) != RL_OK) return st;
    if ((st = wait_in(c, op, BIG, q, step, 0, len)) != RL_OK) return st;
    uint64_t at = peer_addr(s, q, step);
    if (r == root) st = cma_write(c, op, q, at + h, buf + h, len - h);
    else st = cma_read(c, op, q, buf, at, h);
    if (st != RL_OK) return st;
    step_ack(c, BIG, step);
    /* Each buffer stays in use until the peer is done with it. */
    return wait_peers_ack(c, op, step, len / 2);
}

int rl_shm_broadcast(rl_comm *c, rl_opdesc *op, void *buf, size_t len, int root) {
    rl_shm *s = c->shm;
    int r = c->rank, lane = lane_for(s, len);
    uint32_t step;
    int st;
    note_op(c, op);
    /* Two ranks from 2 * cma_min: the split copy, which beat the reader's
     * single copy and the staged copies at every size, idle and busy.  With
     * more ranks, beyond two chunks, every reader reads the root's buffer in
     * huge pages directly, which beat the staged copies up to 16 MiB and ran
     * level beyond (docs/experiments.md).  Only the root knows its buffer:
     * the readers tell the two apart by the size in its first descriptor. */
    if (lane == BIG && s->cma_min && c->size == 2 && len >= 2 * s->cma_min)
        return cma_split(c, op, buf, len, root);
    if (lane == BIG && s->cma_min && c->size > 2 && len > 2 * s->chunk) {
        int direct, mine = r == root && mostly_huge(buf, len);
        if ((st = follow_decider(c, op, root, mine, len, &direct)) != RL_OK) return st;
        if (direct) return cma_scatter(c, op, buf, buf, len, root, 0);
    }
    lane = lane_rooted(s, len, s->chunk, c->size);
    size_t piece = lane_bytes(s, lane);
    op->algo = lane_algo(lane);
    for (size_t k = 0, part = 0; k < len; k += piece, part++) {
        size_t n = len - k < piece ? len - k : piece;
        if ((st = step_begin(c, op, lane, r == root, &step)) != RL_OK) return st;
        if (r == root) {
            rl_copy(in_area(s, r, lane, step), (char *)buf + k, n);
            publish_in(c, op, lane, step, (uint32_t)part, n);
        } else {
            if ((st = wait_in(c, op, lane, root, step, (uint32_t)part, n)) != RL_OK) return st;
            rl_copy((char *)buf + k, in_area(s, root, lane, step), n);
        }
        step_ack(c, lane, step);
    }
    return RL_OK;
}

/* ---- barrier: every rank publishes a descriptor and waits for all. ---- */
int rl_shm_barrier(rl_comm *c, rl_opdesc *op) {
    rl_shm *s = c->shm;
    int lane = lane_for(s, 0);
    uint32_t step;
    int st;
    note_op(c, op);
    op->algo = "shm_flags";
    if ((st = step_begin(c, op, lane, 1, &step)) != RL_OK) return st;
    publish_in(c, op, lane, step, 0, 0);
    if ((st = wait_all_in(c, op, lane, step, 0, 0)) != RL_OK) return st;
    step_ack(c, lane, step);
    return RL_OK;
}

/* ---- all_gather ------------------------------------------------------------
 * Per step every rank copies a piece of its block in and publishes; every
 * rank copies that piece of all P blocks out.  Writes N + P*N, reads P*N. */
static int cma_exchange(rl_comm *c, rl_opdesc *op, char *out, const char *src, size_t blk,
                        size_t at_off);

/* All_gather by writes: each rank publishes its output's address, moves its
 * own block, then writes its block into block r of every peer's output
 * (process_vm_writev), piece by piece so that each piece is read from memory
 * once for all peers; it returns once every peer has written into its
 * output.  `in` must not overlap `out` but as its own block. */
#define WP_PIECE ((size_t)1 << 20)
/* Each rank writes its block (len bytes at byte `at` of every output) into
 * each peer's output; `total` is what every rank's descriptor announces. */
static int cma_write_block(rl_comm *c, rl_opdesc *op, char *out, const char *in, size_t at,
                           size_t len, uint64_t total) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    uint32_t step;
    int st;
    op->algo = "shm_write_peers";
    if ((st = open_addr(c, op, out, total, &step)) != RL_OK) return st;
    char *mine = out + at;
    if (in != mine) copy_own(mine, in, len, RL_STREAM_COPY_MIN);
    for (int i = 1; i < P; i++)
        if ((st = wait_in(c, op, BIG, (r + i) % P, step, 0, total)) != RL_OK) return st;
    for (size_t k = 0; k < len; k += WP_PIECE) {
        size_t n = len - k < WP_PIECE ? len - k : WP_PIECE;
        for (int i = 1; i < P; i++) {
            int q = (r + i) % P;
            uint64_t dst = peer_addr(s, q, step) + (uint64_t)at;
            if ((st = cma_write(c, op, q, dst + k, in + k, n)) != RL_OK) return st;
        }
    }
    step_ack(c, BIG, step);
    /* Peers write into this rank's output until each has acknowledged. */
    return wait_peers_ack(c, op, step, total);
}

static int cma_write_peers(rl_comm *c, rl_opdesc *op, char *out, const char *in, size_t blk) {
    return cma_write_block(c, op, out, in, (size_t)c->rank * blk, blk, blk);
}

int rl_shm_all_gather(rl_comm *c, rl_opdesc *op, void *out, const void *in, size_t count,
                      rl_dtype dt) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank, lane = lane_for(s, count * rl_dtype_size(dt));
    size_t esz = rl_dtype_size(dt), blk = count * esz;
    size_t ce = lane_bytes(s, lane) / esz;
    char *mine = (char *)out + (size_t)r * blk;
    uint32_t step;
    int st;
    note_op(c, op);
    op->algo = lane == SMALL ? "shm_slot" : "shm_copy";
    /* An input inside the output anywhere but our own block would be
     * overwritten by earlier pieces: move it there first. */
    if ((const char *)in != mine && rl_overlap(in, blk, out, blk * (size_t)P)) {
        rl_move(mine, in, blk);
        in = mine;
    }
    /* Reading every peer's block directly reads each block once per peer
     * from memory, where the staged copy-out reads the segment's cached
     * piece: only 2 ranks gain, from blocks of a few KiB (shm_cma_pair_bytes).
     * Beyond, blocks of more than two chunks are written into the peers
     * instead, each piece once from memory for all of them
     * (docs/experiments.md). */
    if (lane == BIG && P == 2 && s->cma_pair && blk >= s->cma_pair)
        return cma_exchange(c, op, (char *)out, (const char *)in, blk, 0);
    if (lane == BIG && P > 2 && s->cma_min && blk > 2 * s->chunk)
        return cma_write_peers(c, op, (char *)out, (const char *)in, blk);
    for (size_t k = 0, part = 0; k < count; k += ce, part++) {
        size_t n = count - k < ce ? count - k : ce;
        if ((st = step_begin(c, op, lane, 1, &step)) != RL_OK) return st;
        rl_copy(in_area(s, r, lane, step), (const char *)in + k * esz, n * esz);
        publish_in(c, op, lane, step, (uint32_t)part, n * esz);
        for (int i = 0; i < P; i++) {
            int q = (r + i) % P;
            if (q != r && (st = wait_in(c, op, lane, q, step, (uint32_t)part, n * esz)) != RL_OK)
                return st;
            if (q == r && (const char *)in == mine) continue; /* already in place */
            rl_copy((char *)out + (size_t)q * blk + k * esz, in_area(s, q, lane, step), n * esz);
        }
        step_ack(c, lane, step);
    }
    return RL_OK;
}

/* all_gather_v: the loop of rl_shm_all_gather with each rank's own piece
 * sizes.  Every rank knows every count, so all run the same steps (those of
 * the largest block) and each checks each peer's piece size in its
 * descriptor; a rank whose block has run out publishes empty pieces. */

int rl_shm_all_gather_v(rl_comm *c, rl_opdesc *op, void *out, const size_t *counts,
                        const size_t *displs, const void *in, rl_dtype dt) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    size_t esz = rl_dtype_size(dt), m = 0, span = 0;
    for (int q = 0; q < P; q++) {
        if (counts[q] > m) m = counts[q];
        if ((displs[q] + counts[q]) * esz > span) span = (displs[q] + counts[q]) * esz;
    }
    int lane = lane_for(s, m * esz);
    size_t ce = lane_bytes(s, lane) / esz;
    char *mine = (char *)out + displs[r] * esz;
    uint32_t step;
    int st;
    note_op(c, op);
    op->algo = lane == SMALL ? "shm_slot" : "shm_copy";
    if ((const char *)in != mine && rl_overlap(in, counts[r] * esz, out, span)) {
        rl_move(mine, in, counts[r] * esz);
        in = mine;
    }
    /* As rl_shm_all_gather: single copy once the largest block spans more
     * than two chunks (every rank decides on the same figures). */
    if (lane == BIG && s->cma_min && m * esz > 2 * s->chunk) {
        uint64_t total = 0;
        for (int q = 0; q < P; q++) total += counts[q] * esz;
        return cma_write_block(c, op, (char *)out, (const char *)in, displs[r] * esz,
                               counts[r] * esz, total);
    }
    for (size_t k = 0, part = 0; k < m; k += ce, part++) {
        if ((st = step_begin(c, op, lane, 1, &step)) != RL_OK) return st;
        size_t n = counts[r] > k ? (counts[r] - k < ce ? counts[r] - k : ce) : 0;
        rl_copy(in_area(s, r, lane, step), (const char *)in + k * esz, n * esz);
        publish_in(c, op, lane, step, (uint32_t)part, n * esz);
        for (int i = 0; i < P; i++) {
            int q = (r + i) % P;
            size_t nq = counts[q] > k ? (counts[q] - k < ce ? counts[q] - k : ce) : 0;
            if (q != r && (st = wait_in(c, op, lane, q, step, (uint32_t)part, nq * esz)) != RL_OK)
                return st;
            if (q == r && (const char *)in == mine) continue; /* already in place */
            rl_copy((char *)out + (displs[q] + k) * esz, in_area(s, q, lane, step), nq * esz);
        }
        step_ack(c, lane, step);
    }
    return RL_OK;
}

/* ---- reductions read straight from the peers ------------------------------
 * A rank that reduces one block of the P inputs (reduce_scatter) can read
 * that block of each peer's input directly (process_vm_readv) into a scratch
 * piece instead of having every rank copy its whole input into the segment:
 * no copy-in and one hand-over per op instead of one per piece.  The kernel
 * copies, it does not add, so the peers' pieces still pass through the cache
 * once.  A reduce takes the same form, its leaves writing their results
 * into the root (cma_reduce); an all_reduce so formed lost to its staged
 * pipeline (docs/experiments.md). */
/* In step `step` (begun as a writer), publish this rank's input `in` of n
 * bytes and whether its peers may read it directly: `ok` and its pages
 * allow it (reads_fast).  *direct: every rank said yes.  On no, the step is
 * acknowledged and the staged path follows in the next steps.  The size in
 * the descriptor carries the verdict: n or 0. */
static int agree_direct(rl_comm *c, rl_opdesc *op, uint32_t step, const void *in, uint64_t n,
                        int ok, int *direct) {
    int r = c->rank, st;
    *direct = ok && reads_fast(in, n);
    publish_addr(c, op, step, in, *direct ? n : 0);
    for (int i = 1; i < c->size; i++) {
        int q = (r + i) % c->size;
        rl_hdr got, want;
        if ((st = peek_in(c, op, BIG, q, step, &got)) != RL_OK) return st;
        rl_fill_header(&want, c, op, 0, got.nbytes == n ? n : 0);
        if (memcmp(&got, &want, sizeof got) != 0) return rl_check_header(c, op, q, &got, &want);
        if (got.nbytes != n) *direct = 0;
    }
    if (!*direct) step_ack(c, BIG, step);
    return RL_OK;
}

/* Scratch for the peers' pieces (few system calls), and the sub-block whose
 * running result stays in L1. */
#define RD_PIECES ((size_t)2 << 20)
#define RD_SUB ((size_t)16 << 10)

/* dst = in_0 op in_1 op ... op in_{P-1} over `count` elements at byte `off`
 * of every rank's input (published in `step`; this rank's is `in`), in rank
 * order as reduce_slots, so the same bits as the staged path.  Each peer's
 * piece is read whole, then reduced in sub-blocks; from 4 MiB the result is
 * streamed out of L1 (its lines are not read first).  dst may be this
 * rank's own block of `in` (in place): the last pass writes it.  to: the
 * rank whose memory dst is, or -1 for an all_reduce: dst is this rank's own
 * block, and each piece's result is written into every peer at the same
 * offset too (no peer reads that block of any buffer but this rank); another
 * rank's (a reduce's root) receives each
 * piece's result with one write (cma_write). */
static int direct_reduce_block(rl_comm *c, rl_opdesc *op, uint32_t step, const char *in,
                               size_t off, char *dst, int to, size_t count, rl_dtype dt,
                               rl_redop rop) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank, st, away = to >= 0 && to != r, all = to < 0;
    size_t esz = rl_dtype_size(dt);
    size_t pe = RD_PIECES / (size_t)(P - 1) / 4096 * 4096 / esz, se = RD_SUB / esz;
    if (pe < se) pe = se;
    char *tmp;
    size_t extra = away ? pe + se : se;
    if ((st = rl_scratch(c, op, ((size_t)(P - 1) * pe + extra) * esz, away ? NULL : dst, &tmp)) !=
        RL_OK)
        return st;
    char *acc = tmp + (size_t)(P - 1) * pe * esz, *res = acc + se * esz;
    const char *src[SHM_MAX_RANKS];
    /* An all_reduce's pieces are read back for its peers: kept in the cache. */
    int stream = !away && !all && count * esz >= RL_STREAM_COPY_MIN;
    for (size_t k = 0; k < count; k += pe) {
        size_t m = count - k < pe ? count - k : pe, at_k = off + k * esz;
        char *to_k = away ? res : dst + k * esz;
        for (int q = 0, t = 0; q < P; q++) {
            if (q == r) {
                src[q] = in + at_k;
                continue;
            }
            char *into = tmp + (size_t)(t++) * pe * esz;
            uint64_t at = peer_addr(s, q, step);
            if ((st = cma_read(c, op, q, into, at + at_k, m * esz)) != RL_OK) return st;
            src[q] = into;
        }
        for (size_t j = 0; j < m; j += se) {
            size_t h = m - j < se ? m - j : se, at = j * esz;
            const char *prev = src[0] + at;
            for (int q = 1; q < P; q++) {
                char *to = q == P - 1 && !stream ? to_k + at : acc;
                rl_reduce_kernel(to, prev, src[q] + at, h, dt, rop);
                prev = to;
            }
            if (rop == RL_AVG) rl_scale_kernel((char *)prev, h, dt, 1.0 / P);
            if (stream) rl_copy_stream(to_k + at, acc, h * esz);
        }
        if (away && (st = cma_write(c, op, to, (uint64_t)(uintptr_t)dst + k * esz, res,
                                    m * esz)) != RL_OK)
            return st;
        for (int i = 1; all && i < P; i++) {
            int q = (r + i) % P;
            uint64_t at = peer_addr(s, q, step);
            if ((st = cma_write(c, op, q, at + at_k, to_k, m * esz)) != RL_OK) return st;
        }
    }
    return RL_OK;
}

/* ---- reduce_scatter ----------------------------------------------------------
 * Staged: per step every rank copies the same piece of each of its P input
 * blocks into its input area (P pieces of up to chunk/P bytes) and
 * publishes; rank r reduces piece r of all P areas, in rank order, straight
 * into out.  Writes P*n per step, reads P*n.
 *
 * Single copy (blocks of more than one chunk and at least cma_min): rank r
 * reads block r of every peer's input directly and reduces it with its own
 * (direct_reduce_block), straight into out; one step to agree and publish
 * the addresses, one acknowledgement at the end (docs/algorithms.md). */
static int cma_reduce_scatter(rl_comm *c, rl_opdesc *op, char *out, const char *in, size_t count,
                              rl_dtype dt, rl_redop rop, int *done) {
    int P = c->size, r = c->rank;
    size_t esz = rl_dtype_size(dt), blk = count * esz, n = blk * (size_t)P;
    uint32_t step;
    int st;
    *done = 0;
    if ((st = step_begin(c, op, BIG, 1, &step)) != RL_OK) return st;
    /* Peers read this rank's input blocks but its own while it writes out. */
    int ok = out == in + (size_t)r * blk || !rl_overlap(out, blk, in, n);
    if ((st = agree_direct(c, op, step, in, n, ok, done)) != RL_OK || !*done) return st;
    op->algo = "shm_single_copy";
    if ((st = direct_reduce_block(c, op, step, in, (size_t)r * blk, out, r, count, dt, rop)) !=
        RL_OK)
        return st;
    step_ack(c, BIG, step);
    /* The input stays in use until every peer has read it. */
    return wait_peers_ack(c, op, step, blk);
}

/* ---- reduce and all_reduce, single copy ----------------------------------------- */
/* Block i of a reduce's single copy.  While the blocks stay in the caches a
 * leaf, which also writes its result into the root (2P - 1 passes over its
 * block: P - 1 reads, P - 1 reductions, one write, where the root makes
 * 2P - 2), spends more CPU time per byte: the root's block is larger by that
 * ratio so that both finish together.  Beyond RD_WEIGHTED_BYTES memory
 * traffic decides and equal blocks were faster (docs/experiments.md); an
 * all_reduce's blocks are equal. */
#define RD_WEIGHTED_BYTES ((size_t)4 << 20)
static size_t reduce_block_start(size_t count, size_t esz, int P, int i, int root) {
    if (root < 0 || count * esz > RD_WEIGHTED_BYTES) return rl_block_start(count, P, i);
    unsigned __int128 before = (unsigned __int128)(2 * P - 2) * (unsigned)i +
                               (root < i ? 1u : 0u);
    return (size_t)((unsigned __int128)count * before /
                    ((unsigned __int128)(2 * P - 2) * (unsigned)P + 1u));
}

/* The reduce_scatter above with the root's buffer as everyone's output:
 * rank r reads block r of every peer's buffer directly, reduces it with its
 * own in rank order, and writes the result into block r of the root's buffer
 * (the root in place, a leaf with one process_vm_writev per piece).  Only
 * leaf r touches block r of the root's buffer, reading it before writing it.
 * No copy-in and no copy-out: every rank reads n and writes about n / P; one
 * step to agree, one acknowledgement at the end (docs/algorithms.md).  An
 * all_reduce (root -1) writes block r into its own buffer and every peer's:
 * it writes (P-1) n / P more.  Idle, the staged pipeline caught up from
 * shm_cma_all_reduce_bytes, where its reads and writes hit the caches; beside
 * busy loops its hand-overs lost at every size (docs/experiments.md). */
static int cma_reduce(rl_comm *c, rl_opdesc *op, char *buf, size_t count, rl_dtype dt,
                      rl_redop rop, int root, int *done) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    size_t esz = rl_dtype_size(dt), b0 = reduce_block_start(count, esz, P, r, root);
    size_t bn = reduce_block_start(count, esz, P, r + 1, root) - b0, bs = b0 * esz;
    uint32_t step;
    int st;
    *done = 0;
    if ((st = step_begin(c, op, BIG, 1, &step)) != RL_OK) return st;
    int ok = root >= 0 || count * esz <= (uint64_t)rl_tune.shm_cma_all_reduce_bytes ||
             rl_host_contended(rl_now_ns());
    if ((st = agree_direct(c, op, step, buf, count * esz, ok, done)) != RL_OK || !*done) return st;
    op->algo = "shm_single_copy";
    char *dst = buf + bs;
    if (root >= 0 && r != root)
        dst = (char *)(uintptr_t)(peer_addr(s, root, step) + bs);
    if ((st = direct_reduce_block(c, op, step, buf, bs, dst, root, bn, dt, rop)) != RL_OK)
        return st;
    step_ack(c, BIG, step);
    /* Peers read this buffer (and the root's receives) until each has acked. */
    return wait_peers_ack(c, op, step, count * esz / P);
}

int rl_shm_reduce_scatter(rl_comm *c, rl_opdesc *op, void *out, const void *in, size_t count,
                          rl_dtype dt, rl_redop rop) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    size_t esz = rl_dtype_size(dt);
    int lane = lane_for(s, count * esz * (size_t)P);
    size_t ce = lane_bytes(s, lane) / (size_t)P / esz;
    uint32_t step;
    int st;
    note_op(c, op);
    size_t blk = count * esz;
    if (lane == BIG && P > 1 && s->cma_min && blk > s->chunk && blk >= s->cma_min) {
        int done;
        if ((st = cma_reduce_scatter(c, op, out, in, count, dt, rop, &done)) != RL_OK || done)
            return st;
    }
    op->algo = lane == SMALL ? "shm_slot" : "shm_flat";
    /* Results land in out piece by piece while later pieces of in are still
     * to be read: an out overlapping in anywhere but our own block (where
     * each piece is read before it is written) is staged in scratch. */
    char *dst = out;
    if ((const char *)out != (const char *)in + (size_t)r * count * esz &&
        rl_overlap(out, count * esz, in, count * esz * (size_t)P)) {
        if ((st = rl_scratch(c, op, count * esz, out, &dst)) != RL_OK) return st;
    }
    for (size_t k = 0, part = 0; k < count; k += ce, part++) {
        size_t n = count - k < ce ? count - k : ce;
        if ((st = step_begin(c, op, lane, 1, &step)) != RL_OK) return st;
        char *mine = in_area(s, r, lane, step);
        for (int q = 0; q < P; q++)
            rl_copy(mine + (size_t)q * n * esz, (const char *)in + ((size_t)q * count + k) * esz,
                   n * esz);
        publish_in(c, op, lane, step, (uint32_t)part, n * esz);
        if ((st = wait_all_in(c, op, lane, step, (uint32_t)part, n * esz)) != RL_OK) return st;
        reduce_slots(c, lane, step, (size_t)r * n * esz, dst + k * esz, n, dt, rop);
        step_ack(c, lane, step);
    }
    if (dst != (char *)out) rl_move(out, dst, count * esz);
    return RL_OK;
}

/* ---- gather and scatter ------------------------------------------------------
 * gather: per step every leaf copies a piece of its block in and publishes;
 * the root copies that piece of every block out.  Leaves leave without
 * waiting (in the small and medium lanes they run ahead).  scatter: per step
 * the root copies the same piece of every block in (P pieces of up to 1/P of
 * the lane's step) and publishes; each leaf copies its piece out.  The root's own
 * block moves by memmove: first for gather (`one` is then free), last for
 * scatter (after every piece of `many` was read). */
/* Single copy for scatter (blocks >= cma_min, and above one chunk beyond 2
 * ranks): the root publishes its buffer's address in one big-lane step, moves
 * its own block while the leaves read theirs straight from it, and returns
 * once every leaf has.  Leaf r's block starts at r * stride: blk for a
 * scatter, 0 for a broadcast (every leaf reads the whole buffer).  (Below one
 * chunk the staged scatter takes one step and its root runs ahead of its 3 or
 * more leaves: measured slower single-copy, docs/experiments.md.) */
static int cma_scatter(rl_comm *c, rl_opdesc *op, void *many, void *one, size_t blk, int root,
                       size_t stride) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    char *mine = (char *)many + (size_t)root * stride;
    uint32_t step;
    int st;
    op->algo = "shm_single_copy";
    if ((st = step_begin(c, op, BIG, r == root, &step)) != RL_OK) return st;
    if (r == root) {
        publish_addr(c, op, step, many, blk);
        step_ack(c, BIG, step);
        /* The root's own block moves while the leaves read theirs, unless its
         * output lies in the buffer they read. */
        int early = mine != (char *)one && !rl_overlap(one, blk, many, blk * (size_t)P);
        if (early) copy_own(one, mine, blk, RL_STREAM_OUT_MIN);
        if ((st = wait_peers_ack(c, op, step, blk)) != RL_OK) return st;
        if (mine != (char *)one && !early) rl_move(one, mine, blk);
        return RL_OK;
    }
    if ((st = wait_in(c, op, BIG, root, step, 0, blk)) != RL_OK) return st;
    uint64_t at = peer_addr(s, root, step);
    if ((st = cma_read(c, op, root, one, at + (uint64_t)r * stride, blk)) != RL_OK) return st;
    step_ack(c, BIG, step);
    return RL_OK;
}

/* A gather whose leaves write their blocks straight into the root's output
 * (process_vm_writev) while the root moves its own: one big-lane step in
 * which the root publishes its output's address, then waits until every leaf
 * has acknowledged its write.  Every rank copies one block, in parallel,
 * where the staged root copies P blocks out of the segment and a root
 * reading the leaves directly copies them all itself.  An input that
 * overlaps the output anywhere moves before the leaves may write. */
static int cma_gather(rl_comm *c, rl_opdesc *op, char *many, const char *one, size_t blk,
                      int root) {
    rl_shm *s = c->shm;
    int r = c->rank;
    char *mine = many + (size_t)root * blk;
    uint32_t step;
    int st;
    op->algo = "shm_leaf_write";
    if ((st = step_begin(c, op, BIG, r == root, &step)) != RL_OK) return st;
    if (r == root) {
        int early = mine != one && rl_overlap(one, blk, many, blk * (size_t)c->size);
        if (early) rl_move(mine, one, blk);
        publish_addr(c, op, step, many, blk);
        step_ack(c, BIG, step);
        if (mine != one && !early) copy_own(mine, one, blk, RL_STREAM_COPY_MIN);
        return wait_peers_ack(c, op, step, blk);
    }
    if ((st = wait_in(c, op, BIG, root, step, 0, blk)) != RL_OK) return st;
    uint64_t at = peer_addr(s, root, step);
    if ((st = cma_write(c, op, root, at + (uint64_t)r * blk, one, blk)) != RL_OK) return st;
    step_ack(c, BIG, step);
    return RL_OK;
}

int rl_shm_rooted(rl_comm *c, rl_opdesc *op, int gather, void *many, void *one, size_t blk,
                  int root) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    /* A gather's root reads every leaf's slots, P times a broadcast reader's
     * span of the lane: with whole slots its lines fall out of the caches
     * between uses (docs/algorithms.md), so it keeps blocks up to half a slot. */
    int lane = gather ? lane_rooted(s, blk, s->pool[MID].bytes / 2, P)
                      : lane_rooted(s, blk * (size_t)P, s->chunk, P);
    size_t area = lane_bytes(s, lane);
    size_t piece = gather ? area : area / (size_t)P;
    char *mine = (char *)many + (size_t)root * blk;
    uint32_t step;
    int st;
    note_op(c, op);
    if (!gather && lane != SMALL && s->cma_min && blk >= s->cma_min && (blk > s->chunk || P == 2))
        return cma_scatter(c, op, many, one, blk, root, blk);
    /* A gather's leaves write their blocks straight into the root's output
     * (cma_gather): at 2 ranks from cma_min, beyond only above one chunk,
     * where leaves that wait for the root's address no longer lose to staged
     * leaves running ahead on a busy host (docs/experiments.md). */
    if (gather && lane == BIG && s->cma_min && blk >= s->cma_min && (P == 2 || blk > s->chunk))
        return cma_gather(c, op, many, one, blk, root);
    if (r == root && gather && mine != (char *)one) {
        if (rl_overlap(mine, blk, one, blk)) rl_move(mine, one, blk);
        else copy_own(mine, one, blk, RL_STREAM_COPY_MIN);
    }
    op->algo = lane_algo(lane);
    int writes = gather ? r != root : r == root;
    for (size_t k = 0, part = 0; k < blk; k += piece, part++) {
        size_t n = blk - k < piece ? blk - k : piece;
        if ((st = step_begin(c, op, lane, writes, &step)) != RL_OK) return st;
        if (gather && r != root) {
            rl_copy(in_area(s, r, lane, step), (char *)one + k, n);
            publish_in(c, op, lane, step, (uint32_t)part, n);
        } else if (gather) {
            for (int i = 1; i < P; i++) {
                int q = (r + i) % P;
                if ((st = wait_in(c, op, lane, q, step, (uint32_t)part, n)) != RL_OK) return st;
                rl_copy((char *)many + (size_t)q * blk + k, in_area(s, q, lane, step), n);
            }
        } else if (r == root) {
            char *dst = in_area(s, r, lane, step);
            for (int q = 0; q < P; q++)
                if (q != root) rl_copy(dst + (size_t)q * n, (char *)many + (size_t)q * blk + k, n);
            publish_in(c, op, lane, step, (uint32_t)part, n);
        } else {
            if ((st = wait_in(c, op, lane, root, step, (uint32_t)part, n)) != RL_OK) return st;
            rl_copy((char *)one + k, in_area(s, root, lane, step) + (size_t)r * n, n);
        }
        step_ack(c, lane, step);
    }
    if (r == root && !gather && mine != (char *)one) rl_move(one, mine, blk);
    return RL_OK;
}

/* ---- all_to_all (equal blocks) -------------------------------------------------
 * Per step every rank copies the same piece of each of its P blocks in (as
 * reduce_scatter does) and publishes; rank r copies piece r of every rank's
 * area into block q of out.  An out that overlaps in is staged in scratch:
 * later pieces of in are read after earlier pieces of out were written. */
/* Single copy between every pair: each rank publishes src; block q of out
 * is read from rank q's src at offset `at_off` (this rank's block there),
 * this rank's own from its src.  src must not overlap out except as out's
 * block r: peers read it while this rank writes the others. */
static int cma_exchange(rl_comm *c, rl_opdesc *op, char *out, const char *src, size_t blk,
                        size_t at_off) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    uint32_t step;
    int st;
    op->algo = "shm_single_copy";
    if ((st = open_addr(c, op, src, blk, &step)) != RL_OK) return st;
    /* The own block: at 2 ranks beside the peer's read of ours; beyond, after
     * this rank's ack, which then frees sooner the peers waiting to reuse
     * their input (docs/experiments.md). */
    int own = out + (size_t)r * blk != src + at_off;
    if (own && P == 2) copy_own(out + (size_t)r * blk, src + at_off, blk, RL_STREAM_COPY_MIN);
    for (int i = 1; i < P; i++) {
        int q = (r + i) % P;
        if ((st = wait_in(c, op, BIG, q, step, 0, blk)) != RL_OK) return st;
        uint64_t at = peer_addr(s, q, step);
        st = cma_read(c, op, q, out + (size_t)q * blk, at + (uint64_t)at_off, blk);
        if (st != RL_OK) return st;
    }
    step_ack(c, BIG, step);
    if (own && P > 2) copy_own(out + (size_t)r * blk, src + at_off, blk, RL_STREAM_COPY_MIN);
    /* The input stays in use until every peer has read it. */
    return wait_peers_ack(c, op, step, blk);
}

static int cma_all_to_all(rl_comm *c, rl_opdesc *op, void *out, const void *in, size_t blk) {
    size_t span = blk * (size_t)c->size;
    const char *src = in;
    if (rl_overlap(out, span, in, span)) {
        /* Peers read this rank's input while it writes its output. */
        char *tmp;
        int st = rl_scratch(c, op, span, in, &tmp);
        if (st != RL_OK) return st;
        rl_copy(tmp, in, span);
        src = tmp;
    }
    return cma_exchange(c, op, out, src, blk, (size_t)c->rank * blk);
}

/* Whether all_to_all (and all_to_all_v, by its largest block) reads blocks of
 * `blk` bytes straight from the peers: at 2 ranks from cma_pair; beyond, from
 * cma_min and above one chunk, below which the staged pieces ran faster here
 * (docs/experiments.md, "all_to_all's single copy beyond 2 ranks"). */
static int a2a_direct(const rl_shm *s, int P, uint64_t blk) {
    if (P == 2) return s->cma_pair && blk >= s->cma_pair;
    return s->cma_min && blk >= s->cma_min && blk > s->chunk;
}

int rl_shm_all_to_all(rl_comm *c, rl_opdesc *op, void *out, const void *in, size_t blk) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    int lane = lane_for(s, blk * (size_t)P);
    size_t piece = lane_bytes(s, lane) / (size_t)P;
    uint32_t step;
    int st;
    note_op(c, op);
    if (lane == BIG && a2a_direct(s, P, blk)) return cma_all_to_all(c, op, out, in, blk);
    op->algo = lane == SMALL ? "shm_slot" : "shm_copy";
    char *dst = out;
    size_t span = blk * (size_t)P;
    if (rl_overlap(out, span, in, span) && blk > piece) {
        if ((st = rl_scratch(c, op, span, out, &dst)) != RL_OK) return st;
    }
    for (size_t k = 0, part = 0; k < blk; k += piece, part++) {
        size_t n = blk - k < piece ? blk - k : piece;
        if ((st = step_begin(c, op, lane, 1, &step)) != RL_OK) return st;
        char *area = in_area(s, r, lane, step);
        for (int q = 0; q < P; q++)
            if (q != r) rl_copy(area + (size_t)q * n, (const char *)in + (size_t)q * blk + k, n);
        publish_in(c, op, lane, step, (uint32_t)part, n);
        /* The own block skips the segment; an input that overlaps the output
         * (one piece: a larger one went to scratch) is all staged by now. */
        char *own = dst + (size_t)r * blk + k;
        const char *from = (const char *)in + (size_t)r * blk + k;
        if (own != from) rl_move(own, from, n);
        for (int i = 1; i < P; i++) {
            int q = (r + i) % P;
            if ((st = wait_in(c, op, lane, q, step, (uint32_t)part, n)) != RL_OK) return st;
            rl_copy(dst + (size_t)q * blk + k, in_area(s, q, lane, step) + (size_t)r * n, n);
        }
        step_ack(c, lane, step);
    }
    if (dst != (char *)out) rl_copy(out, dst, span);
    return RL_OK;
}

/* ---- all_to_all_v ----------------------------------------------------------
 * A rank knows only its own counts, so its first step (the small lane when
 * the table fits a slot) publishes a table: its input's address, the bytes it
 * sends each peer, where they start in its input and, when all its blocks fit
 * the slot behind the table, where they start there.  After reading every
 * table each rank knows every pair's size: a pair whose sizes disagree fails
 * as a desync naming both, and all ranks derive the same largest block.  When
 * every rank packed its blocks, each copies its own out of the peers' slots;
 * from the single-copy size, each reads its own straight from the peers'
 * inputs; both within the tables' step.  Otherwise the blocks follow as in
 * all_to_all, staged in pieces of lane/P bytes per peer, as many steps as the
 * largest block takes (docs/algorithms.md). */
typedef struct {
    uint64_t packed; /* the blocks follow the table in the slot */
    uint64_t addr;   /* the input, for the peers' direct reads */
} a2av_head;
typedef struct {
    uint64_t n;    /* bytes this rank sends the peer */
    uint64_t in;   /* where they start in its input */
    uint64_t slot; /* where they start in its slot, when packed */
} a2av_ent;

static size_t a2av_table_bytes(int P) {
    return (sizeof(a2av_head) + sizeof(a2av_ent) * (size_t)P + 63) & ~(size_t)63;
}
static inline a2av_head a2av_head_of(const char *area) {
    a2av_head h;
    memcpy(&h, area, sizeof h);
    return h;
}
static inline const a2av_ent *a2av_ents(const char *area) {
    return (const a2av_ent *)(area + sizeof(a2av_head));
}

/* Fill the table in `area` from counts and displs (elements of esz bytes),
 * every rank but `self` given a place in the slot behind the table; returns
 * where that layout ends and the largest of those blocks in *most. */
static uint64_t a2av_fill(char *area, int P, int self, const size_t *counts,
                          const size_t *displs, size_t esz, size_t tab, uint64_t *most) {
    a2av_ent *tbl = (a2av_ent *)(area + sizeof(a2av_head));
    uint64_t at = tab;
    *most = 0;
    for (int q = 0; q < P; q++) {
        tbl[q] = (a2av_ent){counts[q] * esz, displs[q] * esz, 0};
        if (q == self) continue;
        tbl[q].slot = at;
        at = (at + tbl[q].n + 63) & ~(uint64_t)63;
        if (tbl[q].n > *most) *most = tbl[q].n;
    }
    return at;
}

/* Rank q sends `got` bytes where this rank expects `want`: the same words as
 * a frame whose pair total differs (the TCP path's check). */
static int a2av_desync(rl_comm *c, const rl_opdesc *op, int q, uint64_t want, uint64_t got) {
    rl_opdesc o = *op;
    rl_hdr w, g;
    o.total = want;
    rl_fill_header(&w, c, &o, 0, 0);
    o.total = got;
    rl_fill_header(&g, c, &o, 0, 0);
    return rl_check_header(c, op, q, &g, &w);
}

typedef struct {
    char *out;
    const char *in;
    const size_t *out_displs, *in_counts, *in_displs;
    size_t esz;
    char *own; /* this rank's block: to and from */
    const char *own_in;
    size_t own_n;
} a2av_bufs;

/* Single copy within the tables' step (lane, step): read each peer's block
 * from its input into the output, acknowledge, then wait until every peer has
 * read this rank's input.  The own block moves as all_to_all's does. */
static int a2av_read(rl_comm *c, rl_opdesc *op, int lane, uint32_t step, const a2av_bufs *b,
                     uint64_t most) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank, st;
    op->algo = "shm_single_copy";
    if (P == 2) copy_own(b->own, b->own_in, b->own_n, RL_STREAM_COPY_MIN);
    for (int i = 1; i < P; i++) {
        int q = (r + i) % P;
        const char *qa = in_area(s, q, lane, step);
        const a2av_ent *e = a2av_ents(qa) + r;
        if (e->n && (st = cma_read(c, op, q, b->out + b->out_displs[q] * b->esz,
                                   a2av_head_of(qa).addr + e->in, e->n)) != RL_OK)
            return st;
    }
    step_ack(c, lane, step);
    if (P > 2) copy_own(b->own, b->own_in, b->own_n, RL_STREAM_COPY_MIN);
    for (int q = 0; q < P; q++) {
        if (q != r && (st = wait_copy(c, op, lane_ack(s, q, lane), step, q, most)) != RL_OK)
            return st;
    }
    return RL_OK;
}

/* The blocks staged after the tables' step; from[q]: the bytes q sends. */
static int a2av_staged(rl_comm *c, rl_opdesc *op, const a2av_bufs *b, const uint64_t *from,
                       uint64_t most) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank, st;
    int lane = lane_for(s, most * (uint64_t)P);
    size_t piece = lane_bytes(s, lane) / (size_t)P;
    uint32_t step;
    op->algo = lane == SMALL ? "shm_slot" : "shm_copy";
    copy_own(b->own, b->own_in, b->own_n, RL_STREAM_COPY_MIN);
    for (uint64_t k = 0, part = 0; k < most; k += piece, part++) {
        if ((st = step_begin(c, op, lane, 1, &step)) != RL_OK) return st;
        char *area = in_area(s, r, lane, step);
        for (int q = 0; q < P; q++) {
            size_t n = b->in_counts[q] * b->esz;
            if (q != r && n > k)
                rl_copy(area + (size_t)q * piece, b->in + b->in_displs[q] * b->esz + k,
                        n - k < piece ? n - k : piece);
        }
        publish_in(c, op, lane, step, (uint32_t)part, piece);
        for (int i = 1; i < P; i++) {
            int q = (r + i) % P;
            if ((st = wait_in(c, op, lane, q, step, (uint32_t)part, piece)) != RL_OK) return st;
            if (from[q] > k)
                rl_copy(b->out + b->out_displs[q] * b->esz + k,
                        in_area(s, q, lane, step) + (size_t)r * piece,
                        from[q] - k < piece ? from[q] - k : piece);
        }
        step_ack(c, lane, step);
    }
    return RL_OK;
}

int rl_shm_all_to_all_v(rl_comm *c, rl_opdesc *op, void *out, const size_t *out_counts,
                        const size_t *out_displs, const void *in, const size_t *in_counts,
                        const size_t *in_displs, rl_dtype dt) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    size_t esz = rl_dtype_size(dt), tab = a2av_table_bytes(P);
    int meta = lane_for(s, tab);
    size_t cap = lane_bytes(s, meta);
    a2av_bufs b = {out, in, out_displs, in_counts, in_displs, esz,
                   (char *)out + out_displs[r] * esz, (const char *)in + in_displs[r] * esz,
                   in_counts[r] * esz};
    uint32_t step;
    note_op(c, op);
    op->algo = lane_algo(meta);
    uint64_t *from = malloc((size_t)P * sizeof *from);
    if (!from) return RL_ERR_NOMEM;
    int st = step_begin(c, op, meta, 1, &step);
    if (st != RL_OK) goto done;
    char *area = in_area(s, r, meta, step);
    const a2av_ent *tbl = a2av_ents(area);
    uint64_t most, at = a2av_fill(area, P, r, in_counts, in_displs, esz, tab, &most);
    a2av_head mine = {at <= cap, (uint64_t)(uintptr_t)in};
    for (int q = 0; q < P && mine.packed; q++)
        if (q != r) rl_copy(area + tbl[q].slot, b.in + tbl[q].in, tbl[q].n);
    memcpy(area, &mine, sizeof mine);
    publish_in(c, op, meta, step, 0, tab);
    int packed = (int)mine.packed;
    for (int i = 1; i < P; i++) {
        int q = (r + i) % P;
        if ((st = wait_in(c, op, meta, q, step, 0, tab)) != RL_OK) goto done;
        const char *qa = in_area(s, q, meta, step);
        const a2av_ent *e = a2av_ents(qa);
        if (e[r].n != out_counts[q] * esz) {
            st = a2av_desync(c, op, q, out_counts[q] * esz, e[r].n);
            goto done;
        }
        int theirs = a2av_head_of(qa).packed != 0;
        packed &= theirs;
        if (theirs && (e[r].slot < tab || e[r].slot > cap || e[r].n > cap - e[r].slot)) {
            st = rl_fail(c, op, RL_ERR_PROTOCOL, q, 0,
                         "all_to_all_v: the peer's table places %llu bytes at %llu of a %zu-byte slot",
                         (unsigned long long)e[r].n, (unsigned long long)e[r].slot, cap);
            goto done;
        }
        for (int p = 0; p < P; p++)
            if (p != q && e[p].n > most) most = e[p].n;
        from[q] = e[r].n;
    }
    if (!packed && lane_for(s, most * (uint64_t)P) == BIG && a2a_direct(s, P, most)) {
        st = a2av_read(c, op, meta, step, &b, most);
        goto done;
    }
    if (packed || !most) {
        rl_copy(b.own, b.own_in, b.own_n);
        for (int i = 1; i < P && packed; i++) {
            int q = (r + i) % P;
            const char *qa = in_area(s, q, meta, step);
            rl_copy(b.out + out_displs[q] * esz, qa + a2av_ents(qa)[r].slot, from[q]);
        }
    }
    step_ack(c, meta, step);
    if (!packed && most) st = a2av_staged(c, op, &b, from, most);
done:
    free(from);
    return st;
}

/* ---- gather_v and scatter_v ------------------------------------------------
 * Only the root knows the counts, so its first step (the small lane when the
 * table fits a slot) publishes a table as all_to_all_v's: its buffer's
 * address and, per rank, the bytes and their place in its buffer; a
 * scatter's root packs the blocks behind it when they all fit.  Each leaf
 * checks its own size against the root's (a disagreement fails there as a
 * desync naming both) and every rank derives the same largest block.  Then,
 * as the equal-block forms do: a packed scatter's leaves copy their blocks
 * out of the root's slot; large blocks move in single copies within the
 * table's step (leaves read from or write into the root's buffer, which
 * returns once every leaf has acknowledged); otherwise staged pieces, as many
 * steps as the largest block takes. */
static int rooted_v_staged(rl_comm *c, rl_opdesc *op, int gather, char *many,
                           const a2av_ent *tbl, char *one, size_t n_own, int root,
                           uint64_t most) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank, st;
    int lane = gather ? lane_rooted(s, most, s->pool[MID].bytes / 2, P)
                      : lane_rooted(s, most * (uint64_t)P, s->chunk, P);
    size_t piece = gather ? lane_bytes(s, lane) : lane_bytes(s, lane) / (size_t)P;
    int writes = gather ? r != root : r == root;
    uint32_t step;
    op->algo = lane_algo(lane);
    for (uint64_t k = 0, part = 0; k < most; k += piece, part++) {
        if ((st = step_begin(c, op, lane, writes, &step)) != RL_OK) return st;
        size_t mine = n_own > k ? (n_own - k < piece ? n_own - k : piece) : 0;
        if (gather && r != root) {
            rl_copy(in_area(s, r, lane, step), one + k, mine);
            publish_in(c, op, lane, step, (uint32_t)part, piece);
        } else if (gather) {
            for (int i = 1; i < P; i++) {
                int q = (r + i) % P;
                if ((st = wait_in(c, op, lane, q, step, (uint32_t)part, piece)) != RL_OK) return st;
                if (tbl[q].n > k)
                    rl_copy(many + tbl[q].in + k, in_area(s, q, lane, step),
                            tbl[q].n - k < piece ? tbl[q].n - k : piece);
            }
        } else if (r == root) {
            char *area = in_area(s, r, lane, step);
            for (int q = 0; q < P; q++)
                if (q != root && tbl[q].n > k)
                    rl_copy(area + (size_t)q * piece, many + tbl[q].in + k,
                            tbl[q].n - k < piece ? tbl[q].n - k : piece);
            publish_in(c, op, lane, step, (uint32_t)part, piece);
        } else {
            if ((st = wait_in(c, op, lane, root, step, (uint32_t)part, piece)) != RL_OK) return st;
            rl_copy(one + k, in_area(s, root, lane, step) + (size_t)r * piece, mine);
        }
        step_ack(c, lane, step);
    }
    return RL_OK;
}

/* Whether blocks of up to `most` bytes move in single copies (the equal-block
 * forms' thresholds). */
static int rooted_v_direct(const rl_shm *s, int gather, uint64_t most, int P) {
    if (!s->cma_min || most < s->cma_min) return 0;
    if (gather) return P == 2 || most > s->chunk;
    return lane_rooted(s, most * (uint64_t)P, s->chunk, P) != SMALL && (most > s->chunk || P == 2);
}

/* gather_v where single copies work: one step, in which each leaf publishes
 * its size and, when its block fits its slot, the block (such a leaf leaves at
 * once, as a gather's leaves do); a larger block is written into the root's
 * output at the place the root's table gives.  The root checks every leaf's
 * size (a disagreement fails there as a desync naming both), copies the
 * slotted blocks out and returns once every writer has acknowledged.
 * With the table in a small slot, every rank also takes one medium step:
 * blocks up to a medium slot ride there, so those leaves run ahead as a
 * gather's staged leaves do instead of waiting for the root's table (a
 * hand-over per op, which a busy host turns into a wake-up).  Whole slots,
 * where the equal-block gather keeps half: faster here, idle and busy
 * (docs/experiments.md). */
enum { GV_SLOT = 1, GV_WRITE = 2, GV_MID = 3 };

static int gather_v_step(rl_comm *c, rl_opdesc *op, char *many, const size_t *counts,
                         const size_t *displs, const char *one, size_t n_own, size_t esz,
                         int root, int lane, size_t tab, uint32_t step) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank, st;
    size_t cap = lane_bytes(s, lane);
    int mid = lane == SMALL && s->pool[MID].slots && s->pool[MID].bytes > cap;
    size_t mid_cap = mid ? s->pool[MID].bytes : 0;
#define GV_HOW(n) ((n) <= cap ? GV_SLOT : (n) <= mid_cap ? GV_MID : GV_WRITE)
    uint32_t ms = 0;
    op->algo = lane_algo(lane);
    if (r != root) {
        int how = GV_HOW(n_own);
        if (mid && (st = step_begin(c, op, MID, how == GV_MID, &ms)) != RL_OK) return st;
        if (how == GV_SLOT) rl_copy(in_area(s, r, lane, step), one, n_own);
        /* The medium flags go up before the table step's in-flag, whose
         * bell covers them (publish_quiet). */
        if (how == GV_MID) {
            op->algo = lane_algo(MID);
            rl_copy(in_area(s, r, MID, ms), one, n_own);
            rl_fill_header(in_desc(s, r, MID, ms), c, op, GV_MID, n_own);
            publish_quiet(lane_in(s, r, MID, ms), ms);
        }
        if (mid) publish_quiet(lane_ack(s, r, MID), ms);
        publish_in(c, op, lane, step, (uint32_t)how, n_own);
        if (how == GV_WRITE) {
            op->algo = "shm_leaf_write";
            if ((st = wait_in(c, op, lane, root, step, 0, tab)) != RL_OK) return st;
            const char *ra = in_area(s, root, lane, step);
            const a2av_ent *e = a2av_ents(ra) + r;
            if (e->n != n_own) return a2av_desync(c, op, root, n_own, e->n);
            st = cma_write(c, op, root, a2av_head_of(ra).addr + e->in, one, n_own);
            if (st != RL_OK) return st;
        }
        step_ack(c, lane, step);
        return RL_OK;
    }
    if (mid && (st = step_begin(c, op, MID, 0, &ms)) != RL_OK) return st;
    uint64_t most = 0;
    for (int i = 1; i < P; i++) {
        int q = (r + i) % P;
        uint64_t n = counts[q] * esz;
        int how = GV_HOW(n);
        rl_hdr got, want;
        if ((st = peek_in(c, op, lane, q, step, &got)) != RL_OK) return st;
        rl_fill_header(&want, c, op, (uint32_t)how, n);
        if (memcmp(&got, &want, sizeof got) != 0) {
            rl_fill_header(&want, c, op, got.tag, got.nbytes);
            if (memcmp(&got, &want, sizeof got) == 0) return a2av_desync(c, op, q, n, got.nbytes);
            return rl_check_header(c, op, q, &got, &want);
        }
        if (how == GV_SLOT) {
            rl_copy(many + displs[q] * esz, in_area(s, q, lane, step), n);
        } else if (how == GV_MID) {
            if ((st = wait_in(c, op, MID, q, ms, GV_MID, n)) != RL_OK) return st;
            rl_copy(many + displs[q] * esz, in_area(s, q, MID, ms), n);
        } else if (n > most) {
            most = n;
        }
    }
    if (mid) publish_quiet(lane_ack(s, r, MID), ms);
    step_ack(c, lane, step);
    if (most) op->algo = "shm_leaf_write";
    for (int q = 0; q < P; q++) {
        uint64_t n = counts[q] * esz;
        if (q != root && GV_HOW(n) == GV_WRITE &&
            (st = wait_copy(c, op, lane_ack(s, q, lane), step, q, n)) != RL_OK)
            return st;
    }
#undef GV_HOW
    return RL_OK;
}

int rl_shm_rooted_v(rl_comm *c, rl_opdesc *op, int gather, void *many, const size_t *counts,
                    const size_t *displs, void *one, size_t n_own, size_t esz, int root) {
    rl_shm *s = c->shm;
    int P = c->size, r = c->rank;
    size_t tab = a2av_table_bytes(P);
    int meta = lane_for(s, tab);
    size_t cap = lane_bytes(s, meta);
    char *m = many, *o = one;
    uint64_t most = 0;
    uint32_t step;
    int st;
    note_op(c, op);
    op->algo = lane_algo(meta);
    /* With single copies, a gather_v's leaves write in the table's step too. */
    int one_step = gather && s->cma_min;
    if ((st = step_begin(c, op, meta, r == root || one_step, &step)) != RL_OK) return st;
    if (r == root) {
        char *area = in_area(s, r, meta, step);
        const a2av_ent *tbl = a2av_ents(area);
        uint64_t at = a2av_fill(area, P, root, counts, displs, esz, tab, &most);
        a2av_head h = {!gather && at <= cap, (uint64_t)(uintptr_t)m};
        for (int q = 0; q < P && h.packed; q++)
            if (q != root) rl_copy(area + tbl[q].slot, m + tbl[q].in, tbl[q].n);
        char *mine = m + tbl[root].in;
        /* A gather's own block moves before any leaf may write the output. */
        if (gather && mine != o) rl_move(mine, o, n_own);
        memcpy(area, &h, sizeof h);
        publish_in(c, op, meta, step, 0, tab);
        if (one_step)
            return gather_v_step(c, op, m, counts, displs, o, n_own, esz, root, meta, tab, step);
        step_ack(c, meta, step);
        if (h.packed || !most) st = RL_OK;
        else if (rooted_v_direct(s, gather, most, P)) {
            op->algo = gather ? "shm_leaf_write" : "shm_single_copy";
            for (int q = 0; q < P && st == RL_OK; q++)
                if (q != root) st = wait_copy(c, op, lane_ack(s, q, meta), step, q, most);
        } else {
            st = rooted_v_staged(c, op, gather, m, tbl, o, n_own, root, most);
        }
        /* A scatter's own block moves once the leaves have read the input. */
        if (st == RL_OK && !gather && mine != o) rl_move(o, mine, n_own);
        return st;
    }
    if (one_step)
        return gather_v_step(c, op, m, counts, displs, o, n_own, esz, root, meta, tab, step);
    if ((st = wait_in(c, op, meta, root, step, 0, tab)) != RL_OK) return st;
    const char *ra = in_area(s, root, meta, step);
    a2av_head h = a2av_head_of(ra);
    const a2av_ent *e = a2av_ents(ra);
    if (e[r].n != n_own) return a2av_desync(c, op, root, n_own, e[r].n);
    for (int q = 0; q < P; q++)
        if (q != root && e[q].n > most) most = e[q].n;
    if (h.packed) {
        if (e[r].slot < tab || e[r].slot > cap || n_own > cap - e[r].slot)
            return rl_fail(c, op, RL_ERR_PROTOCOL, root, 0,
                           "scatter_v: the root's table places %zu bytes at %llu of a %zu-byte slot",
                           n_own, (unsigned long long)e[r].slot, cap);
        rl_copy(o, ra + e[r].slot, n_own);
    } else if (most && rooted_v_direct(s, gather, most, P) && n_own) {
        op->algo = gather ? "shm_leaf_write" : "shm_single_copy";
        st = gather ? cma_write(c, op, root, h.addr + e[r].in, o, n_own)
                    : cma_read(c, op, root, o, h.addr + e[r].in, n_own);
        if (st != RL_OK) return st;
    } else if (most && !rooted_v_direct(s, gather, most, P)) {
        step_ack(c, meta, step);
        return rooted_v_staged(c, op, gather, m, NULL, o, n_own, root, most);
    }
    step_ack(c, meta, step);
    return RL_OK;
}

/* ---- point to point (SHM_P2P) ------------------------------------------------ */
static inline shm_ring *ring_of(rl_shm *s, int from, int to, int P) {
    return (shm_ring *)(s->rings + ((size_t)from * (size_t)P + (size_t)to) * s->ring_stride);
}
static inline char *cell_of(rl_shm *s, shm_ring *rg, uint32_t n) {
    return (char *)(rg + 1) + (size_t)(n & (s->cells - 1)) * (SHM_SLOT_HDR + SHM_CELL);
}
static inline size_t cells_for(size_t len) { return len ? (len + SHM_CELL - 1) / SHM_CELL : 1; }

static inline uint32_t *stamp_of(char *cell) { return (uint32_t *)(cell + CELL_STAMP); }

/* Wait until the cell at `head` is free: the receiver consumed the one
 * `cells` back.  The tail is read again only when the last value seen says
 * the ring is full (reading it takes the line from the receiver's core). */
static int ring_room(rl_comm *c, const rl_opdesc *op, shm_ring *rg, int dst, uint32_t head) {
    rl_shm *s = c->shm;
    uint32_t want = head + 1 - s->cells;
    if (reached(s->tx_seen[dst], want)) return RL_OK;
    int st = wait_flag(c, op, &rg->tail, want, dst);
    if (st == RL_OK) s->tx_seen[dst] = __atomic_load_n(&rg->tail, __ATOMIC_ACQUIRE);
    return st;
}

/* The pieces of a split message: enough that a side that starts late, or
 * gets less of a core, leaves the rest to the other; whole huge pages when
 * they are large. */
static inline size_t split_piece(size_t len) {
    size_t ch = round_up(len / 16, (size_t)64 << 10);
    if (ch < ((size_t)128 << 10)) ch = (size_t)128 << 10;
    if (ch >= ((size_t)2 << 20)) ch = round_up(ch, (size_t)2 << 20);
    return ch > ((size_t)4 << 20) ? (size_t)4 << 20 : ch;
}

static inline uint32_t split_pieces(size_t len) {
    size_t ch = split_piece(len);
    return (uint32_t)((len + ch - 1) / ch);
}

/* Take pieces of a split message until none is left and copy each: the
 * receiver from the front, reading the sender's buffer (process_vm_readv),
 * the sender from the back, writing into the receiver's (process_vm_writev).
 * Each side's copies stay contiguous, which interleaved pieces were not
 * (docs/experiments.md).  Copied pieces are counted; the receiver returns
 * once all are.  Only the sender's counts can end a wait (the receiver's),
 * so only the sender rings the bell. */
static int split_copy(rl_comm *c, rl_opdesc *op, shm_ring *rg, int peer, int sender,
                      char *mine, uint64_t theirs, size_t len) {
    rl_shm *s = c->shm;
    size_t ch = split_piece(len);
    uint64_t n = split_pieces(len), mine_inc = sender ? 1 : (uint64_t)1 << 32;
    for (;;) {
        uint64_t v = __atomic_load_n(&rg->claims, __ATOMIC_ACQUIRE), k;
        do {
            if ((v >> 32) + (v & 0xffffffffu) >= n) return RL_OK;
        } while (!__atomic_compare_exchange_n(&rg->claims, &v, v + mine_inc, 0, __ATOMIC_ACQ_REL,
                                              __ATOMIC_ACQUIRE));
        k = sender ? n - 1 - (v & 0xffffffffu) : v >> 32;
        size_t off = (size_t)k * ch, m = len - off < ch ? len - off : ch;
        int st = sender ? cma_write(c, op, peer, theirs + off, mine + off, m)
                        : cma_read(c, op, peer, mine + off, theirs + off, m);
        if (st != RL_OK) return st;
        __atomic_fetch_add(&rg->copied, 1, __ATOMIC_SEQ_CST);
        if (sender && __atomic_load_n(&s->ctrl[c->rank].waiters, __ATOMIC_SEQ_CST))
            ring_bell(s->hdr);
    }
}

/* A message larger than the ring (and than shm_cma_bytes) goes as one cell
 * that holds its header and the address of the sender's buffer: the
 * receiver reads the buffer straight into its own (process_vm_readv) and
 * then consumes the cell, which tells the sender it may return.  A send
 * that large already waited for the receiver to drain the ring, so no
 * program that worked before blocks now; the bytes move once instead of
 * twice.  Split (shm_p2p_split): the receiver posts its buffer's address
 * and both sides copy pieces (split_copy), so the sender's core works
 * instead of waiting, and a side that gets no core leaves the pieces to the
 * other. */
static int send_direct(rl_comm *c, rl_opdesc *op, int dst, const rl_hdr *h,
                       const void *buf) {
    rl_shm *s = c->shm;
    int split = rl_tune.shm_p2p_split > 0;
    op->algo = split ? "shm_split_copy" : "shm_single_copy";
    shm_ring *rg = ring_of(s, c->rank, dst, c->size);
    uint32_t head = s->tx_head[dst];
    int st = ring_room(c, op, rg, dst, head);
    if (st != RL_OK) return st;
    char *cell = cell_of(s, rg, head);
    rl_hdr d = *h;
    d.flags |= SHM_FRAME_DIRECT | (split ? SHM_FRAME_SPLIT : 0u);
    memcpy(cell, &d, sizeof d);
    uint64_t at = (uint64_t)(uintptr_t)buf;
    memcpy(cell + CELL_INLINE, &at, sizeof at);
    /* `posted` still names an older message, perhaps 2^31 stamps old: one
     * stamp behind this one, it can only mean "not yet". */
    if (split) __atomic_store_n(&rg->posted, head, __ATOMIC_RELAXED);
    publish(s, c->rank, stamp_of(cell), ++head);
    s->tx_head[dst] = head;
    uint64_t spin = h->nbytes;
    if (split) {
        if ((st = wait_flag(c, op, &rg->posted, head, dst)) != RL_OK) return st;
        uint64_t to = __atomic_load_n(&rg->dst, __ATOMIC_ACQUIRE);
        if ((st = split_copy(c, op, rg, dst, 1, (char *)buf, to, h->nbytes)) != RL_OK) return st;
        spin = split_piece(h->nbytes);
    }
    /* Return only once the receiver has read the buffer (or the job failed). */
    st = wait_copy(c, op, &rg->tail, head, dst, spin);
    if (st == RL_OK) s->tx_seen[dst] = head;
    return st;
}

/* ---- huge pages --------------------------------------------------------
 * The kernel's single copy pins the source buffer page by page: from huge
 * pages it beats the staged path's two copies, from 4 KiB pages it does not
 * (docs/experiments.md, "Single copy and huge pages").  The page tables tell
 * which (PAGEMAP_SCAN; declared here for headers older than Linux 6.7). */
#ifndef PAGEMAP_SCAN
struct page_region {
    uint64_t start, end, categories;
};
struct pm_scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
    uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#define PAGE_IS_HUGE (1 << 6)
#endif

static int pagemap_fd = -1;
static pid_t pagemap_pid; /* whose pagemap_fd is: a forked child opens its own */
static pthread_mutex_t pagemap_lock = PTHREAD_MUTEX_INITIALIZER;

int64_t rl_huge_page_bytes(const void *p, size_t len) {
    pthread_mutex_lock(&pagemap_lock);
    if (pagemap_fd < 0 || pagemap_pid != getpid()) {
        if (pagemap_fd >= 0) close(pagemap_fd);
        pagemap_fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
        pagemap_pid = getpid();
    }
    int64_t huge = pagemap_fd < 0 ? -1 : 0;
    uint64_t at = (uint64_t)(uintptr_t)p & ~(uint64_t)(SHM_PAGE - 1);
    uint64_t end = (uint64_t)(uintptr_t)p + len;
    while (huge >= 0 && at < end) {
        struct page_region v[16];
        struct pm_scan_arg a = {.size = sizeof a, .start = at, .end = end,
                                .vec = (uint64_t)(uintptr_t)v, .vec_len = 16,
                                .category_mask = PAGE_IS_HUGE, .return_mask = PAGE_IS_HUGE};
        int n = ioctl(pagemap_fd, PAGEMAP_SCAN, &a);
        if (n < 0) {
            huge = -1;
            break;
        }
        for (int i = 0; i < n; i++) huge += (int64_t)(v[i].end - v[i].start);
        if (a.walk_end <= at) break;
        at = a.walk_end;
    }
    pthread_mutex_unlock(&pagemap_lock);
    return huge;
}

static inline int goes_direct(const rl_shm *s, size_t len) {
    return s->cma_min && len >= s->cma_min && len > (size_t)s->cells * SHM_CELL;
}

/* The sender's choice (the receiver follows the frame's flag): on an idle
 * host the ring's copy in and copy out run on two cores at once and beat
 * one core's single copy of a large buffer in 4 KiB pages (reads_fast);
 * beside other processes the single copy needs only the receiver to run
 * (docs/experiments.md). */
static inline int send_goes_direct(const rl_shm *s, const void *buf, size_t len) {
    int64_t mode = rl_tune.shm_p2p_direct;
    if (mode <= 0 || !goes_direct(s, len)) return 0;
    if (mode >= 2 || rl_host_contended(rl_now_ns())) return 1;
    /* Up to twice the ring its two cores' copies still win from 4 KiB pages. */
    return len > 2 * (size_t)s->cells * SHM_CELL ? reads_fast(buf, len) : mostly_huge(buf, len);
}

/* Called with the comm's send lock for dst held. */
int rl_shm_send_frame(rl_comm *c, rl_opdesc *op, int dst, const rl_hdr *h,
                      const void *buf, size_t len) {
    rl_shm *s = c->shm;
    if (send_goes_direct(s, buf, len)) return send_direct(c, op, dst, h, buf);
    op->algo = "shm_ring";
    shm_ring *rg = ring_of(s, c->rank, dst, c->size);
    uint32_t head = s->tx_head[dst];
    size_t n = cells_for(len);
    for (size_t k = 0; k < n; k++) {
        int st = ring_room(c, op, rg, dst, head);
        if (st != RL_OK) return st;
        char *cell = cell_of(s, rg, head);
        if (k == 0) memcpy(cell, h, sizeof *h);
        size_t off = k * SHM_CELL, m = len - off < SHM_CELL ? len - off : SHM_CELL;
        if (len <= CELL_INLINE_MAX) {
            if (len) memcpy(cell + CELL_INLINE, buf, len);
        } else {
            rl_copy(cell + SHM_SLOT_HDR, (const char *)buf + off, m);
        }
        publish(s, c->rank, stamp_of(cell), ++head);
        s->tx_head[dst] = head;
    }
    return RL_OK;
}

/* The frame header of the next message from src (not consumed).  Called
 * with the comm's receive lock for src held. */
int rl_shm_recv_header(rl_comm *c, const rl_opdesc *op, int src, rl_hdr *h) {
    rl_shm *s = c->shm;
    shm_ring *rg = ring_of(s, src, c->rank, c->size);
    uint32_t tail = s->rx_tail[src];
    char *cell = cell_of(s, rg, tail);
    int st = wait_flag(c, op, stamp_of(cell), tail + 1, src);
    if (st != RL_OK) return st;
    memcpy(h, cell, sizeof *h);
    return RL_OK;
}

/* The body (len bytes, the header's nbytes) of the message whose header
 * rl_shm_recv_header returned, into buf; consumes its cells. */
int rl_shm_recv_body(rl_comm *c, rl_opdesc *op, int src, void *buf, size_t len) {
    rl_shm *s = c->shm;
    shm_ring *rg = ring_of(s, src, c->rank, c->size);
    uint32_t tail = s->rx_tail[src];
    char *first = cell_of(s, rg, tail);
    uint32_t flags;
    memcpy(&flags, first + offsetof(rl_hdr, flags), sizeof flags);
    if (flags & SHM_FRAME_DIRECT) {
        /* One cell: the header and the sender's buffer address (send_direct). */
        if (!goes_direct(s, len))
            return rl_fail(c, op, RL_ERR_PROTOCOL, src, 0,
                           "a %zu-byte message came as a direct read, which this rank does "
                           "not use for that size (shared memory)", len);
        uint64_t at;
        memcpy(&at, first + CELL_INLINE, sizeof at);
        int st;
        if (flags & SHM_FRAME_SPLIT) {
            /* The sender is past its last message's claims: they restart here. */
            op->algo = "shm_split_copy";
            __atomic_store_n(&rg->claims, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&rg->copied, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&rg->dst, (uint64_t)(uintptr_t)buf, __ATOMIC_RELAXED);
            publish(s, c->rank, &rg->posted, tail + 1);
            if ((st = split_copy(c, op, rg, src, 0, buf, at, len)) != RL_OK) return st;
            /* The sender may still be writing its last piece. */
            st = wait_copy(c, op, &rg->copied, split_pieces(len), src, split_piece(len));
        } else {
            op->algo = "shm_single_copy";
            st = cma_read(c, op, src, buf, at, len);
        }
        if (st != RL_OK) return st;
        publish(s, c->rank, &rg->tail, ++tail);
        s->rx_tail[src] = tail;
        return RL_OK;
    }
    if (!op->algo) op->algo = "shm_ring";
    size_t n = cells_for(len);
    for (size_t k = 0; k < n; k++) {
        char *cell = cell_of(s, rg, tail);
        int st = wait_flag(c, op, stamp_of(cell), tail + 1, src);
        if (st != RL_OK) return st;
        size_t off = k * SHM_CELL, m = len - off < SHM_CELL ? len - off : SHM_CELL;
        if (len <= CELL_INLINE_MAX) {
            if (len) memcpy(buf, cell + CELL_INLINE, len);
        } else {
            rl_copy((char *)buf + off, cell + SHM_SLOT_HDR, m);
        }
        publish(s, c->rank, &rg->tail, ++tail);
        s->rx_tail[src] = tail;
    }
    return RL_OK;
}

/* ---- receives from any source ------------------------------------------------ */
int rl_shm_p2p_ready(rl_comm *c, int src) {
    rl_shm *s = c->shm;
    /* rx_tail is the receiving thread's; read without src's lock it is a hint,
     * which the receive confirms under the lock. */
    uint32_t tail = __atomic_load_n(&s->rx_tail[src], __ATOMIC_RELAXED);
    char *cell = cell_of(s, ring_of(s, src, c->rank, c->size), tail);
    return reached(__atomic_load_n(stamp_of(cell), __ATOMIC_ACQUIRE), tail + 1);
}

uint32_t rl_shm_bell(rl_comm *c) { return __atomic_load_n(&c->shm->hdr->bell, __ATOMIC_SEQ_CST); }

static int any_ring_ready(rl_comm *c, const unsigned char *skip) {
    for (int q = 0; q < c->size; q++)
        if (q != c->rank && !skip[q] && rl_shm_p2p_ready(c, q)) return 1;
    return 0;
}

/* As wait_flag_for, over every peer's ring at once: poll (hot polls, then
 * yields), then sleep on the bell counted as a waiter of every peer, so that
 * any peer's publish rings it. */
int rl_shm_wait_any(rl_comm *c, const rl_opdesc *op, const unsigned char *skip, uint32_t bell) {
    shm_header *h = c->shm->hdr;
    int64_t spin = rl_tune.shm_spin, hot = rl_tune.spin_yield ? 0 : SHM_SPIN_HOT;
    if (spin > hot && rl_host_contended(rl_now_ns())) spin = hot;
    for (int64_t i = 0; i < spin; i++) {
        cpu_relax();
        if (__atomic_load_n(&h->bell, __ATOMIC_ACQUIRE) != bell || any_ring_ready(c, skip))
            return RL_OK;
        if ((i & 63) == 63) {
            if (__atomic_load_n(&h->abort_set, __ATOMIC_RELAXED) || c->poisoned) break;
            if (i >= hot) {
                int64_t t0 = rl_now_ns();
                sched_yield();
                if (rl_now_ns() - t0 > SHM_YIELD_LOST_NS) break;
            }
        }
    }
    for (int q = 0; q < c->size; q++)
        if (q != c->rank) __atomic_fetch_add(&c->shm->ctrl[q].waiters, 1, __ATOMIC_SEQ_CST);
    uint32_t now_bell = __atomic_load_n(&h->bell, __ATOMIC_SEQ_CST);
    int st = RL_OK;
    if (now_bell == bell && !any_ring_ready(c, skip)) {
        uint32_t never = 0; /* no flag of its own: only a failure ends the checks */
        st = check_peers(c, op, &never, 1, -1);
        if (st == RL_OK && c->poisoned) st = c->err.status ? c->err.status : RL_ERR_POISONED;
        if (st == RL_OK) {
            int64_t left = op->deadline_ns - rl_now_ns();
            if (left > 0)
                futex_wait(&h->bell, now_bell, left < SHM_SLICE_NS ? left : SHM_SLICE_NS);
        }
    }
    for (int q = 0; q < c->size; q++)
        if (q != c->rank) __atomic_fetch_sub(&c->shm->ctrl[q].waiters, 1, __ATOMIC_SEQ_CST);
    return st;
}
