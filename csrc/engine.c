/*
 * engine.c - the progress engine: drives several frame streams at once over
 * non-blocking sockets, checks every received header, and waits the way this
 * machine rewards.
 *
 * Wait policy.  When no stream can move, the engine first spins for
 * rl_tune.spin_us, retrying the sockets and calling sched_yield() between
 * tries: a waiting rank that polls sees a reply in a few microseconds instead
 * of paying for a wake-up, and the yield hands the core to another rank
 * when ranks outnumber cores (if both are in one scheduler autogroup, i.e.
 * one session: ringlet run sees to that).  With no more ranks than cores
 * init() turns the yield off (rl_tune.spin_yield): two ranks that yield to
 * each other every few microseconds on one core both stay "cache hot", so
 * the scheduler never moves one to the idle core.  While other processes
 * want the host's cores (wait.c) it skips the spin: a spinner there takes
 * the slice its peer needs.  After the spin budget it
 * blocks in poll(2) in slices of at most 100 ms, calling the interrupt hook
 * between slices (so Ctrl-C works) and checking the operation's deadline.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "internal.h"

void rl_fill_header(rl_hdr *h, const rl_comm *c, const rl_opdesc *op,
                    uint32_t tag, uint64_t nbytes) {
    h->magic = RL_MAGIC;
    h->version = RL_PROTOCOL_VERSION;
    h->opcode = (uint8_t)op->opcode;
    h->dtype = (uint8_t)op->dtype;
    h->redop = (uint8_t)op->redop;
    h->comm_id = c->id;
    h->root = op->root;
    h->seq = op->seq;
    h->total = op->total;
    h->nbytes = nbytes;
    h->tag = tag;
    h->flags = 0;
}

void rl_describe_header(char *buf, size_t n, const rl_hdr *h) {
    const char *dt = h->dtype < RL_NDTYPES ? rl_dtype_name((rl_dtype)h->dtype) : "?";
    snprintf(buf, n, "%s(seq=%llu, dtype=%s, op=%s, root=%d, total=%llu bytes, frame %u of %llu bytes)",
             rl_opcode_name(h->opcode), (unsigned long long)h->seq, dt,
             h->redop < RL_NOPS ? rl_op_name((rl_redop)h->redop) : "?", h->root,
             (unsigned long long)h->total, h->tag, (unsigned long long)h->nbytes);
}

int rl_handle_abort(rl_comm *c, const rl_opdesc *op, int peer, int fd,
                    const rl_hdr *h, const char *have, size_t nhave) {
    char reason[RL_ABORT_REASON_MAX + 1];
    size_t want = h->nbytes < RL_ABORT_REASON_MAX ? (size_t)h->nbytes : RL_ABORT_REASON_MAX;
    size_t got = nhave < want ? nhave : want;
    if (got) memcpy(reason, have, got); /* p2p passes have = NULL */
    /* The rest of the reason is already in flight; give it a moment. */
    int64_t until = rl_now_ns() + 200000000LL;
    while (got < want && rl_now_ns() < until) {
        ssize_t n = recv(fd, reason + got, want - got, MSG_DONTWAIT);
        if (n > 0) { got += (size_t)n; continue; }
        if (n == 0 || (errno != EAGAIN && errno != EINTR)) break;
        struct pollfd p = {fd, POLLIN, 0};
        (void)poll(&p, 1, 20);
    }
    reason[got] = 0;
    int st = (int)h->flags;
    /* Keep the class of the original failure so every rank raises the same
     * kind of error; an unknown code becomes a plain abort. */
    if (st != RL_ERR_TIMEOUT && st != RL_ERR_PEER_CLOSED && st != RL_ERR_DESYNC &&
        st != RL_ERR_AUTH && st != RL_ERR_PROTOCOL)
        st = RL_ERR_ABORTED;
    return rl_fail(c, op, st, peer, 0, "peer aborted the operation: [%s]", reason);
}

