/*
 * p2p.c - tagged point-to-point messages.
 *
 * Each (sender, receiver) pair has one connection per communicator, so
 * frames from one sender arrive in the order they were sent.  A receive for
 * (src, tag) takes the first frame from src with that tag: frames with
 * other tags that arrive first are buffered (bounded by
 * rl_tune.p2p_unexpected_bytes per communicator) until someone asks for
 * them.  A matching frame whose size or dtype differs from the receive is a
 * desync error naming both.  Sends to one peer are serialised, as are
 * receives from one peer; a send and a receive may run at once on two
 * threads (the socket is full duplex).  Ranks of one host exchange the same
 * frames through rings in shared memory instead (shm.c), when the comm has
 * a segment; a message larger than the ring is read there straight from
 * the sender's buffer.  A receive from any source (rl_recv_any) takes the
 * first frame with its tag from whichever peer it finds one.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

int rl_send(rl_comm *c, const void *buf, size_t count, rl_dtype dt, int dst,
            uint32_t tag, int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || dst < 0 || dst >= c->size || dst == c->rank ||
        (!buf && count))
        return RL_ERR_INVALID;
    rl_opdesc op;
    size_t len = count * rl_dtype_size(dt);
    int st = rl_begin_op(c, &op, RL_OP_P2P, dt, 0, -1, len, timeout_ms);
    if (st != RL_OK) return st;
    rl_trace_p2p(&op, dst, tag, 0);
    pthread_mutex_lock(&c->send_locks[dst]);
    op.seq = c->p2p_send_seq[dst]++;
    rl_hdr h;
    rl_fill_header(&h, c, &op, tag, len);
    st = c->shm ? rl_shm_send_frame(c, &op, dst, &h, buf, len)
                : rl_send_frame(c, &op, dst, &h, buf, len);
    pthread_mutex_unlock(&c->send_locks[dst]);
    return rl_end_op(c, &op, st);
}

static int take_unexpected(rl_comm *c, rl_opdesc *op, int src, uint32_t tag,
                           void *buf, size_t len, rl_dtype dt, int *found) {
    *found = 0;
    for (rl_unexpected **pp = &c->unexpected[src]; *pp; pp = &(*pp)->next) {
        rl_unexpected *u = *pp;
        if (u->tag != tag) continue;
        *found = 1;
        *pp = u->next;
        op->algo = u->algo;
        int st = RL_OK;
        if (u->nbytes != len || u->dtype != dt)
            st = rl_fail(c, op, RL_ERR_DESYNC, src, 0,
                         "desync: recv(tag=%u) expects %zu bytes of %s but the peer sent %llu bytes of %s",
                         tag, len, rl_dtype_name(dt), (unsigned long long)u->nbytes,
                         u->dtype < RL_NDTYPES ? rl_dtype_name((rl_dtype)u->dtype) : "?");
        else if (len)
            rl_copy(buf, u->data, len);
        __atomic_sub_fetch(&c->unexpected_bytes, u->nbytes, __ATOMIC_RELAXED);
        free(u->data);
        free(u);
        return st;
    }
    return RL_OK;
}

/* Read the next frame from src: a frame with `tag` lands in buf (*found),
 * another tag is buffered for a later receive.  Called with src's receive
 * lock held; over TCP, src's connection must exist. */
