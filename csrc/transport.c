/*
 * transport.c - sockets, the listener thread, the authentication handshake,
 * lazily opened connections, communicators and their error state.
 *
 * Connection model: every rank listens on one ephemeral port.  A
 * communicator opens a connection to a peer the first time the pair talks;
 * the lower comm rank of the pair connects, the higher one takes the
 * connection from its listener's mailbox.  Set-up therefore costs O(peers
 * actually used) per rank: a ring touches two, recursive doubling log2(P).
 *
 * Handshake (docs/security.md, "The handshake", data profile; HMAC-SHA256
 * keyed by SHA-256(secret)):
 *   connector -> acceptor  HELLO  magic, version, kind, job_id[16], comm_id,
 *                                 src, dst, nonce_a[32]          (68 bytes)
 *   acceptor  -> connector nonce_b[32], HMAC(key, "ringlet/acc" | HELLO | nonce_b)
 *   connector -> acceptor  HMAC(key, "ringlet/con" | HELLO | nonce_b)
 *   acceptor  -> connector status u32 (0 ok, 1 bad proof, 2 duplicate claim,
 *                                      4 evicted before the proof came: retry)
 * Both sides prove the secret over both nonces, the job id, the comm id and
 * both ranks, so a recorded handshake cannot be replayed and a connection
 * cannot be moved to another comm or rank.  The listener parses nothing but
 * the fixed HELLO before the proof, drops anything malformed, and handles
 * many pending handshakes at once with a per-connection deadline.  When its
 * table is full (or descriptors run out) it evicts the oldest connection that
 * has not yet sent a valid HELLO, or, when every pending one has, the oldest
 * still owing its proof (telling it so), and the connector retries a handshake
 * the acceptor dropped before answering or evicted, so idle or slow
 * unauthenticated connections cannot delay or break the job
 * (docs/security.md, "Data connections between ranks").
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define HELLO_LEN 68
#define REPLY_LEN 64
#define MAX_PENDING 256 /* handshakes at once, at most (max_pending_handshakes) */
#define MIN_PENDING 16
#define ACCEPT_BATCH 64
/* Acceptor -> connector before closing: the HELLO was read whole and is not
 * for this rank (other job, rank or version).  Sent in place of the reply so
 * the connector fails at once instead of retrying as after an eviction. */
#define HELLO_REFUSED 3u
/* Acceptor -> connector in place of the verdict: the listener's table was
 * full and this handshake, still waiting for its proof, was the one evicted
 * (hs_evict_oldest).  The connector retries, as after a close before the reply;
 * a bare close before the verdict stays "the peer went". */
#define HS_EVICTED 4u

/* ------------------------------------------------------------------ */
/* tuning, time, interrupt hook                                        */
/* ------------------------------------------------------------------ */
#define RL_KNOB_DEFAULT(name, def, env, doc) .name = (def),
#define RL_KNOB_ROW(name, def, env, doc) {#name, env, (def), offsetof(rl_tuning, name), doc},
rl_tuning rl_tune = {RL_TUNING_KNOBS(RL_KNOB_DEFAULT)};
static const rl_tuning rl_tune_default_copy = {RL_TUNING_KNOBS(RL_KNOB_DEFAULT)};
const rl_knob rl_knobs[] = {RL_TUNING_KNOBS(RL_KNOB_ROW)};
const int rl_nknobs = (int)(sizeof rl_knobs / sizeof rl_knobs[0]);
#undef RL_KNOB_DEFAULT
#undef RL_KNOB_ROW

void rl_tuning_defaults(rl_tuning *t) { *t = rl_tune_default_copy; }
void rl_set_tuning(const rl_tuning *t) {
    rl_tune = *t;
    if (rl_tune.segment_bytes < 4096) rl_tune.segment_bytes = 4096;
    if (rl_tune.handshake_ms < 100) rl_tune.handshake_ms = 100;
}
void rl_get_tuning(rl_tuning *t) { *t = rl_tune; }

static rl_interrupt_fn interrupt_hook = NULL;
void rl_set_interrupt_hook(rl_interrupt_fn fn) { interrupt_hook = fn; }
int rl_call_interrupt_hook(void) { return interrupt_hook ? interrupt_hook() : 0; }

int64_t rl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t rl_deadline_from(int64_t now_ns, int64_t timeout_ms) {
    /* Capped at about a year (Python's MAX_TIMEOUT) so ms -> ns cannot overflow
     * int64: a huge timeout means "no practical deadline", never "expired". */
    const int64_t max_ms = 366LL * 24 * 3600 * 1000;
    if (timeout_ms <= 0) timeout_ms = 1;
    if (timeout_ms > max_ms) timeout_ms = max_ms;
    return now_ns + timeout_ms * 1000000LL;
}

int64_t rl_deadline_ns(int64_t timeout_ms) { return rl_deadline_from(rl_now_ns(), timeout_ms); }

const char *rl_opcode_name(int opcode) {
    switch (opcode) {
    case RL_OP_ALL_REDUCE: return "all_reduce";
    case RL_OP_BROADCAST: return "broadcast";
    case RL_OP_REDUCE: return "reduce";
    case RL_OP_ALL_GATHER: return "all_gather";
    case RL_OP_REDUCE_SCATTER: return "reduce_scatter";
    case RL_OP_ALL_TO_ALL: return "all_to_all";
    case RL_OP_GATHER: return "gather";
    case RL_OP_SCATTER: return "scatter";
    case RL_OP_BARRIER: return "barrier";
    case RL_OP_P2P: return "send/recv";
    case RL_OP_ABORT: return "abort";
    default: return "unknown-op";
    }
}

/* ------------------------------------------------------------------ */
/* socket helpers                                                      */
/* ------------------------------------------------------------------ */
static void tune_socket(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (rl_tune.sockbuf_bytes > 0) {
        int sz = (int)rl_tune.sockbuf_bytes;
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    }
}

/* Both ends of a connection on this host: the peer's address is the
 * socket's own (ranks that meet on the host's LAN address) or loopback. */
static int same_host(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) return 0;
    if (a->ss_family == AF_INET) {
        uint32_t x = ntohl(((const struct sockaddr_in *)a)->sin_addr.s_addr);
        uint32_t y = ntohl(((const struct sockaddr_in *)b)->sin_addr.s_addr);
        return x == y || ((x >> 24) == 127 && (y >> 24) == 127);
    }
    if (a->ss_family == AF_INET6) {
        const struct in6_addr *x = &((const struct sockaddr_in6 *)a)->sin6_addr;
        const struct in6_addr *y = &((const struct sockaddr_in6 *)b)->sin6_addr;
        return memcmp(x, y, sizeof *x) == 0 || (IN6_IS_ADDR_LOOPBACK(x) && IN6_IS_ADDR_LOOPBACK(y));
    }
    return 0;
}

/* A connection within this host switches to Reno (rl_tune.local_reno).
 * Nothing on the loopback path needs congestion control, and a pacing one
 * (BBR, some distributions' default) holds each packet for a timer, which
 * slows large messages (docs/algorithms.md, "Connections").  Reno is built
 * into every kernel and allowed to unprivileged processes; a refusal leaves
 * the system's choice. */