int rl_check_header(rl_comm *c, const rl_opdesc *op, int peer,
                    const rl_hdr *got, const rl_hdr *want) {
    if (got->magic != RL_MAGIC || got->version != RL_PROTOCOL_VERSION)
        return rl_fail(c, op, RL_ERR_PROTOCOL, peer, 0,
                       "malformed frame header (magic 0x%08x, version %u)",
                       got->magic, got->version);
    if (got->comm_id != want->comm_id)
        return rl_fail(c, op, RL_ERR_PROTOCOL, peer, 0,
                       "frame for communicator %u arrived on communicator %u",
                       got->comm_id, want->comm_id);
    if (got->opcode != want->opcode || got->dtype != want->dtype ||
        got->redop != want->redop || got->root != want->root ||
        got->seq != want->seq || got->total != want->total ||
        got->tag != want->tag || got->nbytes != want->nbytes) {
        char a[256], b[256];
        rl_describe_header(a, sizeof a, want);
        rl_describe_header(b, sizeof b, got);
        if (got->seq < want->seq && got->seq == c->rooted_seq &&
            got->opcode == c->rooted_op && got->root != c->rooted_root)
            return rl_fail(c, op, RL_ERR_DESYNC, peer, 0,
                           "desync: ranks passed different roots to %s seq=%llu: root %d on "
                           "this rank, root %d on the peer; its stray frame arrived while this "
                           "rank expects %s (the peer sent %s)",
                           rl_opcode_name(c->rooted_op), (unsigned long long)got->seq,
                           c->rooted_root, got->root, a, b);
        return rl_fail(c, op, RL_ERR_DESYNC, peer, 0,
                       "desync: this rank expects %s but the peer sent %s", a, b);
    }
    if (got->nbytes > (uint64_t)rl_tune.max_frame_bytes)
        return rl_fail(c, op, RL_ERR_PROTOCOL, peer, 0, "frame of %llu bytes exceeds the maximum",
                       (unsigned long long)got->nbytes);
    return RL_OK;
}

/* ---- waiting ----------------------------------------------------------- */
typedef struct {
    int64_t spin_until;
    int spinning;
} waiter;

static void waiter_reset(waiter *w) { w->spinning = 0; }

/* Called when nothing moved.  Returns RL_OK to retry the sockets. */
static int wait_some(rl_comm *c, const rl_opdesc *op, waiter *w,
                     struct pollfd *pfd, int n, int blame_peer) {
    int64_t now = rl_now_ns();
    if (!w->spinning) {
        w->spinning = 1;
        w->spin_until = rl_host_contended(now) ? now : now + rl_tune.spin_us * 1000LL;
    }
    if (now < w->spin_until) {
        if (rl_tune.spin_yield) sched_yield();
        return RL_OK;
    }
    if (now >= op->deadline_ns)
        return rl_fail(c, op, RL_ERR_TIMEOUT, blame_peer, 0,
                       "timed out (the peer is hung, stopped, or never called this op)");
    int64_t left_ms = (op->deadline_ns - now + 999999) / 1000000LL;
    int slice = left_ms > 100 ? 100 : (int)left_ms;
    int r = poll(pfd, (nfds_t)n, slice);
    if (r < 0 && errno != EINTR)
        return rl_fail(c, op, RL_ERR_SYSTEM, blame_peer, errno, "poll: %s", strerror(errno));
    if (r <= 0 && rl_call_interrupt_hook())
        return rl_fail(c, op, RL_ERR_INTERRUPTED, blame_peer, 0, "interrupted");
    if (r > 0) w->spinning = 0; /* data arrived: spin again next time */
    return RL_OK;
}

static int io_error(rl_comm *c, const rl_opdesc *op, int peer, int err, int sending) {
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN || err == ESHUTDOWN)
        return rl_fail(c, op, RL_ERR_PEER_CLOSED, peer, err,
                       "connection lost while %s (%s): the peer exited, crashed or aborted",
                       sending ? "sending" : "receiving", strerror(err));
    return rl_fail(c, op, RL_ERR_SYSTEM, peer, err, "%s: %s", sending ? "send" : "recv",
                   strerror(err));
}