static int recv_frame(rl_comm *c, rl_opdesc *op, int src, void *buf, size_t len,
                      rl_dtype dt, uint32_t tag, int *found) {
    rl_hdr h;
    int fd, st;
    *found = 0;
    if (c->shm) {
        /* an abort comes through the segment's record, not as a frame */
        if ((st = rl_shm_recv_header(c, op, src, &h)) != RL_OK) return st;
    } else {
        if ((st = rl_recv_bytes(c, op, src, &h, sizeof h)) != RL_OK) return st;
        if ((st = rl_peer_fd(c, op, src, &fd)) != RL_OK) return st;
        if (h.magic == RL_MAGIC && h.opcode == RL_OP_ABORT)
            return rl_handle_abort(c, op, src, fd, &h, NULL, 0);
    }
    uint64_t want_seq = c->p2p_recv_seq[src]++;
    if (h.magic != RL_MAGIC || h.version != RL_PROTOCOL_VERSION || h.comm_id != c->id ||
        h.opcode != RL_OP_P2P || h.seq != want_seq)
        return rl_fail(c, op, RL_ERR_PROTOCOL, src, 0,
                       "malformed point-to-point frame (magic 0x%08x, op %u, comm %u, seq %llu, expected seq %llu)",
                       h.magic, h.opcode, h.comm_id, (unsigned long long)h.seq,
                       (unsigned long long)want_seq);
    if (h.nbytes > (uint64_t)rl_tune.max_frame_bytes || h.dtype >= RL_NDTYPES)
        return rl_fail(c, op, RL_ERR_PROTOCOL, src, 0, "frame of %llu bytes exceeds the maximum",
                       (unsigned long long)h.nbytes);
    if (h.tag == tag) {
        if (h.nbytes != len || h.dtype != dt)
            return rl_fail(c, op, RL_ERR_DESYNC, src, 0,
                           "desync: recv(tag=%u) expects %zu bytes of %s but the peer sent %llu bytes of %s",
                           tag, len, rl_dtype_name(dt), (unsigned long long)h.nbytes,
                           rl_dtype_name((rl_dtype)h.dtype));
        *found = 1;
        return c->shm ? rl_shm_recv_body(c, op, src, buf, len)
                      : rl_recv_bytes(c, op, src, buf, len);
    }
    /* Another tag: keep it for a later receive, within the budget. */
    uint64_t now = __atomic_add_fetch(&c->unexpected_bytes, h.nbytes, __ATOMIC_RELAXED);
    if (now > (uint64_t)rl_tune.p2p_unexpected_bytes) {
        __atomic_sub_fetch(&c->unexpected_bytes, h.nbytes, __ATOMIC_RELAXED);
        return rl_fail(c, op, RL_ERR_PROTOCOL, src, 0,
                       "unmatched messages from this peer exceed the %lld-byte buffer (waiting for tag %u, got tag %u)",
                       (long long)rl_tune.p2p_unexpected_bytes, tag, h.tag);
    }
    rl_unexpected *u = calloc(1, sizeof *u);
    char *data = h.nbytes ? malloc(h.nbytes) : NULL;
    if (!u || (h.nbytes && !data)) {
        free(u);
        free(data);
        __atomic_sub_fetch(&c->unexpected_bytes, h.nbytes, __ATOMIC_RELAXED);
        return rl_fail(c, op, RL_ERR_NOMEM, src, 0, "out of memory buffering a message");
    }
    u->tag = h.tag;
    u->dtype = h.dtype;
    u->nbytes = h.nbytes;
    u->data = data;
    if (c->shm) {
        /* the op's algorithm names how its own message came, not this one */
        const char *algo = op->algo;
        op->algo = NULL;
        st = rl_shm_recv_body(c, op, src, data, h.nbytes);
        u->algo = op->algo;
        op->algo = algo;
    } else
        st = h.nbytes ? rl_recv_bytes(c, op, src, data, h.nbytes) : RL_OK;
    if (st != RL_OK) {
        free(data);
        free(u);
        __atomic_sub_fetch(&c->unexpected_bytes, h.nbytes, __ATOMIC_RELAXED);
        return st;
    }
    rl_unexpected **tail = &c->unexpected[src];
    while (*tail) tail = &(*tail)->next;
    *tail = u;
    return RL_OK;
}

static int recv_locked(rl_comm *c, rl_opdesc *op, int src, void *buf, size_t len,
                       rl_dtype dt, uint32_t tag) {
    int found, st = take_unexpected(c, op, src, tag, buf, len, dt, &found);
    while (st == RL_OK && !found) st = recv_frame(c, op, src, buf, len, dt, tag, &found);
    return st;
}

int rl_recv(rl_comm *c, void *buf, size_t count, rl_dtype dt, int src, uint32_t tag,
            int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || src < 0 || src >= c->size || src == c->rank ||
        (!buf && count))
        return RL_ERR_INVALID;
    rl_opdesc op;
    size_t len = count * rl_dtype_size(dt);
    int st = rl_begin_op(c, &op, RL_OP_P2P, dt, 0, -1, len, timeout_ms);
    if (st != RL_OK) return st;
    rl_trace_p2p(&op, src, tag, 1);
    pthread_mutex_lock(&c->recv_locks[src]);
    st = recv_locked(c, &op, src, buf, len, dt, tag);
    pthread_mutex_unlock(&c->recv_locks[src]);
    /* It may have buffered, or left in the stream, what a receive from any
     * source waits for, while that receive could not look at src. */
    if (__atomic_load_n(&c->any_waiting, __ATOMIC_SEQ_CST)) rl_p2p_wake_any(c);
    return rl_end_op(c, &op, st);
}