static void same_host_reno(int fd) {
    struct sockaddr_storage a, b;
    socklen_t al = sizeof a, bl = sizeof b;
    if (!rl_tune.local_reno || getsockname(fd, (struct sockaddr *)&a, &al) != 0 ||
        getpeername(fd, (struct sockaddr *)&b, &bl) != 0 || !same_host(&a, &b))
        return;
    static const char reno[] = "reno";
    setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, reno, (socklen_t)(sizeof reno - 1));
}

static int set_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static int resolve(const char *host, int port, struct sockaddr_storage *ss,
                   socklen_t *len) {
    struct addrinfo hints, *res = NULL;
    char portstr[16];
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    snprintf(portstr, sizeof portstr, "%d", port);
    if (getaddrinfo(host, portstr, &hints, &res) != 0 || !res) return -1;
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

static int ms_left(int64_t deadline_ns) {
    int64_t left = (deadline_ns - rl_now_ns()) / 1000000LL;
    if (left < 0) return 0;
    return left > 100 ? 100 : (int)left; /* wake at least every 100 ms */
}

/* ------------------------------------------------------------------ */
/* error recording                                                     */
/* ------------------------------------------------------------------ */
const char *rl_peer_host(const rl_comm *c, int peer, int *port) {
    if (peer < 0 || peer >= c->size) { if (port) *port = 0; return "?"; }
    const rl_endpoint *ep = &c->ctx->peers[c->world[peer]];
    if (port) *port = ep->port;
    return ep->host[0] ? ep->host : "?";
}

int rl_fail(rl_comm *c, const rl_opdesc *op, int status, int peer,
            int sys_errno, const char *fmt, ...) {
    pthread_mutex_lock(&c->err_lock);
    if (!c->poisoned) {
        char detail[RL_ERRMSG_MAX / 2];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(detail, sizeof detail, fmt, ap);
        va_end(ap);
        double waited = op ? (rl_now_ns() - op->start_ns) / 1e9 : 0.0;
        char peerbuf[128] = "";
        if (peer >= 0) {
            int port;
            const char *host = rl_peer_host(c, peer, &port);
            snprintf(peerbuf, sizeof peerbuf, " peer %d (%s:%d)", peer, host, port);
        }
        if (op)
            snprintf(c->err.msg, sizeof c->err.msg,
                     "rank %d: %s seq=%llu%.128s after %.3fs: %.380s", c->rank,
                     rl_opcode_name(op->opcode), (unsigned long long)op->seq,
                     peerbuf, waited, detail);
        else
            snprintf(c->err.msg, sizeof c->err.msg, "rank %d:%.128s %.380s", c->rank,
                     peerbuf, detail);
        c->err.status = status;
        c->err.peer = peer;
        c->err.sys_errno = sys_errno;
        c->poisoned = 1;
    }
    pthread_mutex_unlock(&c->err_lock);
    return status;
}

const rl_error *rl_comm_error(const rl_comm *c) { return &c->err; }
uint64_t rl_comm_seq(const rl_comm *c) { return c->seq; }

/* Collectives of one comm run one at a time, in the order threads reach
 * this lock; one that waits past its own deadline for another thread's op
 * fails as a timeout and aborts the comm (its peers would run the op it
 * gave up).  Contention is rare (threads sharing a group), so a waiter
 * polls instead of needing a clock-aware mutex, and calls the interrupt hook
 * every ~90 ms like every other wait (Ctrl-C, docs/errors.md). */
static int op_lock(rl_comm *c, rl_opdesc *op) {
    int64_t last_hook = rl_now_ns();
    for (;;) {
        if (pthread_mutex_trylock(&c->op_lock) == 0) {
            /* The op before may have failed: this one must not start. */
            if (c->poisoned) {
                pthread_mutex_unlock(&c->op_lock);
                return RL_ERR_POISONED;
            }
            op->locked = 1;
            return RL_OK;
        }
        if (c->poisoned) return RL_ERR_POISONED;
        int64_t now = rl_now_ns();
        int st = RL_OK;
        if (now >= op->deadline_ns) {
            st = rl_fail(c, op, RL_ERR_TIMEOUT, -1, 0,
                         "timed out waiting for this communicator's previous operation, "
                         "still running in another thread");
        } else if (now - last_hook >= 90000000LL) {
            last_hook = now;
            if (rl_call_interrupt_hook())
                st = rl_fail(c, op, RL_ERR_INTERRUPTED, -1, 0,
                             "interrupted while waiting for this communicator's previous "
                             "operation, still running in another thread");
        }
        if (st != RL_OK) {
            /* This op is abandoned, and its peers may have begun it: poison
             * the comm.  The other thread's op may be writing to the sockets:
             * shut them down (as a cancel does) rather than write abort frames. */
            rl_comm_cancel(c, st, NULL);
            rl_shm_abort(c);
            return st;
        }
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
}

int rl_begin_op(rl_comm *c, rl_opdesc *op, int opcode, int dtype, int redop,
                int root, uint64_t total, int64_t timeout_ms) {
    if (c->poisoned) return RL_ERR_POISONED;
    memset(op, 0, sizeof *op);
    op->opcode = opcode;
    op->dtype = dtype;
    op->redop = redop;
    op->root = root;
    op->total = total;
    /* One clock read serves the deadline and the record's start; the
     * record's end time costs the one this saves (docs/debugging.md). */
    op->start_ns = rl_now_ns();
    op->deadline_ns = rl_deadline_from(op->start_ns, timeout_ms);
    if (opcode != RL_OP_P2P) {
        int st = op_lock(c, op);
        if (st != RL_OK) return st;
        op->seq = ++c->seq;
    }
    rl_trace_begin(c, op);
    return RL_OK;
}

int rl_end_op(rl_comm *c, const rl_opdesc *op, int status) {
    rl_trace_end(c, op, status);
    /* Abort before unlocking: the next op's frames must not interleave
     * with the abort frames. */
    if (status != RL_OK && status != RL_ERR_POISONED && status != RL_ERR_INVALID)
        rl_comm_abort(c, status, NULL);
    if (op->locked) pthread_mutex_unlock(&c->op_lock);
    return status;
}

/* Tell every connected peer why we stop, then shut the sockets down so peers
 * blocked on us wake with an error instead of waiting for their timeout. */
void rl_comm_abort(rl_comm *c, int status, const char *reason) {
    if (reason) rl_fail(c, NULL, status ? status : RL_ERR_ABORTED, -1, 0, "%s", reason);
    char msg[RL_ABORT_REASON_MAX];
    size_t mlen = strnlen(c->err.msg, sizeof msg - 1);
    memcpy(msg, c->err.msg, mlen);
    msg[mlen] = 0;
    for (int p = 0; p < c->size; p++) {
        int fd = c->fds[p];
        if (fd < 0) continue;
        rl_hdr h;
        memset(&h, 0, sizeof h);
        h.magic = RL_MAGIC;
        h.version = RL_PROTOCOL_VERSION;
        h.opcode = RL_OP_ABORT;
        h.comm_id = c->id;
        h.root = -1;
        h.nbytes = mlen;
        h.flags = (uint32_t)c->err.status;
        struct iovec iov[2] = {{&h, sizeof h}, {msg, mlen}};
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = 2;
        /* Best effort: a peer whose buffer is full simply sees the close.
         * The abort may land in the middle of a frame we were sending; the
         * peer then reports a protocol error, which is still a fast failure. */
        (void)sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        shutdown(fd, SHUT_RDWR);
    }
    rl_shm_abort(c); /* ranks waiting in shared memory read the same reason */
}

void rl_comm_cancel(rl_comm *c, int status, const char *reason) {
    rl_fail(c, NULL, status ? status : RL_ERR_ABORTED, -1, 0, "%s", reason ? reason : "cancelled");
    for (int p = 0; p < c->size; p++) {
        int fd = __atomic_load_n(&c->fds[p], __ATOMIC_ACQUIRE);
        if (fd >= 0) shutdown(fd, SHUT_RDWR);
    }
    rl_shm_wake_all(c); /* a waiter in shared memory then sees the poison */
    rl_p2p_wake_any(c);
}

/* ------------------------------------------------------------------ */
/* handshake                                                            */
/* ------------------------------------------------------------------ */
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static void proof(const rl_ctx *ctx, const char *label, const uint8_t *hello,
                  const uint8_t *nonce_b, uint8_t out[32]) {
    uint8_t msg[16 + HELLO_LEN + 32];
    size_t ll = strlen(label);
    memcpy(msg, label, ll);
    memcpy(msg + ll, hello, HELLO_LEN);
    memcpy(msg + ll + HELLO_LEN, nonce_b, 32);
    rl_hmac_sha256(ctx->key, sizeof ctx->key, msg, ll + HELLO_LEN + 32, out);
}

typedef struct {
    int fd;
    int state; /* 0: reading HELLO (evictable), 1: valid HELLO, reading proof */
    size_t got;
    uint8_t hello[HELLO_LEN];
    uint8_t nonce_b[32];
    uint8_t mac[32];
    int64_t deadline;
} hs_state;

static int claimed(rl_ctx *ctx, uint64_t key) {
    for (size_t i = 0; i < ctx->nclaimed; i++)
        if (ctx->claimed[i] == key) return 1;
    return 0;
}

static void hs_reject(rl_ctx *ctx, hs_state *h, uint32_t status) {
    if (status) {
        uint8_t b[4];
        put32(b, status);
        (void)send(h->fd, b, 4, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    close(h->fd);
    h->fd = -1;
    pthread_mutex_lock(&ctx->lock);
    ctx->rejected++;
    pthread_mutex_unlock(&ctx->lock);
}

/* Advance one pending handshake after poll said it is readable. */
static void hs_step(rl_ctx *ctx, hs_state *h) {
    uint8_t *dst = h->state == 0 ? h->hello : h->mac;
    size_t want = h->state == 0 ? HELLO_LEN : 32;
    ssize_t n = recv(h->fd, dst + h->got, want - h->got, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        hs_reject(ctx, h, 0);
        return;
    }
    if (n < 0) return;
    h->got += (size_t)n;
    if (h->got < want) return;
    if (h->state == 0) {
        uint32_t src = get32(h->hello + 28), dst_rank = get32(h->hello + 32);
        if (get32(h->hello) != RL_HANDSHAKE_MAGIC ||
            get16(h->hello + 4) != RL_PROTOCOL_VERSION || get16(h->hello + 6) != 1 ||
            !rl_ct_equal(h->hello + 8, ctx->job_id, 16) ||
            dst_rank != (uint32_t)ctx->rank || src >= (uint32_t)ctx->size ||
            src == (uint32_t)ctx->rank) {
            hs_reject(ctx, h, HELLO_REFUSED);
            return;
        }
        uint8_t reply[REPLY_LEN];
        if (rl_random_bytes(h->nonce_b, 32) != 0) { hs_reject(ctx, h, 0); return; }
        memcpy(reply, h->nonce_b, 32);
        proof(ctx, "ringlet/acc", h->hello, h->nonce_b, reply + 32);
        /* 64 bytes into a fresh socket's empty send buffer never block. */
        if (send(h->fd, reply, REPLY_LEN, MSG_NOSIGNAL | MSG_DONTWAIT) != REPLY_LEN) {
            hs_reject(ctx, h, 0);
            return;
        }
        h->state = 1;
        h->got = 0;
        return;
    }
    uint8_t expect[32];
    proof(ctx, "ringlet/con", h->hello, h->nonce_b, expect);
    if (!rl_ct_equal(expect, h->mac, 32)) {
        hs_reject(ctx, h, 1);
        return;
    }
    uint32_t comm_id = get32(h->hello + 24), src = get32(h->hello + 28);
    uint64_t key = ((uint64_t)comm_id << 32) | src;
    pthread_mutex_lock(&ctx->lock);
    if (claimed(ctx, key)) {
        pthread_mutex_unlock(&ctx->lock);
        hs_reject(ctx, h, 2);
        return;
    }
    rl_pending_conn *pc = malloc(sizeof *pc);
    if (pc && ctx->nclaimed == ctx->capclaimed) {
        /* Grown through a temporary: a failed realloc leaves the table as it was. */
        size_t cap = ctx->capclaimed * 2 + 64;
        uint64_t *grown = realloc(ctx->claimed, cap * sizeof *grown);
        if (grown) {
            ctx->claimed = grown;
            ctx->capclaimed = cap;
        }
    }
    if (!pc || ctx->nclaimed == ctx->capclaimed) {
        pthread_mutex_unlock(&ctx->lock);
        free(pc);
        hs_reject(ctx, h, 0);
        return;
    }
    ctx->claimed[ctx->nclaimed++] = key;
    uint8_t ok[4];
    put32(ok, 0);
    if (send(h->fd, ok, 4, MSG_NOSIGNAL | MSG_DONTWAIT) != 4) {
        ctx->nclaimed--;
        pthread_mutex_unlock(&ctx->lock);
        free(pc);
        hs_reject(ctx, h, 0);
        return;
    }
    pc->comm_id = comm_id;
    pc->src = (int)src;
    pc->fd = h->fd;
    pc->next = ctx->mailbox;
    ctx->mailbox = pc;
    pthread_cond_broadcast(&ctx->cond);
    pthread_mutex_unlock(&ctx->lock);
    h->fd = -1;
}

/* Close the oldest pending connection, to make room (a table slot or a
 * descriptor) for a newer one: the oldest that has not sent a valid HELLO,
 * else the oldest waiting for its proof.  Only someone who knows the job id
 * can send a valid HELLO, so an off-path flood can fill the table with
 * nothing but the first kind; a genuine connector sends its proof one round
 * trip after the HELLO, so an entry still waiting for it when the whole table
 * holds such entries is most likely idle, and a connector that was evicted
 * anyway is told so (HS_EVICTED) and retries.  Returns its index or -1 (an
 * empty table). */
static int hs_evict_oldest(rl_ctx *ctx, hs_state *hs, int npend) {
    int victim = -1;
    for (int i = 0; i < npend; i++) {
        if (hs[i].fd < 0) continue;
        if (victim < 0 || hs[i].state < hs[victim].state ||
            (hs[i].state == hs[victim].state && hs[i].deadline < hs[victim].deadline))
            victim = i;
    }
    /* counted in rejected; one that sent its HELLO is told why (it retries) */
    if (victim >= 0) hs_reject(ctx, &hs[victim], hs[victim].state == 1 ? HS_EVICTED : 0);
    return victim;
}

/* A table slot for a new connection: the end, a hole left by a handshake
 * finished this turn, or an evicted entry's.  There always is one (every
 * pending entry is evictable), so the listener never stops accepting
 * because its table is full. */
static int hs_free_slot(rl_ctx *ctx, hs_state *hs, int npend) {
    if (npend < ctx->max_pending) return npend;
    for (int i = 0; i < npend; i++)
        if (hs[i].fd < 0) return i;
    return hs_evict_oldest(ctx, hs, npend);
}

/* Accept up to ACCEPT_BATCH connections.  A full table or EMFILE/ENFILE
 * evicts the oldest entry (hs_evict_oldest); with nothing to evict the listen
 * socket is left unpolled for a short while (no busy loop on a connection
 * the kernel keeps reporting).  Returns the new table length. */
static int accept_batch(rl_ctx *ctx, hs_state *hs, int npend, int64_t *pause_until) {
    for (int k = 0; k < ACCEPT_BATCH; k++) {
        int fd = accept4(ctx->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                /* Out of descriptors: free one by eviction and try again,
                 * or stop polling the listen socket until the next tick. */
                if (hs_evict_oldest(ctx, hs, npend) >= 0) continue;
                *pause_until = rl_now_ns() + 100000000LL;
            }
            break; /* EAGAIN: the backlog is empty */
        }
        /* Evict only now that someone is really waiting for the slot. */
        int slot = hs_free_slot(ctx, hs, npend);
        tune_socket(fd);
        same_host_reno(fd);
        memset(&hs[slot], 0, sizeof hs[slot]);
        hs[slot].fd = fd;
        hs[slot].deadline = rl_now_ns() + rl_tune.handshake_ms * 1000000LL;
        if (slot == npend) npend++;
        /* A rank sends its HELLO right after connecting: read it now, so
         * the connection is validated (evicted only after every
         * unvalidated one) at once. */
        hs_step(ctx, &hs[slot]);
    }
    return npend;
}

/* The listener thread stops on error e: record it and wake every waiter, so
 * that ops needing a connection to this rank fail at once with it
 * (rl_listener_check) instead of at their deadline. */
static void listener_stopped(rl_ctx *ctx, int e) {
    pthread_mutex_lock(&ctx->lock);
    ctx->listener_errno = e ? e : EIO;
    pthread_cond_broadcast(&ctx->cond);
    pthread_mutex_unlock(&ctx->lock);
}

/* Whether rl_ctx_destroy asked the listener to stop; waits up to ms for it. */
static int listener_woken(rl_ctx *ctx, int ms) {
    struct pollfd p = {ctx->wake_pipe[0], POLLIN, 0};
    return poll(&p, 1, ms) > 0;
}

static void *listener_main(void *arg) {
    rl_ctx *ctx = arg;
    size_t cap = (size_t)ctx->max_pending;
    hs_state *hs = calloc(cap, sizeof *hs);
    struct pollfd *pfd = calloc(cap + 2, sizeof *pfd);
    /* Memory short at start: try again for 5 s, then give up loudly. */
    for (int attempt = 1; !hs || !pfd; attempt++) {
        if (attempt > 50 || listener_woken(ctx, 100)) {
            free(hs);
            free(pfd);
            if (attempt > 50) listener_stopped(ctx, ENOMEM);
            return NULL;
        }
        if (!hs) hs = calloc(cap, sizeof *hs);
        if (!pfd) pfd = calloc(cap + 2, sizeof *pfd);
    }
    int npend = 0;
    int64_t pause_until = 0;
    for (;;) {
        int64_t now = rl_now_ns();
        /* Drop handshakes past their deadline, compact the table. */
        int w = 0;
        for (int i = 0; i < npend; i++) {
            if (hs[i].fd >= 0 && hs[i].deadline < now) hs_reject(ctx, &hs[i], 0);
            if (hs[i].fd >= 0) hs[w++] = hs[i];
        }
        npend = w;
        int can_accept = now >= pause_until;
        pfd[0].fd = ctx->wake_pipe[0];
        pfd[0].events = POLLIN;
        pfd[1].fd = can_accept ? ctx->listen_fd : -1;
        pfd[1].events = POLLIN;
        pfd[1].revents = 0;
        for (int i = 0; i < npend; i++) {
            pfd[2 + i].fd = hs[i].fd;
            pfd[2 + i].events = POLLIN;
            pfd[2 + i].revents = 0;
        }
        int r = poll(pfd, (nfds_t)(2 + npend), 100);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == ENOMEM || errno == EAGAIN) { /* the kernel short of memory: wait */
                if (listener_woken(ctx, 10)) break;
                continue;
            }
            listener_stopped(ctx, errno);
            break;
        }
        if (pfd[0].revents) break; /* woken by rl_ctx_destroy */
        for (int i = 0; i < npend; i++)
            if (pfd[2 + i].revents && hs[i].fd >= 0) hs_step(ctx, &hs[i]);
        if (pfd[1].revents & POLLIN) npend = accept_batch(ctx, hs, npend, &pause_until);
    }
    for (int i = 0; i < npend; i++)
        if (hs[i].fd >= 0) close(hs[i].fd);
    free(hs);
    free(pfd);
    return NULL;
}

/* ------------------------------------------------------------------ */
/* context                                                              */
/* ------------------------------------------------------------------ */
/* Handshakes the listener holds at once: MAX_PENDING, and no more than an
 * eighth of the descriptor limit (at least MIN_PENDING), so that a flood of
 * unauthenticated connections cannot take the descriptors the rank's own
 * sockets and files need (the store does the same, docs/security.md). */
static int max_pending_handshakes(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return MAX_PENDING;
    rlim_t n = rl.rlim_cur / 8;
    if (n > MAX_PENDING) n = MAX_PENDING;
    return n < MIN_PENDING ? MIN_PENDING : (int)n;
}

int rl_ctx_create(rl_ctx **out, int rank, int size, const char *bind_host,
                  const uint8_t *secret, size_t secret_len,
                  const uint8_t job_id[16], rl_error *err) {
    *out = NULL;
    memset(err, 0, sizeof *err);
    if (size < 1 || rank < 0 || rank >= size) {
        err->status = RL_ERR_INVALID;
        snprintf(err->msg, sizeof err->msg, "invalid rank %d for world size %d", rank, size);
        return RL_ERR_INVALID;
    }
    rl_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) { err->status = RL_ERR_NOMEM; snprintf(err->msg, sizeof err->msg, "out of memory"); return RL_ERR_NOMEM; }
    ctx->rank = rank;
    ctx->size = size;
    ctx->listen_fd = -1;
    ctx->wake_pipe[0] = ctx->wake_pipe[1] = -1;
    ctx->peers = calloc((size_t)size, sizeof *ctx->peers);
    rl_sha256(secret, secret_len, ctx->key);
    memcpy(ctx->job_id, job_id, 16);
    ctx->max_pending = max_pending_handshakes();
    pthread_mutex_init(&ctx->lock, NULL);
    /* Monotonic, like every deadline here (await_peer): a wall-clock step
     * must not stretch or cut a wait. */
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&ctx->cond, &ca);
    pthread_condattr_destroy(&ca);
    struct sockaddr_storage ss;
    socklen_t sl;
    int status = RL_ERR_SYSTEM;
    if (!ctx->peers) { status = RL_ERR_NOMEM; goto fail; }
    if (resolve(bind_host, 0, &ss, &sl) != 0) {
        status = RL_ERR_INVALID;
        snprintf(err->msg, sizeof err->msg, "cannot parse bind address '%s' (need a numeric IPv4/IPv6 address)", bind_host);
        goto fail_msg;
    }
    ctx->listen_fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (ctx->listen_fd < 0) goto fail;
    tune_socket(ctx->listen_fd);
    if (bind(ctx->listen_fd, (struct sockaddr *)&ss, sl) != 0) goto fail;
    if (listen(ctx->listen_fd, 1024) != 0) goto fail;
    sl = sizeof ss;
    if (getsockname(ctx->listen_fd, (struct sockaddr *)&ss, &sl) != 0) goto fail;
    ctx->port = ss.ss_family == AF_INET ? ntohs(((struct sockaddr_in *)&ss)->sin_port)
                                        : ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    if (pipe2(ctx->wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) goto fail;
    if (pthread_create(&ctx->thread, NULL, listener_main, ctx) != 0) goto fail;
    ctx->thread_started = 1;
    *out = ctx;
    return RL_OK;
fail:
    err->sys_errno = errno;
    snprintf(err->msg, sizeof err->msg, "cannot listen on %s: %s", bind_host, strerror(errno));
fail_msg:
    err->status = status;
    rl_ctx_destroy(ctx);
    return status;
}