/* Move bytes of the active frame of s.  Returns RL_OK (maybe partial),
 * sets *moved when bytes moved and *finished when the frame is complete. */
static int stream_io(rl_comm *c, const rl_opdesc *op, rl_stream *s, void *alg,
                     int *moved, int *finished) {
    const size_t H = sizeof(rl_hdr);
    size_t total = H + s->len;
    *finished = 0;
    while (s->off < total) {
        struct iovec iov[2];
        int niov = 0;
        if (s->off < H) {
            iov[niov].iov_base = (char *)&s->hdr + s->off;
            iov[niov].iov_len = H - s->off;
            niov++;
            if (s->len) {
                iov[niov].iov_base = s->ptr;
                iov[niov].iov_len = s->len;
                niov++;
            }
        } else {
            iov[0].iov_base = s->ptr + (s->off - H);
            iov[0].iov_len = total - s->off;
            niov = 1;
        }
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)niov;
        ssize_t n = s->is_send ? sendmsg(s->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT)
                               : recvmsg(s->fd, &mh, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return RL_OK;
            if (errno == EINTR) continue;
            return io_error(c, op, s->peer, errno, s->is_send);
        }
        if (n == 0 && !s->is_send)
            return rl_fail(c, op, RL_ERR_PEER_CLOSED, s->peer, 0,
                           "the peer closed the connection (it exited, crashed or aborted)");
        size_t before = s->off;
        s->off += (size_t)n;
        *moved = 1;
        if (!s->is_send && before < H && s->off >= H) {
            /* Header complete: check it before trusting the payload. */
            rl_hdr want;
            if (s->hdr.opcode == RL_OP_ABORT && s->hdr.magic == RL_MAGIC)
                return rl_handle_abort(c, op, s->peer, s->fd, &s->hdr, s->ptr,
                                       s->off - H);
            rl_fill_header(&want, c, op, s->tag_base + (uint32_t)s->cur, s->len);
            if (s->total) want.total = s->total;
            int st = rl_check_header(c, op, s->peer, &s->hdr, &want);
            if (st != RL_OK) return st;
        }
    }
    (void)alg;
    *finished = 1;
    return RL_OK;
}

int rl_overlap(const void *a, size_t al, const void *b, size_t bl) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return al && bl && x < y + bl && y < x + al;
}

/* Bulk receive.  A receiver blocked in poll() is woken for every batch of
 * segments the loopback delivers, and each wake-up is work for the sending
 * core, which runs the delivery.  A rank that does nothing but receive a
 * message of at least bulk_recv_bytes from a sender that does nothing but
 * send it takes it in bulk: it sets SO_RCVLOWAT to what its frame still
 * misses, at most a segment (segment_bytes), so the kernel wakes it once
 * per segment's worth, and blocks instead of spinning.  That costs one
 * segment's copy at the end of the message (it no longer overlaps the
 * transfer), which smaller messages do not earn back.  Collectives opt in
 * per stream (`bulk`: the receiver of a 2-rank broadcast, one frame); a
 * point-to-point receive of that size always does (docs/algorithms.md,
 * "Waiting").  The kernel still wakes a reader whose receive window is full,
 * and a peer's abort or exit shuts the socket down, which wakes it too. */
#define RL_LOWAT_MIN ((size_t)64 << 10)
static void set_lowat(int fd, size_t *have, size_t want) {
    if (*have == want) return;
    int v = want > 1 ? (want < (1u << 30) ? (int)want : 1 << 30) : 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);
    *have = want;
}

static int bulk_receiver(const rl_opdesc *op, const rl_stream *s, int n,
                         const rl_idle_copy *cp) {
    uint64_t total = s->total ? s->total : op->total;
    return rl_tune.bulk_recv_bytes > 0 && n == 1 && s->bulk && !s->is_send && !cp &&
           total >= (uint64_t)rl_tune.bulk_recv_bytes;
}

