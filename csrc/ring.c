/*
 * ring.c - all_gather and reduce_scatter on a ring, pipelined by segment.
 *
 * all_gather (P ranks, each contributing a block of n elements): rank r puts
 * its block in slot r of the output, then for step t = 0 .. P-2 sends block
 * (r - t) mod P to the right and receives block (r - t - 1) mod P from the
 * left straight into the output.  Segment k of step t+1 is forwarded as soon
 * as segment k of step t has arrived.  Bytes sent per rank: (P-1) * n.
 *
 * reduce_scatter (input of P blocks, output block r): for step t = 0 .. P-2
 * rank r sends the partial sum of block (r - t - 1) mod P and receives the
 * partial sum of block (r - t - 2) mod P, adding its own input block to it.
 * At step P-2 the received block is r itself, and the sum lands in the
 * output.  A segment's partial sum received at step t is forwarded at step
 * t+1 right away (the streams run segment-major), from one of two scratch
 * slots that stay in cache.  The
 * input is never modified.  Bytes sent per rank: (P-1) * n.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
    char *out;
    const char *in;
    size_t blk;    /* bytes per block */
    size_t seg;    /* bytes per segment */
    int S;         /* segments per block */
    int P, r;
    rl_dtype dt;
    rl_redop op;
    char *scratch;
    rl_stream *send, *recv;
} ring_sg;

static size_t seg_len(const ring_sg *a, int k) {
    size_t off = (size_t)k * a->seg;
    return off >= a->blk ? 0 : (a->blk - off < a->seg ? a->blk - off : a->seg);
}

/* ---- small messages: ceil(log2 P) exchanges instead of P-1 ring steps ---- */
/* Bruck's all_gather.  tmp[i] collects the block of rank (r + i) mod P: at the
 * step with distance d this rank holds blocks 0..d-1, sends the first
 * min(d, P-d) of them to r-d and receives r+d's first ones behind its own.
 * Any P; the input is copied first, so it may alias the output anywhere. */
static int bruck_all_gather(rl_comm *c, const rl_opdesc *op, char *out, const char *in,
                            size_t blk) {
    int P = c->size, r = c->rank;
    char *tmp;
    int st = rl_scratch(c, op, blk * (size_t)P, in, &tmp);
    if (st != RL_OK) return st;
    rl_copy(tmp, in, blk);
    uint32_t tag = 0;
    for (int d = 1; d < P; d <<= 1, tag++) {
        size_t cnt = (size_t)(d < P - d ? d : P - d);
        st = rl_exchange(c, op, rl_mod(r - d, P), tmp, rl_mod(r + d, P), tmp + (size_t)d * blk,
                         cnt * blk, tag);
        if (st != RL_OK) return st;
    }
    for (int i = 0; i < P; i++)
        rl_copy(out + (size_t)rl_mod(r + i, P) * blk, tmp + (size_t)i * blk, blk);
    return RL_OK;
}

/* Recursive halving (power-of-two P): at the step with distance d = P/2,
 * P/4, .., 1 this rank holds partial sums of 2d consecutive blocks, its own
 * among them; it sends the d blocks without its own to r ^ d and adds that
 * rank's copy of the other d.  log2 P exchanges instead of the ring's P-1,
 * with the ring's volume: (P-1) * n bytes sent per rank.  Each exchange uses
 * one connection both ways and the sum waits for the whole half, so the
 * pipelined ring wins once bandwidth dominates. */