int rl_ctx_port(const rl_ctx *ctx) { return ctx->port; }

int rl_ctx_set_peer(rl_ctx *ctx, int rank, const char *host, int port) {
    if (rank < 0 || rank >= ctx->size || !host || strlen(host) >= RL_HOST_MAX ||
        port <= 0 || port > 65535)
        return RL_ERR_INVALID;
    snprintf(ctx->peers[rank].host, RL_HOST_MAX, "%s", host);
    ctx->peers[rank].port = port;
    return RL_OK;
}

int64_t rl_ctx_rejected(const rl_ctx *ctx) {
    rl_ctx *m = (rl_ctx *)ctx;
    pthread_mutex_lock(&m->lock);
    int64_t r = m->rejected;
    pthread_mutex_unlock(&m->lock);
    return r;
}

void rl_ctx_destroy(rl_ctx *ctx) {
    if (!ctx) return;
    if (ctx->thread_started) {
        char b = 1;
        (void)!write(ctx->wake_pipe[1], &b, 1);
        pthread_join(ctx->thread, NULL);
    }
    if (ctx->listen_fd >= 0) close(ctx->listen_fd);
    if (ctx->wake_pipe[0] >= 0) close(ctx->wake_pipe[0]);
    if (ctx->wake_pipe[1] >= 0) close(ctx->wake_pipe[1]);
    for (rl_pending_conn *p = ctx->mailbox, *n; p; p = n) {
        n = p->next;
        close(p->fd);
        free(p);
    }
    pthread_mutex_destroy(&ctx->lock);
    pthread_cond_destroy(&ctx->cond);
    free(ctx->claimed);
    free(ctx->peers);
    free(ctx);
}