/* Before a bulk receiver with `rem` bytes still to come waits: mark up to
 * `cap` of them and block at once, or, for a short tail that a larger mark
 * would never see met, take the mark off and wait as usual. */
static void bulk_wait(int fd, size_t *lowat, size_t rem, size_t cap, waiter *w) {
    if (rem < RL_LOWAT_MIN) {
        set_lowat(fd, lowat, 0);
        return;
    }
    set_lowat(fd, lowat, rem < cap ? rem : cap);
    w->spinning = 1;
    w->spin_until = 0;
}

/* One slice of the idle copy; returns 1 if it copied anything.  A slice is
 * small enough (tens of microseconds) not to delay a socket that becomes
 * ready meanwhile, large enough that the call overhead is negligible. */
#define RL_COPY_SLICE ((size_t)128 << 10)
static int idle_copy_step(rl_idle_copy *cp) {
    if (!cp || cp->done >= cp->len) return 0;
    size_t k = cp->len - cp->done < RL_COPY_SLICE ? cp->len - cp->done : RL_COPY_SLICE;
    /* A large own block will not be read again before the op returns, and
     * streaming it leaves the cache to the socket copies it interleaves with. */
    if (cp->len >= RL_STREAM_COPY_MIN) rl_copy_stream(cp->dst + cp->done, cp->src + cp->done, k);
    else rl_copy(cp->dst + cp->done, cp->src + cp->done, k);
    cp->done += k;
    return 1;
}

int rl_run_streams(rl_comm *c, const rl_opdesc *op, rl_stream *s, int n, void *alg) {
    return rl_run_streams_copy(c, op, s, n, alg, NULL);
}

int rl_run_streams_copy(rl_comm *c, const rl_opdesc *op, rl_stream *s, int n, void *alg,
                        rl_idle_copy *cp) {
    struct pollfd pfd_small[8];
    struct pollfd *pfd = n <= 8 ? pfd_small : malloc(sizeof(struct pollfd) * (size_t)n);
    if (!pfd) return rl_fail(c, op, RL_ERR_NOMEM, -1, 0, "out of memory");
    int st = RL_OK;
    for (int i = 0; i < n; i++) s[i].lowat = 0; /* read on every exit path */
    for (int i = 0; i < n; i++) {
        s[i].cur = 0;
        s[i].active = 0;
        s[i].off = 0;
        if ((st = rl_peer_fd(c, op, s[i].peer, &s[i].fd)) != RL_OK) goto out;
    }
    waiter w;
    waiter_reset(&w);
    const int bulk = bulk_receiver(op, s, n, cp);
    for (;;) {
        int moved = 0, unfinished = 0, npoll = 0, blame = -1;
        for (int i = 0; i < n; i++) {
            rl_stream *x = &s[i];
            for (;;) {
                if (!x->active) {
                    if (x->cur >= x->nseg) break;
                    if (x->ready && !x->ready(alg, x, x->cur)) break;
                    x->where(alg, x, x->cur, &x->ptr, &x->len);
                    if (x->is_send) {
                        rl_fill_header(&x->hdr, c, op, x->tag_base + (uint32_t)x->cur, x->len);
                        if (x->total) x->hdr.total = x->total;
                    }
                    x->off = 0;
                    x->active = 1;
                }
                int fin = 0;
                if ((st = stream_io(c, op, x, alg, &moved, &fin)) != RL_OK) goto out;
                if (!fin) break;
                x->active = 0;
                if (x->done && (st = x->done(alg, x, x->cur)) != RL_OK) goto out;
                x->cur++;
                moved = 1;
            }
            if (x->cur < x->nseg) {
                unfinished = 1;
                if (x->active) {
                    pfd[npoll].fd = x->fd;
                    pfd[npoll].events = x->is_send ? POLLOUT : POLLIN;
                    pfd[npoll].revents = 0;
                    npoll++;
                    if (blame < 0 || !x->is_send) blame = x->peer;
                }
            }
        }
        if (!unfinished) break;
        if (moved) { waiter_reset(&w); continue; }
        if (idle_copy_step(cp)) continue; /* nothing to move: do local work */
        if (npoll == 0) {
            st = rl_fail(c, op, RL_ERR_INVALID, -1, 0, "internal error: streams stalled");
            goto out;
        }
        if (bulk) /* the mark: what the current frame still misses, at most a segment */
            bulk_wait(s[0].fd, &s[0].lowat,
                      s[0].active ? sizeof(rl_hdr) + s[0].len - s[0].off : 0,
                      (size_t)rl_tune.segment_bytes, &w);
        if ((st = wait_some(c, op, &w, pfd, npoll, blame)) != RL_OK) goto out;
        if (c->poisoned) { st = RL_ERR_POISONED; goto out; }
    }
    while (idle_copy_step(cp)) {}
out:
    for (int i = 0; i < n; i++) set_lowat(s[i].fd, &s[i].lowat, 0); /* the next op may not want it */
    if (pfd != pfd_small) free(pfd);
    return st;
}