static int rh_reduce_scatter(rl_comm *c, const rl_opdesc *op, char *out, const char *in,
                             size_t count, rl_dtype dt, rl_redop rop) {
    int P = c->size, r = c->rank, lo = 0;
    size_t blk = count * rl_dtype_size(dt);
    char *acc;
    int st = rl_scratch(c, op, blk * (size_t)P, in, &acc); /* P/2 blocks of sums, P/2 received */
    if (st != RL_OK) return st;
    char *rcv = acc + blk * (size_t)(P / 2);
    const char *cur = in; /* block lo + i of the current range at cur + i * blk */
    uint32_t tag = 0;
    for (int d = P / 2; d >= 1; d >>= 1, tag++) {
        int peer = r ^ d, keep = (r & d) ? lo + d : lo, give = (r & d) ? lo : lo + d;
        size_t len = (size_t)d * blk;
        st = rl_exchange(c, op, peer, cur + (size_t)(give - lo) * blk, peer, rcv, len, tag);
        if (st != RL_OK) return st;
        const char *mine = cur + (size_t)(keep - lo) * blk;
        char *dst = d == 1 ? out : acc; /* disjoint from, or equal to, mine */
        if (peer < r) /* the lower rank's sum first, as in the other algorithms */
            rl_reduce_kernel(dst, rcv, mine, count * (size_t)d, dt, rop);
        else
            rl_reduce_kernel(dst, mine, rcv, count * (size_t)d, dt, rop);
        cur = acc;
        lo = keep;
    }
    if (rop == RL_AVG) rl_scale_kernel(out, count, dt, 1.0 / P);
    return RL_OK;
}

/* ---- all_gather ---- */
/* At 2 ranks the one connection carries both directions, and letting both
 * run freely was slower than keeping them in step: segment i is sent only
 * once segment i-1 has arrived (docs/algorithms.md).  reduce_scatter uses
 * it too. */
static int pair_in_step(const ring_sg *a, int i) {
    return i == 0 || a->recv->cur > i - 1;
}
static int ag_send_ready(void *alg, rl_stream *s, int i) {
    ring_sg *a = alg;
    (void)s;
    if (a->P == 2) return pair_in_step(a, i);
    return i < a->S || a->recv->cur > i - a->S;
}
static void ag_send_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    ring_sg *a = alg;
    (void)s;
    int t = i / a->S, k = i % a->S;
    /* Step 0 sends this rank's own block straight from the input, so the
     * copy into the output need not come first. */
    if (t == 0) *p = (char *)a->in + (size_t)k * a->seg;
    else *p = a->out + (size_t)rl_mod(a->r - t, a->P) * a->blk + (size_t)k * a->seg;
    *l = seg_len(a, k);
}
static void ag_recv_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    ring_sg *a = alg;
    (void)s;
    int t = i / a->S, k = i % a->S;
    *p = a->out + (size_t)rl_mod(a->r - t - 1, a->P) * a->blk + (size_t)k * a->seg;
    *l = seg_len(a, k);
}

/* 2 ranks, blocks of RL_STREAM_OUT_MIN or more: nothing received is sent
 * on, so each segment lands in a cached slot and is streamed into the output
 * (no read of the output's lines first, as for reduce_scatter's output;
 * docs/algorithms.md).  At more ranks the received blocks are forwarded from
 * the output, which should stay cached. */
static void ag_slot_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    ring_sg *a = alg;
    (void)s;
    *p = a->scratch;
    *l = seg_len(a, i);
}
static int ag_slot_done(void *alg, rl_stream *s, int i) {
    ring_sg *a = alg;
    (void)s;
    rl_copy_stream(a->out + (size_t)(1 - a->r) * a->blk + (size_t)i * a->seg, a->scratch,
                   seg_len(a, i));
    return RL_OK;
}