/* ------------------------------------------------------------------ */
/* communicators and their connections                                  */
/* ------------------------------------------------------------------ */
int rl_comm_create(rl_comm **out, rl_ctx *ctx, uint32_t comm_id, int rank,
                   int size, const int *world_ranks, rl_error *err) {
    *out = NULL;
    memset(err, 0, sizeof *err);
    if (size < 1 || rank < 0 || rank >= size) {
        err->status = RL_ERR_INVALID;
        snprintf(err->msg, sizeof err->msg, "invalid comm rank %d of size %d", rank, size);
        return RL_ERR_INVALID;
    }
    for (int i = 0; i < size; i++) {
        if (world_ranks[i] < 0 || world_ranks[i] >= ctx->size ||
            (i == rank && world_ranks[i] != ctx->rank)) {
            err->status = RL_ERR_INVALID;
            snprintf(err->msg, sizeof err->msg,
                     "comm rank %d maps to invalid world rank %d", i, world_ranks[i]);
            return RL_ERR_INVALID;
        }
    }
    rl_comm *c = calloc(1, sizeof *c);
    if (!c) return RL_ERR_NOMEM;
    c->ctx = ctx;
    c->id = comm_id;
    c->rank = rank;
    c->size = size;
    c->world = malloc(sizeof(int) * (size_t)size);
    c->fds = malloc(sizeof(int) * (size_t)size);
    c->peer_locks = malloc(sizeof(pthread_mutex_t) * (size_t)size);
    c->send_locks = malloc(sizeof(pthread_mutex_t) * (size_t)size);
    c->recv_locks = malloc(sizeof(pthread_mutex_t) * (size_t)size);
    c->p2p_send_seq = calloc((size_t)size, sizeof(uint64_t));
    c->p2p_recv_seq = calloc((size_t)size, sizeof(uint64_t));
    c->unexpected = calloc((size_t)size, sizeof(rl_unexpected *));
    if (!c->world || !c->fds || !c->peer_locks || !c->send_locks || !c->recv_locks ||
        !c->p2p_send_seq || !c->p2p_recv_seq || !c->unexpected) {
        free(c->world); free(c->fds); free(c->peer_locks); free(c->send_locks);
        free(c->recv_locks); free(c->p2p_send_seq); free(c->p2p_recv_seq);
        free(c->unexpected); free(c);
        err->status = RL_ERR_NOMEM;
        snprintf(err->msg, sizeof err->msg, "out of memory");
        return RL_ERR_NOMEM;
    }
    c->any_efd = -1;
    pthread_mutex_init(&c->any_lock, NULL);
    for (int i = 0; i < size; i++) {
        c->world[i] = world_ranks[i];
        c->fds[i] = -1;
        pthread_mutex_init(&c->peer_locks[i], NULL);
        pthread_mutex_init(&c->send_locks[i], NULL);
        pthread_mutex_init(&c->recv_locks[i], NULL);
    }
    pthread_mutex_init(&c->err_lock, NULL);
    pthread_mutex_init(&c->op_lock, NULL);
    if (rl_trace_init(c) != RL_OK) {
        rl_comm_destroy(c);
        err->status = RL_ERR_NOMEM;
        snprintf(err->msg, sizeof err->msg, "out of memory for the flight recorder");
        return RL_ERR_NOMEM;
    }
    *out = c;
    return RL_OK;
}

