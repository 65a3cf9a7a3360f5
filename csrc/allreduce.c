/*
 * allreduce.c - all_reduce: pipelined ring for large messages, recursive
 * doubling for small ones.
 *
 * Ring (P ranks, buffer cut into P near-equal chunks, rank r):
 *   step t = 0 .. 2P-3 sends chunk (r - t) mod P to the right neighbour and
 *   receives chunk (r - t - 1) mod P from the left one.  Steps 0..P-2 are the
 *   reduce-scatter: the received chunk is reduced into ours, and after them
 *   rank r holds the fully reduced chunk (r + 1) mod P.  Steps P-1..2P-3 are
 *   the all-gather: the received chunk overwrites ours.  The same index
 *   formula serves both halves, so the whole algorithm is one stream of
 *   frames in each direction.
 *   Each chunk travels as segments (rl_tune.segment_bytes).  Segment k of
 *   step t+1 is the segment k that step t received, so it may be sent as
 *   soon as that one segment has arrived and been reduced: transfer and
 *   reduction overlap, and no step waits for a whole chunk.  At 2 ranks, from
 *   4 segments a chunk, both streams run segment-major (segment 0 of both
 *   steps, then segment 1, ..), so a reduced segment goes out while it is
 *   still in cache; with fewer segments that order lost.  From 3 ranks they
 *   run step-major (every segment of step 0, then of step 1, ..): a
 *   segment-major row must travel 2(P-1) hops around the ring before the next
 *   row starts, which costs what the cache saves (figures: docs/algorithms.md).
 *   (Chunks differ by at most one element, so only the last segment row of
 *   the segment-major order can lack some steps.)
 *   Bytes sent per rank: 2 (P-1)/P * N; reduction work: (P-1)/P * N.
 *   Every chunk is reduced on exactly one rank and then copied around, so all
 *   ranks end with bit-identical results.
 *
 * Recursive doubling (latency-optimal, any P):
 *   Let Q be the largest power of two <= P and R = P - Q.  First the ranks
 *   r < 2R pair up: even r sends its buffer to r+1 and drops out.  The Q
 *   remaining ranks exchange whole buffers with partner (i xor 2^k) for
 *   k = 0 .. log2(Q)-1, always reducing lower-ranked data first so both
 *   partners compute the same bits.  Finally each odd r < 2R sends the
 *   result back to r-1.  Steps: log2(Q) (+2 when P is not a power of two);
 *   bytes sent per rank: N * log2(Q) (+N).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- ring --------------------------------------------------------------- */
/* The order of one stream.  Segment-major: row k holds segment k of every
 * step; rows below kmin are full, the last row has only the steps in
 * last[0..nlast).  Step-major: step t's segments start at index off[t]. */
typedef struct {
    int by_step;
    int kmin, nlast;
    int *last; /* steps present in the last row, in order */
    int *pos;  /* pos[t]: t's place in the last row, or -1 */
    int *off;  /* step-major: first index of each step, and the total */
} seg_order;

typedef struct {
    char *buf;
    size_t count, esz, seg_elems;
    rl_dtype dt;
    rl_redop op;
    int P, r;
    int nsteps;
    seg_order so, ro; /* send and receive stream orders */
    char *scratch;
    rl_stream *recv;
} ring_ar;

static int step_chunk(const ring_ar *a, int t, int sending) {
    return rl_mod(a->r - t - (sending ? 0 : 1), a->P);
}

static int chunk_nseg(const ring_ar *a, int chunk) {
    return rl_nseg(rl_block_count(a->count, a->P, chunk) * a->esz, a->seg_elems * a->esz);
}

/* Builds the order of one stream; returns its number of segments. */
static int order_init(const ring_ar *a, seg_order *o, int sending) {
    int T = a->nsteps, kmin = -1, kmax = 0;
    if (o->by_step) {
        o->off[0] = 0;
        for (int t = 0; t < T; t++)
            o->off[t + 1] = o->off[t] + chunk_nseg(a, step_chunk(a, t, sending));
        return o->off[T];
    }
    for (int t = 0; t < T; t++) {
        int n = chunk_nseg(a, step_chunk(a, t, sending));
        if (kmin < 0 || n < kmin) kmin = n;
        if (n > kmax) kmax = n;
    }
    o->kmin = kmin;
    o->nlast = 0;
    for (int t = 0; t < T; t++) {
        o->pos[t] = -1;
        if (kmax > kmin && chunk_nseg(a, step_chunk(a, t, sending)) == kmax) {
            o->pos[t] = o->nlast;
            o->last[o->nlast++] = t;
        }
    }
    return kmin * T + o->nlast;
}

static void order_split(const ring_ar *a, const seg_order *o, int i, int *t, int *k) {
    if (o->by_step) {
        int lo = 0, hi = a->nsteps - 1;
        while (lo < hi) { /* last step whose first index <= i */
            int mid = (lo + hi + 1) / 2;
            if (o->off[mid] <= i) lo = mid; else hi = mid - 1;
        }
        *t = lo;
        *k = i - o->off[lo];
        return;
    }
    int full = o->kmin * a->nsteps;
    if (i < full) {
        *k = i / a->nsteps;
        *t = i % a->nsteps;
    } else {
        *k = o->kmin;
        *t = o->last[i - full];
    }
}