/* ---- receive from any source ----------------------------------------------
 * Looks at every peer in turn (round robin from the one after the last
 * match, so no sender starves the others): a buffered message with the tag,
 * else the frames that have arrived, buffering those with other tags.  A
 * peer whose receive lock another thread holds is skipped; that thread
 * wakes this one when it lets go.  Then it waits for any peer: over TCP in
 * poll() on every connected socket and any_efd, over shared memory on the
 * segment's bell. */
void rl_p2p_wake_any(rl_comm *c) {
    if (c->shm) rl_shm_wake_all(c);
    int fd = __atomic_load_n(&c->any_efd, __ATOMIC_ACQUIRE);
    if (fd >= 0) {
        uint64_t one = 1;
        if (write(fd, &one, sizeof one) < 0) { /* full or closing: a wake is pending anyway */ }
    }
}

static int frame_ready(rl_comm *c, int q) {
    if (c->shm) return rl_shm_p2p_ready(c, q);
    int fd = rl_peer_fd_try(c, q);
    if (fd < 0) return 0;
    struct pollfd p = {fd, POLLIN, 0};
    return poll(&p, 1, 0) > 0; /* an error or the peer's close counts: the read reports it */
}

/* Wait over TCP: poll briefly (as wait_some does), then block.  Peers that
 * have not dialled yet are looked for every RL_ANY_DIAL_MS (their connection
 * lands in the listener's mailbox, which no socket here signals). */
#define RL_ANY_DIAL_MS 2
static int tcp_wait_any(rl_comm *c, const rl_opdesc *op, const unsigned char *skip,
                        int64_t *spin_until) {
    int P = c->size, n = 0, unconnected = 0;
    struct pollfd small[33], *pfd = P + 1 <= 33 ? small : malloc(sizeof *pfd * (size_t)(P + 1));
    if (!pfd) return rl_fail(c, op, RL_ERR_NOMEM, -1, 0, "out of memory");
    for (int q = 0; q < P; q++) {
        if (q == c->rank || skip[q]) continue;
        int fd = __atomic_load_n(&c->fds[q], __ATOMIC_ACQUIRE);
        if (fd < 0) { unconnected = 1; continue; }
        pfd[n].fd = fd;
        pfd[n].events = POLLIN;
        pfd[n++].revents = 0;
    }
    pfd[n].fd = c->any_efd;
    pfd[n].events = POLLIN;
    pfd[n++].revents = 0;
    /* A lower rank still to dial needs this rank's listener. */
    int st = unconnected ? rl_listener_check(c, op) : RL_OK;
    if (st != RL_OK) {
        if (pfd != small) free(pfd);
        return st;
    }
    int64_t now = rl_now_ns();
    if (*spin_until < 0)
        *spin_until = rl_host_contended(now) ? now : now + rl_tune.spin_us * 1000LL;
    int ms = 0;
    if (now < *spin_until) {
        if (rl_tune.spin_yield) sched_yield();
    } else {
        int64_t left_ms = (op->deadline_ns - now + 999999) / 1000000LL;
        ms = unconnected ? RL_ANY_DIAL_MS : 100;
        if (left_ms < ms) ms = left_ms > 0 ? (int)left_ms : 0;
    }
    int r = poll(pfd, (nfds_t)n, ms);
    if (r < 0 && errno != EINTR)
        st = rl_fail(c, op, RL_ERR_SYSTEM, -1, errno, "poll: %s", strerror(errno));
    if (r > 0) *spin_until = -1; /* something moved: poll again before the next sleep */
    if (pfd != small) free(pfd);
    return st;
}