/* ---- blocking helpers for point to point ------------------------------- */
static int one_stream_io(rl_comm *c, const rl_opdesc *op, int peer, int fd, void *buf,
                         size_t len, int sending, rl_hdr *h, size_t *lowat) {
    int st;
    size_t H = h ? sizeof(rl_hdr) : 0, off = 0, total = H + len;
    /* A large receive is taken in bulk, woken per segment's worth of bytes. */
    int bulk = !sending && rl_tune.bulk_recv_bytes > 0 && len >= (uint64_t)rl_tune.bulk_recv_bytes;
    size_t seg = (size_t)rl_tune.segment_bytes;
    waiter w;
    waiter_reset(&w);
    while (off < total) {
        struct iovec iov[2];
        int niov = 0;
        if (off < H) {
            iov[niov].iov_base = (char *)h + off;
            iov[niov++].iov_len = H - off;
            if (len) { iov[niov].iov_base = buf; iov[niov++].iov_len = len; }
        } else {
            iov[niov].iov_base = (char *)buf + (off - H);
            iov[niov++].iov_len = total - off;
        }
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)niov;
        ssize_t n = sending ? sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT)
                            : recvmsg(fd, &mh, MSG_DONTWAIT);
        if (n > 0) { off += (size_t)n; waiter_reset(&w); continue; }
        if (n == 0 && !sending)
            return rl_fail(c, op, RL_ERR_PEER_CLOSED, peer, 0,
                           "the peer closed the connection (it exited, crashed or aborted)");
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return io_error(c, op, peer, errno, sending);
        struct pollfd p = {fd, (short)(sending ? POLLOUT : POLLIN), 0};
        if (bulk) bulk_wait(fd, lowat, total - off, seg, &w); /* one frame's worth */
        if ((st = wait_some(c, op, &w, &p, 1, peer)) != RL_OK) return st;
        if (c->poisoned) return RL_ERR_POISONED;
    }
    return RL_OK;
}

static int one_stream(rl_comm *c, const rl_opdesc *op, int peer, void *buf,
                      size_t len, int sending, rl_hdr *h) {
    int fd;
    int st = rl_peer_fd(c, op, peer, &fd);
    if (st != RL_OK) return st;
    size_t lowat = 0;
    st = one_stream_io(c, op, peer, fd, buf, len, sending, h, &lowat);
    set_lowat(fd, &lowat, 0); /* the next receive may not want it */
    return st;
}

int rl_send_frame(rl_comm *c, const rl_opdesc *op, int peer, rl_hdr *h,
                  const void *payload, size_t len) {
    return one_stream(c, op, peer, (void *)payload, len, 1, h);
}

int rl_recv_bytes(rl_comm *c, const rl_opdesc *op, int peer, void *buf, size_t len) {
    return one_stream(c, op, peer, buf, len, 0, NULL);
}