static int order_index(const ring_ar *a, const seg_order *o, int t, int k) {
    if (o->by_step) return o->off[t] + k;
    return k < o->kmin ? k * a->nsteps + t : o->kmin * a->nsteps + o->pos[t];
}

static void seg_span(const ring_ar *a, int chunk, int k, size_t *start, size_t *n) {
    size_t cs = rl_block_start(a->count, a->P, chunk), cn = rl_block_count(a->count, a->P, chunk);
    size_t s = (size_t)k * a->seg_elems;
    *start = cs + s;
    *n = s >= cn ? 0 : (cn - s < a->seg_elems ? cn - s : a->seg_elems);
}

static int ar_send_ready(void *alg, rl_stream *s, int i) {
    ring_ar *a = alg;
    int t, k;
    (void)s;
    order_split(a, &a->so, i, &t, &k);
    if (t == 0) return 1;
    /* Segment k of step t is what step t-1 received as its segment k. */
    return a->recv->cur > order_index(a, &a->ro, t - 1, k);
}

static void ar_send_where(void *alg, rl_stream *s, int i, char **ptr, size_t *len) {
    ring_ar *a = alg;
    int t, k;
    size_t st, n;
    (void)s;
    order_split(a, &a->so, i, &t, &k);
    seg_span(a, step_chunk(a, t, 1), k, &st, &n);
    *ptr = a->buf + st * a->esz;
    *len = n * a->esz;
}

static void ar_recv_where(void *alg, rl_stream *s, int i, char **ptr, size_t *len) {
    ring_ar *a = alg;
    int t, k;
    size_t st, n;
    (void)s;
    order_split(a, &a->ro, i, &t, &k);
    seg_span(a, step_chunk(a, t, 0), k, &st, &n);
    /* Reduce-scatter steps land in scratch and are reduced in done();
     * all-gather steps land directly in the user's buffer. */
    *ptr = t < a->P - 1 ? a->scratch : a->buf + st * a->esz;
    *len = n * a->esz;
}

static int ar_recv_done(void *alg, rl_stream *s, int i) {
    ring_ar *a = alg;
    int t, k;
    size_t st, n;
    (void)s;
    order_split(a, &a->ro, i, &t, &k);
    if (t >= a->P - 1) return RL_OK;
    seg_span(a, step_chunk(a, t, 0), k, &st, &n);
    char *dst = a->buf + st * a->esz;
    rl_reduce_kernel(dst, dst, a->scratch, n, a->dt, a->op);
    /* The last reduce-scatter step completes this rank's chunk: finish AVG
     * here, once, before the all-gather copies it everywhere. */
    if (t == a->P - 2 && a->op == RL_AVG)
        rl_scale_kernel(dst, n, a->dt, 1.0 / a->P);
    return RL_OK;
}

static int ring_all_reduce(rl_comm *c, const rl_opdesc *op, void *buf, size_t count,
                           rl_dtype dt, rl_redop rop) {
    ring_ar a;
    memset(&a, 0, sizeof a);
    a.buf = buf;
    a.count = count;
    a.esz = rl_dtype_size(dt);
    a.dt = dt;
    a.op = rop;
    a.P = c->size;
    a.r = c->rank;
    a.seg_elems = (size_t)rl_tune.segment_bytes / a.esz;
    if (a.seg_elems == 0) a.seg_elems = 1;
    a.nsteps = 2 * (a.P - 1);
    /* Segment-major at 2 ranks once a chunk has 4 segments or more,
     * step-major otherwise (see the top of the file). */
    a.so.by_step = a.ro.by_step = a.P > 2 || chunk_nseg(&a, 0) < 4;
    size_t per = 3 * (size_t)a.nsteps + 1;
    int tabs_small[256];
    int *tabs = 2 * per <= 256 ? tabs_small : malloc(sizeof(int) * 2 * per);
    if (!tabs) return rl_fail(c, op, RL_ERR_NOMEM, -1, 0, "out of memory");
    a.so.last = tabs;
    a.so.pos = tabs + a.nsteps;
    a.so.off = tabs + 2 * a.nsteps;
    a.ro.last = tabs + per;
    a.ro.pos = tabs + per + a.nsteps;
    a.ro.off = tabs + per + 2 * a.nsteps;
    int nsend = order_init(&a, &a.so, 1), nrecv = order_init(&a, &a.ro, 0);
    int st = rl_scratch(c, op, a.seg_elems * a.esz, buf, &a.scratch);
    if (st == RL_OK) {
        rl_stream s[2];
        memset(s, 0, sizeof s);
        s[0].peer = rl_mod(a.r + 1, a.P);
        s[0].is_send = 1;
        s[0].nseg = nsend;
        s[0].ready = ar_send_ready;
        s[0].where = ar_send_where;
        s[1].peer = rl_mod(a.r - 1, a.P);
        s[1].nseg = nrecv;
        s[1].where = ar_recv_where;
        s[1].done = ar_recv_done;
        a.recv = &s[1];
        st = rl_run_streams(c, op, s, 2, &a);
    }
    if (tabs != tabs_small) free(tabs);
    return st;
}