void rl_comm_destroy(rl_comm *c) {
    if (!c) return;
    rl_shm_detach(c);
    for (int i = 0; i < c->size; i++) {
        if (c->fds[i] >= 0) close(c->fds[i]);
        pthread_mutex_destroy(&c->peer_locks[i]);
        pthread_mutex_destroy(&c->send_locks[i]);
        pthread_mutex_destroy(&c->recv_locks[i]);
        for (rl_unexpected *u = c->unexpected[i], *n; u; u = n) {
            n = u->next;
            free(u->data);
            free(u);
        }
    }
    pthread_mutex_destroy(&c->err_lock);
    pthread_mutex_destroy(&c->op_lock);
    pthread_mutex_destroy(&c->any_lock);
    if (c->any_efd >= 0) close(c->any_efd);
    free(c->world); free(c->fds); free(c->peer_locks); free(c->send_locks);
    free(c->recv_locks); free(c->p2p_send_seq); free(c->p2p_recv_seq);
    free(c->unexpected); free(c->scratch); free(c->host_of);
    rl_trace_free(c);
    free(c);
}

int rl_comm_num_hosts(const rl_comm *c) { return c->nhosts; }

int rl_comm_set_hosts(rl_comm *c, const int *host_of) {
    if (!c || !host_of) return RL_ERR_INVALID;
    int P = c->size;
    for (int i = 0; i < P; i++)
        if (host_of[i] < 0 || host_of[i] >= P) return RL_ERR_INVALID;
    /* host_of, host_off (P + 1), host_rank, local_idx; then a scratch map */
    int *m = malloc((size_t)(5 * P + 1) * sizeof *m);
    if (!m) return RL_ERR_NOMEM;
    int *of = m, *off = m + P, *members = m + 2 * P + 1, *local = m + 3 * P + 1;
    int *dense = m + 4 * P + 1, H = 0;
    for (int i = 0; i < P; i++) dense[i] = -1;
    for (int i = 0; i < P; i++) {
        if (dense[host_of[i]] < 0) dense[host_of[i]] = H++;
        of[i] = dense[host_of[i]];
    }
    for (int h = 0; h <= H; h++) off[h] = 0;
    for (int i = 0; i < P; i++) off[of[i] + 1]++;
    for (int h = 0; h < H; h++) off[h + 1] += off[h];
    for (int h = 0; h < H; h++) dense[h] = 0; /* reused: members placed so far */
    for (int i = 0; i < P; i++) {
        local[i] = dense[of[i]]++;
        members[off[of[i]] + local[i]] = i;
    }
    pthread_mutex_lock(&c->op_lock); /* not under a running op */
    free(c->host_of);
    c->host_of = of;
    c->host_off = off;
    c->host_rank = members;
    c->local_idx = local;
    c->nhosts = H;
    pthread_mutex_unlock(&c->op_lock);
    return RL_OK;
}