int rl_all_gather(rl_comm *c, void *out, const void *in, size_t count, rl_dtype dt,
                  int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || (count && (!out || !in))) return RL_ERR_INVALID;
    rl_opdesc op;
    size_t blk = count * rl_dtype_size(dt);
    int st = rl_begin_op(c, &op, RL_OP_ALL_GATHER, dt, 0, -1, blk, timeout_ms);
    if (st != RL_OK) return st;
    if (c->shm && c->size > 1 && count)
        return rl_end_op(c, &op, rl_shm_all_gather(c, &op, out, in, count, dt));
    /* Bruck saves steps from 3 ranks on; at 2 ranks both are one exchange,
     * and the ring's needs no staging copies (docs/algorithms.md). */
    if (c->size > 2 && count && (int64_t)(blk * (size_t)c->size) <= rl_tune.allreduce_small_bytes) {
        op.algo = "bruck";
        return rl_end_op(c, &op, bruck_all_gather(c, &op, out, in, blk));
    }
    op.algo = c->size == 1 || count == 0 ? "local" : "ring";
    char *mine = (char *)out + (size_t)c->rank * blk;
    rl_idle_copy cp = {mine, in, 0, 0};
    if (mine != (const char *)in) {
        /* The own block is copied while the sockets wait, unless the input
         * overlaps the output (then receives could overwrite it). */
        if (c->size == 1 || count == 0 || rl_overlap(in, blk, out, blk * (size_t)c->size)) {
            rl_move(mine, in, blk);
            in = mine;
        } else {
            cp.len = blk;
        }
    }
    if (c->size == 1 || count == 0) return rl_end_op(c, &op, RL_OK);
    ring_sg a;
    memset(&a, 0, sizeof a);
    a.out = out;
    a.in = in;
    a.blk = blk;
    a.seg = (size_t)rl_tune.segment_bytes;
    a.S = rl_nseg(blk, a.seg);
    a.P = c->size;
    a.r = c->rank;
    rl_stream s[2];
    memset(s, 0, sizeof s);
    s[0].peer = rl_mod(a.r + 1, a.P);
    s[0].is_send = 1;
    s[0].nseg = (a.P - 1) * a.S;
    s[0].ready = ag_send_ready;
    s[0].where = ag_send_where;
    s[1].peer = rl_mod(a.r - 1, a.P);
    s[1].nseg = (a.P - 1) * a.S;
    s[1].where = ag_recv_where;
    if (a.P == 2 && blk >= RL_STREAM_OUT_MIN) {
        if ((st = rl_scratch(c, &op, a.seg, out, &a.scratch)) != RL_OK) return rl_end_op(c, &op, st);
        s[1].where = ag_slot_where;
        s[1].done = ag_slot_done;
    }
    a.recv = &s[1];
    st = rl_run_streams_copy(c, &op, s, 2, &a, &cp);
    return rl_end_op(c, &op, st);
}

/* ---- reduce_scatter ---- */
/* Both streams run segment-major: stream index i is segment k = i / (P-1)
 * of step t = i % (P-1).  Segment k received at step t is forwarded as
 * segment k of step t+1, the next index, so its partial sum is still in
 * cache when it is sent, and partial sums need one slot per step parity
 * instead of two whole blocks (the step-major order before: docs/algorithms.md). */
static void rs_split(const ring_sg *a, int i, int *t, int *k) {
    *k = i / (a->P - 1);
    *t = i % (a->P - 1);
}
/* Receives of the last step are reduced into the output as soon as they
 * arrive, so they all share one slot after the two of partial sums. */
static char *rs_slot(const ring_sg *a, int t) {
    if (t == a->P - 2) return a->scratch + (size_t)(a->P > 2 ? 2 : 0) * a->seg;
    return a->scratch + (size_t)(t % 2) * a->seg;
}
static int rs_recv_ready(void *alg, rl_stream *s, int i) {
    ring_sg *a = alg;
    int t, k;
    (void)s;
    rs_split(a, i, &t, &k);
    if (t == a->P - 2) return 1; /* the tail slot is free once reduced */
    /* The slot's previous partial sum must have been forwarded. */
    if (t >= 2) return a->send->cur > i - 1;
    if (k == 0) return 1;
    int prev = (a->P - 3) - ((a->P - 3 - t) % 2); /* last step of row k-1 in this slot */
    return a->send->cur > (k - 1) * (a->P - 1) + prev + 1;
}
static void rs_recv_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    ring_sg *a = alg;
    int t, k;
    (void)s;
    rs_split(a, i, &t, &k);
    *p = rs_slot(a, t);
    *l = seg_len(a, k);
}
static int rs_recv_done(void *alg, rl_stream *s, int i) {
    ring_sg *a = alg;
    int t, k;
    (void)s;
    rs_split(a, i, &t, &k);
    size_t esz = rl_dtype_size(a->dt), l = seg_len(a, k);
    int blk = rl_mod(a->r - t - 2, a->P);
    const char *own = a->in + (size_t)blk * a->blk + (size_t)k * a->seg;
    int last = t == a->P - 2;
    char *slot = rs_slot(a, t), *out = a->out + (size_t)k * a->seg;
    /* A large output is not read again by this op: the sum is formed in the
     * cached slot and streamed out, so the output's lines are written without
     * first being read from memory (what a plain store into them costs).
     * Only from RL_STREAM_OUT_MIN: a smaller output can stay in the L3
     * between calls, and streaming pushes it out (docs/algorithms.md). */
    int stream = last && a->blk >= RL_STREAM_OUT_MIN;
    char *dst = last && !stream ? out : slot;
    rl_reduce_kernel(dst, slot, own, l / esz, a->dt, a->op);
    if (last && a->op == RL_AVG) rl_scale_kernel(dst, l / esz, a->dt, 1.0 / a->P);
    if (stream) rl_copy_stream(out, slot, l);
    return RL_OK;
}
static int rs_send_ready(void *alg, rl_stream *s, int i) {
    ring_sg *a = alg;
    int t, k;
    (void)s;
    if (a->P == 2) return pair_in_step(a, i);
    rs_split(a, i, &t, &k);
    return t == 0 || a->recv->cur > i - 1; /* segment k of step t-1 arrived */
}
static void rs_send_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    ring_sg *a = alg;
    int t, k;
    (void)s;
    rs_split(a, i, &t, &k);
    if (t == 0)
        *p = (char *)a->in + (size_t)rl_mod(a->r - 1, a->P) * a->blk + (size_t)k * a->seg;
    else
        *p = rs_slot(a, t - 1);
    *l = seg_len(a, k);
}