/* ---- recursive doubling ------------------------------------------------- */
typedef struct {
    char *send_ptr, *recv_ptr;
    size_t len;
} xchg;

static void x_send_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    (void)s; (void)i;
    *p = ((xchg *)alg)->send_ptr;
    *l = ((xchg *)alg)->len;
}
static void x_recv_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    (void)s; (void)i;
    *p = ((xchg *)alg)->recv_ptr;
    *l = ((xchg *)alg)->len;
}

/* One frame to `to` and/or one frame from `from` (-1: none), concurrently. */
int rl_exchange(rl_comm *c, const rl_opdesc *op, int to, const void *sbuf,
                int from, void *rbuf, size_t len, uint32_t tag) {
    xchg x = {(char *)sbuf, (char *)rbuf, len};
    rl_stream s[2];
    int n = 0;
    memset(s, 0, sizeof s);
    if (to >= 0) {
        s[n].peer = to;
        s[n].is_send = 1;
        s[n].nseg = 1;
        s[n].tag_base = tag;
        s[n].where = x_send_where;
        n++;
    }
    if (from >= 0) {
        s[n].peer = from;
        s[n].nseg = 1;
        s[n].tag_base = tag;
        s[n].where = x_recv_where;
        n++;
    }
    return n ? rl_run_streams(c, op, s, n, &x) : RL_OK;
}

int rl_rd_all_reduce(rl_comm *c, const rl_opdesc *op, void *buf, size_t count,
                     rl_dtype dt, rl_redop rop) {
    int P = c->size, r = c->rank;
    size_t len = count * rl_dtype_size(dt);
    char *tmp;
    int st = rl_scratch(c, op, len, buf, &tmp);
    if (st != RL_OK) return st;
    int Q = 1;
    while (Q * 2 <= P) Q *= 2;
    int R = P - Q;
    int newrank;
    uint32_t tag = 0;
    if (r < 2 * R) {
        if (r % 2 == 0) {
            if ((st = rl_exchange(c, op, r + 1, buf, -1, NULL, len, tag)) != RL_OK) return st;
            newrank = -1;
        } else {
            if ((st = rl_exchange(c, op, -1, NULL, r - 1, tmp, len, tag)) != RL_OK) return st;
            rl_reduce_kernel(buf, tmp, buf, count, dt, rop); /* lower rank first */
            newrank = r / 2;
        }
    } else {
        newrank = r - R;
    }
    tag++;
    if (newrank >= 0) {
        for (int mask = 1; mask < Q; mask <<= 1, tag++) {
            int pn = newrank ^ mask;
            int partner = pn < R ? pn * 2 + 1 : pn + R;
            if ((st = rl_exchange(c, op, partner, buf, partner, tmp, len, tag)) != RL_OK)
                return st;
            if (pn < newrank)
                rl_reduce_kernel(buf, tmp, buf, count, dt, rop);
            else
                rl_reduce_kernel(buf, buf, tmp, count, dt, rop);
        }
    } else {
        /* keep tags aligned with the ranks that stayed in */
        for (int mask = 1; mask < Q; mask <<= 1) tag++;
    }
    if (rop == RL_AVG && newrank >= 0) rl_scale_kernel(buf, count, dt, 1.0 / P);
    if (r < 2 * R) {
        if (r % 2 == 1)
            st = rl_exchange(c, op, r - 1, buf, -1, NULL, len, tag);
        else
            st = rl_exchange(c, op, -1, NULL, r + 1, buf, len, tag);
    }
    return st;
}

int rl_all_reduce(rl_comm *c, void *buf, size_t count, rl_dtype dt, rl_redop rop,
                  int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || !rl_op_valid(dt, rop) || (!buf && count))
        return RL_ERR_INVALID;
    rl_opdesc op;
    size_t bytes = count * rl_dtype_size(dt);
    int st = rl_begin_op(c, &op, RL_OP_ALL_REDUCE, dt, rop, -1, bytes, timeout_ms);
    if (st != RL_OK) return st;
    if (c->size == 1 || count == 0) {
        /* A world of one: the sum of one buffer is itself (AVG divides by 1). */
        op.algo = "local";
        return rl_end_op(c, &op, RL_OK);
    }
    if (c->shm) return rl_end_op(c, &op, rl_shm_all_reduce(c, &op, buf, count, dt, rop, -1));
    if ((int64_t)bytes <= rl_tune.allreduce_small_bytes || count < (size_t)c->size) {
        op.algo = "recursive_doubling";
        st = rl_rd_all_reduce(c, &op, buf, count, dt, rop);
    } else {
        op.algo = "ring";
        st = ring_all_reduce(c, &op, buf, count, dt, rop);
    }
    return rl_end_op(c, &op, st);
}