/* Blocking (poll-driven, deadline-bounded) exchange of handshake bytes.
 * EOF and reset both come back as RL_ERR_PEER_CLOSED; *done says how many
 * bytes moved before (the connector reads a short refusal that way). */
static int hs_io(int fd, void *buf, size_t len, int sending, int64_t deadline, size_t *done) {
    *done = 0;
    while (*done < len) {
        ssize_t n = sending ? send(fd, (char *)buf + *done, len - *done, MSG_NOSIGNAL)
                            : recv(fd, (char *)buf + *done, len - *done, 0);
        if (n > 0) { *done += (size_t)n; continue; }
        if (n == 0) return RL_ERR_PEER_CLOSED;
        if (errno == EINTR) continue;
        if (errno == ECONNRESET || errno == EPIPE) return RL_ERR_PEER_CLOSED;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return RL_ERR_SYSTEM;
        if (rl_now_ns() >= deadline) return RL_ERR_TIMEOUT;
        struct pollfd p = {fd, (short)(sending ? POLLOUT : POLLIN), 0};
        (void)poll(&p, 1, ms_left(deadline));
        if (rl_call_interrupt_hook()) return RL_ERR_INTERRUPTED;
    }
    return RL_OK;
}

/* Only called once the acceptor has proved the secret, and a rejection or an
 * eviction comes as a status word: a close here is a peer that exited or died
 * mid-handshake. */
static int hs_fail(rl_comm *c, const rl_opdesc *op, int peer, int fd, int st, const char *stage) {
    int e = errno;
    close(fd);
    if (st == RL_ERR_PEER_CLOSED)
        return rl_fail(c, op, RL_ERR_PEER_CLOSED, peer, 0,
                       "peer closed the connection during the handshake, %s, after it had "
                       "proved the job secret (the peer process exited or was killed)", stage);
    if (st == RL_ERR_TIMEOUT)
        return rl_fail(c, op, RL_ERR_TIMEOUT, peer, 0, "handshake timed out %s", stage);
    if (st == RL_ERR_INTERRUPTED)
        return rl_fail(c, op, RL_ERR_INTERRUPTED, peer, 0, "interrupted during handshake");
    return rl_fail(c, op, st, peer, e, "handshake failed %s: %s", stage, strerror(e));
}

/* A failed connect, worded by what its errno says about the address the
 * peer advertised: refused means nothing listens there (the peer is gone);
 * no route means that address is out of this host's reach (the peer bound
 * an interface the others cannot reach), which no retry can fix. */
static int connect_fail(rl_comm *c, const rl_opdesc *op, int peer, int e) {
    if (e == ECONNREFUSED)
        return rl_fail(c, op, RL_ERR_PEER_CLOSED, peer, e,
                       "connect: %s (is the peer process alive?)", strerror(e));
    if (e == ENETUNREACH || e == EHOSTUNREACH || e == ENETDOWN || e == EADDRNOTAVAIL)
        return rl_fail(c, op, RL_ERR_SYSTEM, peer, e,
                       "connect: %s: the address world rank %d advertised is unreachable from "
                       "world rank %d (it listens on an interface this host has no route to; "
                       "set RINGLET_IFNAME on its host to the interface between the hosts)",
                       strerror(e), c->world[peer], c->ctx->rank);
    return rl_fail(c, op, RL_ERR_SYSTEM, peer, e, "connect: %s (is the peer process alive?)",
                   strerror(e));
}

/* One connection attempt and handshake, bounded by `deadline`.  Sets
 * *dropped (and records no error) when the acceptor closed or reset the
 * connection before answering our HELLO, or answered our proof with
 * HS_EVICTED: it evicts pending handshakes when flooded, and ours was taken
 * for one; the caller retries. */