int rl_reduce_scatter(rl_comm *c, void *out, const void *in, size_t count,
                      rl_dtype dt, rl_redop rop, int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || !rl_op_valid(dt, rop) || (count && (!out || !in)))
        return RL_ERR_INVALID;
    rl_opdesc op;
    size_t blk = count * rl_dtype_size(dt);
    int st = rl_begin_op(c, &op, RL_OP_REDUCE_SCATTER, dt, rop, -1, blk, timeout_ms);
    if (st != RL_OK) return st;
    if (c->size == 1 || count == 0) {
        if (out != in) rl_move(out, in, blk);
        op.algo = "local";
        return rl_end_op(c, &op, RL_OK);
    }
    if (c->shm) return rl_end_op(c, &op, rl_shm_reduce_scatter(c, &op, out, in, count, dt, rop));
    /* Recursive halving saves steps only for a power of two P >= 4 (2 ranks:
     * one exchange either way).  It sums only whole halves, so the pipelined
     * ring wins from about 16 x the all-reduce switch point (docs/algorithms.md). */
    int P = c->size;
    if (P >= 4 && (P & (P - 1)) == 0 &&
        (int64_t)(blk * (size_t)P) <= 16 * rl_tune.allreduce_small_bytes) {
        op.algo = "recursive_halving";
        return rl_end_op(c, &op, rh_reduce_scatter(c, &op, out, in, count, dt, rop));
    }
    op.algo = "ring";
    ring_sg a;
    memset(&a, 0, sizeof a);
    a.out = out;
    a.in = in;
    a.blk = blk;
    a.seg = ((size_t)rl_tune.segment_bytes / rl_dtype_size(dt)) * rl_dtype_size(dt);
    a.S = rl_nseg(blk, a.seg);
    a.P = c->size;
    a.r = c->rank;
    a.dt = dt;
    a.op = rop;
    if (a.seg > blk) a.seg = blk; /* one segment per block */
    size_t slots = ((size_t)(a.P > 2 ? 2 : 0) + 1) * a.seg;
    if ((st = rl_scratch(c, &op, slots, in, &a.scratch)) != RL_OK) return rl_end_op(c, &op, st);
    rl_stream s[2];
    memset(s, 0, sizeof s);
    s[0].peer = rl_mod(a.r + 1, a.P);
    s[0].is_send = 1;
    s[0].nseg = (a.P - 1) * a.S;
    s[0].ready = rs_send_ready;
    s[0].where = rs_send_where;
    s[1].peer = rl_mod(a.r - 1, a.P);
    s[1].nseg = (a.P - 1) * a.S;
    s[1].ready = rs_recv_ready;
    s[1].where = rs_recv_where;
    s[1].done = rs_recv_done;
    a.recv = &s[1];
    a.send = &s[0];
    st = rl_run_streams(c, &op, s, 2, &a);
    return rl_end_op(c, &op, st);
}
