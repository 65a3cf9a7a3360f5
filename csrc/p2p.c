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
 * the sender's buffer.
 */
#include <stdlib.h>
#include <string.h>

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
            memcpy(buf, u->data, len);
        __atomic_sub_fetch(&c->unexpected_bytes, u->nbytes, __ATOMIC_RELAXED);
        free(u->data);
        free(u);
        return st;
    }
    return RL_OK;
}

static int recv_locked(rl_comm *c, rl_opdesc *op, int src, void *buf, size_t len,
                       rl_dtype dt, uint32_t tag) {
    int found, st = take_unexpected(c, op, src, tag, buf, len, dt, &found);
    if (found || st != RL_OK) return st;
    for (;;) {
        rl_hdr h;
        int fd;
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
            return st;
        }
        rl_unexpected **tail = &c->unexpected[src];
        while (*tail) tail = &(*tail)->next;
        *tail = u;
    }
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
    return rl_end_op(c, &op, st);
}