static int connect_once(rl_comm *c, const rl_opdesc *op, int peer,
                        const struct sockaddr_storage *ss, socklen_t sl, int64_t deadline,
                        int *fd_out, int *dropped) {
    rl_ctx *ctx = c->ctx;
    int wr = c->world[peer];
    *dropped = 0;
    int fd = socket(ss->ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return rl_fail(c, op, RL_ERR_SYSTEM, peer, errno, "socket: %s", strerror(errno));
    tune_socket(fd);
    if (connect(fd, (const struct sockaddr *)ss, sl) != 0) {
        if (errno != EINPROGRESS) {
            int e = errno;
            close(fd);
            return connect_fail(c, op, peer, e);
        }
        for (;;) {
            struct pollfd p = {fd, POLLOUT, 0};
            int r = poll(&p, 1, ms_left(deadline));
            if (r > 0) break;
            if (rl_call_interrupt_hook()) { close(fd); return rl_fail(c, op, RL_ERR_INTERRUPTED, peer, 0, "interrupted while connecting"); }
            if (rl_now_ns() >= deadline) {
                close(fd);
                return rl_fail(c, op, RL_ERR_TIMEOUT, peer, 0,
                               "timed out connecting: no answer from the address the peer "
                               "advertised (a dropped link, a firewall, or an address only "
                               "its host can reach; see RINGLET_IFNAME)");
            }
        }
        int soerr = 0;
        socklen_t el = sizeof soerr;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &el) != 0) soerr = errno;
        if (soerr) {
            close(fd);
            return connect_fail(c, op, peer, soerr);
        }
    }
    same_host_reno(fd); /* connected by now */
    uint8_t hello[HELLO_LEN], reply[REPLY_LEN], mac[32], status[4];
    size_t got;
    int st;
    put32(hello, RL_HANDSHAKE_MAGIC);
    put16(hello + 4, RL_PROTOCOL_VERSION);
    put16(hello + 6, 1);
    memcpy(hello + 8, ctx->job_id, 16);
    put32(hello + 24, c->id);
    put32(hello + 28, (uint32_t)ctx->rank);
    put32(hello + 32, (uint32_t)wr);
    if (rl_random_bytes(hello + 36, 32) != 0) {
        int e = errno;
        close(fd);
        return rl_fail(c, op, RL_ERR_SYSTEM, peer, e, "getrandom failed");
    }
    /* The acceptor reads a HELLO whole before it refuses one, so a close
     * while ours is still going out is an eviction: retry. */
    st = hs_io(fd, hello, HELLO_LEN, 1, deadline, &got);
    if (st == RL_ERR_PEER_CLOSED) {
        close(fd);
        *dropped = 1;
        return st;
    }
    if (st != RL_OK) return hs_fail(c, op, peer, fd, st, "sending our HELLO");
    /* From here `got` counts reply bytes only: a refusal is those 4 bytes, then a close. */
    st = hs_io(fd, reply, REPLY_LEN, 0, deadline, &got);
    if (st == RL_ERR_PEER_CLOSED && got == 4 && get32(reply) == HELLO_REFUSED) {
        close(fd);
        return rl_fail(c, op, RL_ERR_AUTH, peer, 0,
                       "peer refused our HELLO: it is not world rank %d of this job (stale "
                       "endpoint, another job, or another ringlet version)", wr);
    }
    if (st == RL_ERR_PEER_CLOSED) {
        close(fd);
        *dropped = 1;
        return st;
    }
    if (st != RL_OK) return hs_fail(c, op, peer, fd, st, "waiting for the peer's reply");
    proof(ctx, "ringlet/acc", hello, reply, mac);
    if (!rl_ct_equal(mac, reply + 32, 32)) {
        close(fd);
        return rl_fail(c, op, RL_ERR_AUTH, peer, 0,
                       "peer failed to prove the job secret (different secret or not a ringlet rank of this job)");
    }
    proof(ctx, "ringlet/con", hello, reply, mac);
    if ((st = hs_io(fd, mac, 32, 1, deadline, &got)) != RL_OK)
        return hs_fail(c, op, peer, fd, st, "sending our proof");
    if ((st = hs_io(fd, status, 4, 0, deadline, &got)) != RL_OK)
        return hs_fail(c, op, peer, fd, st, "waiting for the verdict on our proof");
    if (get32(status) == HS_EVICTED) {
        close(fd);
        *dropped = 1;
        return RL_ERR_PEER_CLOSED;
    }
    if (get32(status) != 0) {
        close(fd);
        return rl_fail(c, op, RL_ERR_AUTH, peer, 0, "%s",
                       get32(status) == 2 ? "peer refused the connection: this rank already has one (duplicate rank claim)"
                                          : "peer rejected our proof of the job secret (wrong secret?)");
    }
    *fd_out = fd;
    return RL_OK;
}

/* Open and authenticate the connection to `peer`.  Each attempt gets
 * handshake_ms; attempts the acceptor dropped unanswered are retried, with a
 * short growing pause, until the operation's own deadline. */
static int connect_peer(rl_comm *c, const rl_opdesc *op, int peer, int *fd_out) {
    rl_ctx *ctx = c->ctx;
    int wr = c->world[peer];
    rl_endpoint *ep = &ctx->peers[wr];
    if (!ep->port)
        return rl_fail(c, op, RL_ERR_INVALID, peer, 0, "no endpoint known for world rank %d", wr);
    struct sockaddr_storage ss;
    socklen_t sl;
    if (resolve(ep->host, ep->port, &ss, &sl) != 0)
        return rl_fail(c, op, RL_ERR_INVALID, peer, 0, "bad endpoint address %s", ep->host);
    for (int attempt = 1;; attempt++) {
        int64_t hs_deadline = rl_now_ns() + rl_tune.handshake_ms * 1000000LL;
        int64_t deadline = op->deadline_ns < hs_deadline ? op->deadline_ns : hs_deadline;
        int dropped;
        int st = connect_once(c, op, peer, &ss, sl, deadline, fd_out, &dropped);
        if (!dropped) return st;
        if (rl_now_ns() >= op->deadline_ns)
            return rl_fail(c, op, RL_ERR_TIMEOUT, peer, 0,
                           "handshake did not complete: the peer closed %d connection attempts "
                           "before answering (its listener flooded by unauthenticated "
                           "connections, or the peer is exiting)", attempt);
        int pause_ms = attempt < 6 ? 1 << (attempt - 1) : 50;
        int left = ms_left(op->deadline_ns);
        (void)poll(NULL, 0, pause_ms < left ? pause_ms : left);
        if (rl_call_interrupt_hook())
            return rl_fail(c, op, RL_ERR_INTERRUPTED, peer, 0, "interrupted while connecting");
        if (c->poisoned) return RL_ERR_POISONED;
    }
}

/* The connection the peer dialled for this comm, taken from the mailbox;
 * -1 if none yet.  Called with ctx->lock held. */