static int recv_any_locked(rl_comm *c, rl_opdesc *op, void *buf, size_t len, rl_dtype dt,
                           uint32_t tag, int *src) {
    int P = c->size, st = RL_OK;
    unsigned char *skip = calloc((size_t)P, 1);
    if (!skip) return rl_fail(c, op, RL_ERR_NOMEM, -1, 0, "out of memory");
    if (!c->shm) {
        if (c->any_efd < 0) {
            int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
            if (fd < 0) {
                st = rl_fail(c, op, RL_ERR_SYSTEM, -1, errno, "eventfd: %s", strerror(errno));
                goto out;
            }
            __atomic_store_n(&c->any_efd, fd, __ATOMIC_RELEASE);
        }
        /* Dial every higher rank now: its send would wait for this rank to. */
        for (int q = c->rank + 1; q < P; q++) {
            int fd;
            if ((st = rl_peer_fd(c, op, q, &fd)) != RL_OK) goto out;
        }
    }
    int64_t spin_until = -1, last_hook = rl_now_ns();
    for (;;) {
        /* Read the wake-up state first: a wake after this is not missed. */
        uint32_t bell = 0;
        if (c->shm) bell = rl_shm_bell(c);
        else {
            uint64_t v;
            if (read(c->any_efd, &v, sizeof v) < 0) { /* nothing pending */ }
        }
        int moved = 0;
        for (int i = 0; i < P; i++) {
            int q = (c->any_next + i) % P, found = 0;
            if (q == c->rank) continue;
            skip[q] = 0;
            if (pthread_mutex_trylock(&c->recv_locks[q]) != 0) {
                skip[q] = 1;
                continue;
            }
            st = take_unexpected(c, op, q, tag, buf, len, dt, &found);
            while (st == RL_OK && !found && frame_ready(c, q)) {
                st = recv_frame(c, op, q, buf, len, dt, tag, &found);
                moved = 1;
            }
            pthread_mutex_unlock(&c->recv_locks[q]);
            if (st != RL_OK) goto out;
            if (found) {
                c->any_next = (q + 1) % P;
                *src = q;
                goto out;
            }
        }
        if (c->poisoned) {
            st = c->err.status ? c->err.status : RL_ERR_POISONED;
            goto out;
        }
        int64_t now = rl_now_ns();
        if (now >= op->deadline_ns) {
            st = rl_fail(c, op, RL_ERR_TIMEOUT, -1, 0,
                         "timed out: no message with tag %u from any of the %d peers "
                         "(receive from any source)", tag, P - 1);
            goto out;
        }
        if (now - last_hook >= 90000000LL) {
            last_hook = now;
            if (rl_call_interrupt_hook()) {
                st = rl_fail(c, op, RL_ERR_INTERRUPTED, -1, 0, "interrupted");
                goto out;
            }
        }
        if (moved) continue;
        st = c->shm ? rl_shm_wait_any(c, op, skip, bell) : tcp_wait_any(c, op, skip, &spin_until);
        if (st != RL_OK) goto out;
    }
out:
    free(skip);
    return st;
}

int rl_recv_any(rl_comm *c, void *buf, size_t count, rl_dtype dt, uint32_t tag,
                int64_t timeout_ms, int *src) {
    if ((unsigned)dt >= RL_NDTYPES || (!buf && count) || !src || c->size < 2)
        return RL_ERR_INVALID;
    rl_opdesc op;
    size_t len = count * rl_dtype_size(dt);
    *src = -1;
    int st = rl_begin_op(c, &op, RL_OP_P2P, dt, 0, -1, len, timeout_ms);
    if (st != RL_OK) return st;
    rl_trace_p2p(&op, -1, tag, 1);
    /* One at a time: each drains the wake-ups it waits on.  The wait calls
     * the interrupt hook every ~90 ms, as every other wait does (Ctrl-C). */
    int64_t last_hook = rl_now_ns();
    for (;;) {
        if (pthread_mutex_trylock(&c->any_lock) == 0) break;
        if (c->poisoned) return rl_end_op(c, &op, RL_ERR_POISONED);
        int64_t now = rl_now_ns();
        if (now >= op.deadline_ns)
            return rl_end_op(c, &op, rl_fail(c, &op, RL_ERR_TIMEOUT, -1, 0,
                                              "timed out waiting for another receive from any "
                                              "source on this communicator"));
        if (now - last_hook >= 90000000LL) {
            last_hook = now;
            if (rl_call_interrupt_hook())
                return rl_end_op(c, &op, rl_fail(c, &op, RL_ERR_INTERRUPTED, -1, 0,
                                                  "interrupted while waiting for another receive "
                                                  "from any source on this communicator"));
        }
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    __atomic_add_fetch(&c->any_waiting, 1, __ATOMIC_SEQ_CST);
    st = recv_any_locked(c, &op, buf, len, dt, tag, src);
    __atomic_sub_fetch(&c->any_waiting, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&c->any_lock);
    if (st == RL_OK) rl_trace_p2p(&op, *src, tag, 1);
    return rl_end_op(c, &op, st);
}