static int take_mailbox(rl_comm *c, int peer) {
    int wr = c->world[peer];
    for (rl_pending_conn **pp = &c->ctx->mailbox; *pp; pp = &(*pp)->next) {
        if ((*pp)->comm_id == c->id && (*pp)->src == wr) {
            rl_pending_conn *pc = *pp;
            int fd = pc->fd;
            *pp = pc->next;
            free(pc);
            return fd;
        }
    }
    return -1;
}

/* An op that needs a connection this rank's listener would have accepted,
 * after that thread stopped on error e (listener_stopped). */
static int listener_fail(rl_comm *c, const rl_opdesc *op, int peer, int e) {
    return rl_fail(c, op, e == ENOMEM ? RL_ERR_NOMEM : RL_ERR_SYSTEM, peer, e,
                   "this rank's listener thread stopped (%s): no peer can connect to this rank "
                   "any more; shut down and init again", strerror(e));
}

int rl_listener_check(rl_comm *c, const rl_opdesc *op) {
    rl_ctx *ctx = c->ctx;
    pthread_mutex_lock(&ctx->lock);
    int e = ctx->listener_errno;
    pthread_mutex_unlock(&ctx->lock);
    return e ? listener_fail(c, op, -1, e) : RL_OK;
}

/* Wait for the higher-ranked side of a pair: the peer connects to us. */
static int await_peer(rl_comm *c, const rl_opdesc *op, int peer, int *fd_out) {
    rl_ctx *ctx = c->ctx;
    pthread_mutex_lock(&ctx->lock);
    for (;;) {
        int got = take_mailbox(c, peer);
        if (got >= 0) {
            pthread_mutex_unlock(&ctx->lock);
            *fd_out = got;
            return RL_OK;
        }
        if (ctx->listener_errno) {
            int e = ctx->listener_errno;
            pthread_mutex_unlock(&ctx->lock);
            return listener_fail(c, op, peer, e);
        }
        int64_t now = rl_now_ns();
        if (now >= op->deadline_ns) {
            pthread_mutex_unlock(&ctx->lock);
            return rl_fail(c, op, RL_ERR_TIMEOUT, peer, 0,
                           "timed out waiting for the peer to connect (it never reached this op, or is hung)");
        }
        /* ctx->cond runs on CLOCK_MONOTONIC, rl_now_ns()'s clock. */
        int64_t until = op->deadline_ns - now < 100000000LL ? op->deadline_ns : now + 100000000LL;
        struct timespec ts = {(time_t)(until / 1000000000LL), (long)(until % 1000000000LL)};
        pthread_cond_timedwait(&ctx->cond, &ctx->lock, &ts);
        pthread_mutex_unlock(&ctx->lock);
        if (rl_call_interrupt_hook())
            return rl_fail(c, op, RL_ERR_INTERRUPTED, peer, 0, "interrupted while waiting for the peer to connect");
        if (c->poisoned) return RL_ERR_POISONED;
        pthread_mutex_lock(&ctx->lock);
    }
}

static void note_connected(rl_comm *c, int peer, int fd) {
    set_nonblock(fd);
    __atomic_store_n(&c->fds[peer], fd, __ATOMIC_RELEASE);
    int port;
    const char *host = rl_peer_host(c, peer, &port);
    rl_log(RL_LOG_INFO, c, "connected to peer %d (world rank %d, %s:%d): transport tcp, %s",
           peer, c->world[peer], host, port, c->rank < peer ? "dialled" : "accepted");
}

int rl_peer_fd_try(rl_comm *c, int peer) {
    int fd = __atomic_load_n(&c->fds[peer], __ATOMIC_ACQUIRE);
    if (fd >= 0 || peer == c->rank || c->rank < peer) return fd;
    /* Whoever holds the peer's lock is connecting: it will store the fd. */
    if (pthread_mutex_trylock(&c->peer_locks[peer]) != 0) return -1;
    fd = c->fds[peer];
    if (fd < 0) {
        pthread_mutex_lock(&c->ctx->lock);
        fd = take_mailbox(c, peer);
        pthread_mutex_unlock(&c->ctx->lock);
        if (fd >= 0) note_connected(c, peer, fd);
    }
    pthread_mutex_unlock(&c->peer_locks[peer]);
    return fd;
}

int rl_peer_fd(rl_comm *c, const rl_opdesc *op, int peer, int *fd_out) {
    int fd = __atomic_load_n(&c->fds[peer], __ATOMIC_ACQUIRE);
    if (fd >= 0) { *fd_out = fd; return RL_OK; }
    if (peer == c->rank)
        return rl_fail(c, op, RL_ERR_INVALID, peer, 0, "internal error: connection to self");
    pthread_mutex_lock(&c->peer_locks[peer]);
    int st = RL_OK;
    fd = c->fds[peer];
    if (fd < 0) {
        st = c->rank < peer ? connect_peer(c, op, peer, &fd) : await_peer(c, op, peer, &fd);
        if (st == RL_OK) note_connected(c, peer, fd);
    }
    pthread_mutex_unlock(&c->peer_locks[peer]);
    *fd_out = fd;
    return st;
}

int rl_comm_connect(rl_comm *c, int peer, int64_t timeout_ms) {
    if (peer < 0 || peer >= c->size || peer == c->rank) return RL_ERR_INVALID;
    if (c->poisoned) return RL_ERR_POISONED;
    rl_opdesc op;
    memset(&op, 0, sizeof op);
    op.opcode = RL_OP_NONE;
    op.start_ns = rl_now_ns();
    op.deadline_ns = rl_deadline_ns(timeout_ms);
    int fd;
    return rl_peer_fd(c, &op, peer, &fd);
}

/* Where the scratch starts within its page matters.  A copy whose
 * destination lies a few bytes past its source modulo 4 KiB (glibc returns
 * big blocks at page + 16, the benchmark's and many users' buffers start on
 * a page) stalls: the CPU matches a load against earlier stores by the low
 * 12 address bits only, so every load waits on a store that only looks like
 * the same address ("4K aliasing"), which doubled the time of copy-bound ops
 * once the scratch had grown past glibc's mmap threshold.  Half a page from
 * the user buffer avoids that and keeps the two in different L1 sets
 * (docs/algorithms.md, "Scratch"). */
#define RL_PAGE 4096
int rl_scratch(rl_comm *c, const rl_opdesc *op, size_t len, const void *near, char **out) {
    if (c->scratch_len < len) {
        void *p = NULL;
        free(c->scratch); /* nothing in it is kept between calls */
        c->scratch = NULL;
        c->scratch_len = 0;
        if (len > SIZE_MAX - RL_PAGE || posix_memalign(&p, RL_PAGE, len + RL_PAGE) != 0)
            return rl_fail(c, op, RL_ERR_NOMEM, -1, 0, "cannot allocate %zu bytes of scratch", len);
        c->scratch = p;
        c->scratch_len = len;
    }
    *out = c->scratch + (near ? ((uintptr_t)near + RL_PAGE / 2) % RL_PAGE : 0);
    return RL_OK;
}
