/*
 * alltoall.c - all_to_all: pairwise exchange (any counts), Bruck (small equal
 * blocks); all_gather_v, the pairwise exchange of one block to every peer.
 * Over a comm's shared-memory segment both go to shm.c instead.
 *
 * Step s = 1 .. P-1: rank r sends its block for (r + s) mod P and receives
 * the block from (r - s) mod P, both at once.  Every rank sends and receives
 * exactly once per step, so no link is oversubscribed and no rank waits for
 * a busy one.  Each stream's headers carry the pair's own byte count, so
 * mismatched count tables fail at the first frame as a desync naming both
 * sizes.
 *
 * When the block goes to the rank it comes from (every step at 2 ranks, step
 * P/2 for even P), one connection carries both directions.  Then both blocks
 * travel as segments and the directions are kept in step (segment i is sent
 * once segment i-1 has arrived), as ring.c does for its 2-rank exchanges:
 * letting both run freely was slower (docs/algorithms.md).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
    char *sp, *rp;
    size_t sl, rl;
    size_t seg;      /* bytes per frame */
    rl_stream *recv;
} pairx;

static size_t px_len(size_t n, size_t seg, int i) {
    size_t off = (size_t)i * seg;
    return off >= n ? 0 : (n - off < seg ? n - off : seg);
}
static void px_send(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    pairx *x = alg;
    (void)s;
    *p = x->sp + (size_t)i * x->seg;
    *l = px_len(x->sl, x->seg, i);
}
static void px_recv(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    pairx *x = alg;
    (void)s;
    *p = x->rp + (size_t)i * x->seg;
    *l = px_len(x->rl, x->seg, i);
}
/* Segment i goes out once segment i-1 has come in, or once the (shorter)
 * incoming block is complete. */
static int px_send_ready(void *alg, rl_stream *s, int i) {
    const rl_stream *r = ((pairx *)alg)->recv;
    (void)s;
    return i == 0 || r->cur > i - 1 || r->cur >= r->nseg;
}

static int pairwise_v(rl_comm *c, int opcode, void *out, const size_t *out_counts,
                      const size_t *out_displs, const void *in, const size_t *in_counts,
                      const size_t *in_displs, rl_dtype dt, int64_t timeout_ms) {
    rl_opdesc op;
    size_t esz = rl_dtype_size(dt);
    /* total = 0: block sizes legitimately differ between pairs; each frame's
     * size is checked against this rank's expectation instead. */
    int st = rl_begin_op(c, &op, opcode, dt, 0, -1, 0, timeout_ms);
    if (st != RL_OK) return st;
    int P = c->size, r = c->rank;
    op.algo = P == 1 ? "local" : "pairwise";
    size_t in_span = 0, out_span = 0;
    for (int p = 0; p < P; p++) {
        if ((in_displs[p] + in_counts[p]) * esz > in_span) in_span = (in_displs[p] + in_counts[p]) * esz;
        if ((out_displs[p] + out_counts[p]) * esz > out_span) out_span = (out_displs[p] + out_counts[p]) * esz;
    }
    /* The own block is copied while step 1's sockets wait, unless input and
     * output overlap (then it must happen before any receive). */
    rl_idle_copy cp = {(char *)out + out_displs[r] * esz, (const char *)in + in_displs[r] * esz,
                       in_counts[r] * esz, 0};
    if (P == 1 || rl_overlap(in, in_span, out, out_span)) {
        rl_move(cp.dst, cp.src, cp.len);
        cp.len = 0;
    }
    for (int step = 1; step < P && st == RL_OK; step++) {
        int to = rl_mod(r + step, P), from = rl_mod(r - step, P);
        pairx x = {(char *)in + in_displs[to] * esz, (char *)out + out_displs[from] * esz,
                   in_counts[to] * esz, out_counts[from] * esz, 0, NULL};
        rl_stream s[2];
        memset(s, 0, sizeof s);
        /* One frame each way unless the pair shares the connection. */
        x.seg = to == from ? (size_t)rl_tune.segment_bytes : (x.sl > x.rl ? x.sl : x.rl);
        if (x.seg == 0) x.seg = 1;
        s[0].peer = to;
        s[0].is_send = 1;
        s[0].nseg = rl_nseg(x.sl, x.seg);
        s[0].tag_base = (uint32_t)step;
        s[0].where = px_send;
        s[0].total = x.sl;
        if (to == from) s[0].ready = px_send_ready;
        s[1].peer = from;
        s[1].nseg = rl_nseg(x.rl, x.seg);
        s[1].tag_base = (uint32_t)step;
        s[1].where = px_recv;
        s[1].total = x.rl;
        x.recv = &s[1];
        st = rl_run_streams_copy(c, &op, s, 2, &x, step == 1 ? &cp : NULL);
    }
    return rl_end_op(c, &op, st);
}

int rl_all_to_all_v(rl_comm *c, void *out, const size_t *out_counts,
                    const size_t *out_displs, const void *in,
                    const size_t *in_counts, const size_t *in_displs, rl_dtype dt,
                    int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || !out_counts || !out_displs || !in_counts ||
        !in_displs || in_counts[c->rank] != out_counts[c->rank])
        return RL_ERR_INVALID;
    int P = c->size;
    if (c->shm && P > 1) {
        size_t esz = rl_dtype_size(dt), in_span = 0, out_span = 0;
        for (int q = 0; q < P; q++) {
            if ((in_displs[q] + in_counts[q]) * esz > in_span) in_span = (in_displs[q] + in_counts[q]) * esz;
            if ((out_displs[q] + out_counts[q]) * esz > out_span)
                out_span = (out_displs[q] + out_counts[q]) * esz;
        }
        /* Peers read the input while this rank writes its output. */
        if (!rl_overlap(in, in_span, out, out_span)) {
            rl_opdesc op;
            int st = rl_begin_op(c, &op, RL_OP_ALL_TO_ALL, dt, 0, -1, 0, timeout_ms);
            if (st != RL_OK) return st;
            return rl_end_op(c, &op, rl_shm_all_to_all_v(c, &op, out, out_counts, out_displs, in,
                                                         in_counts, in_displs, dt));
        }
    }
    return pairwise_v(c, RL_OP_ALL_TO_ALL, out, out_counts, out_displs, in, in_counts,
                      in_displs, dt, timeout_ms);
}

/* Over a group's segment, staged through its slots (rl_shm_all_gather_v);
 * otherwise the pairwise exchange with every peer's block read from the one
 * input: each rank sends its counts[rank] elements to every peer. */
int rl_all_gather_v(rl_comm *c, void *out, const size_t *counts, const size_t *displs,
                    const void *in, rl_dtype dt, int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || !counts || !displs) return RL_ERR_INVALID;
    int P = c->size;
    if (c->shm && P > 1) {
        /* The op's total, every count, is in each rank's descriptor: ranks
         * whose count tables differ in sum fail at once as a desync. */
        size_t total = 0;
        for (int q = 0; q < P; q++) total += counts[q];
        rl_opdesc op;
        int st = rl_begin_op(c, &op, RL_OP_ALL_GATHER, dt, 0, -1, total * rl_dtype_size(dt),
                             timeout_ms);
        if (st != RL_OK) return st;
        return rl_end_op(c, &op, rl_shm_all_gather_v(c, &op, out, counts, displs, in, dt));
    }
    size_t *t = calloc(2 * (size_t)P, sizeof *t);
    if (!t) return RL_ERR_NOMEM;
    for (int i = 0; i < P; i++) t[i] = counts[c->rank]; /* displacements: all 0 */
    int st = pairwise_v(c, RL_OP_ALL_GATHER, out, counts, displs, in, t, t + P, dt, timeout_ms);
    free(t);
    return st;
}

/* Bruck's algorithm for P equal blocks of blk bytes: ceil(log2 P) exchanges
 * instead of P-1.  After rotating so that position i holds the block for rank
 * (r + i) mod P, the step with distance d sends every position with bit d set
 * to r + d and receives the same positions from r - d; position i then holds
 * the block that rank (r - i) mod P sent to this rank.  Each block travels
 * once per set bit of its distance, so the bytes sent grow to about
 * (P/2) log2 P blocks: worth it for small blocks only. */
static int bruck_all_to_all(rl_comm *c, const rl_opdesc *op, char *out, const char *in,
                            size_t blk) {
    int P = c->size, r = c->rank;
    char *a;
    int st = rl_scratch(c, op, 2 * (size_t)P * blk, in, &a);
    if (st != RL_OK) return st;
    char *pack = a + (size_t)P * blk, *unpack = out; /* out is free until the end */
    for (int i = 0; i < P; i++)
        rl_copy(a + (size_t)i * blk, in + (size_t)rl_mod(r + i, P) * blk, blk);
    uint32_t tag = 0;
    for (int d = 1; d < P; d <<= 1, tag++) {
        size_t n = 0;
        for (int i = d; i < P; i++)
            if (i & d) rl_copy(pack + blk * n++, a + (size_t)i * blk, blk);
        st = rl_exchange(c, op, rl_mod(r + d, P), pack, rl_mod(r - d, P), unpack, n * blk, tag);
        if (st != RL_OK) return st;
        n = 0;
        for (int i = d; i < P; i++)
            if (i & d) rl_copy(a + (size_t)i * blk, unpack + blk * n++, blk);
    }
    for (int i = 0; i < P; i++)
        rl_copy(out + (size_t)rl_mod(r - i, P) * blk, a + (size_t)i * blk, blk);
    return RL_OK;
}

int rl_all_to_all(rl_comm *c, void *out, const void *in, size_t count, rl_dtype dt,
                  int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || (count && (!out || !in))) return RL_ERR_INVALID;
    int P = c->size;
    size_t blk = count * rl_dtype_size(dt);
    if (c->shm && P > 1 && count) {
        rl_opdesc op;
        int st = rl_begin_op(c, &op, RL_OP_ALL_TO_ALL, dt, 0, -1, blk, timeout_ms);
        if (st != RL_OK) return st;
        return rl_end_op(c, &op, rl_shm_all_to_all(c, &op, out, in, blk));
    }
    /* Two ranks: one pairwise step either way.  Larger blocks: every block
     * sent once beats fewer, fuller messages. */
    if (P > 2 && count && (int64_t)(blk * (size_t)P) <= rl_tune.allreduce_small_bytes) {
        rl_opdesc op;
        int st = rl_begin_op(c, &op, RL_OP_ALL_TO_ALL, dt, 0, -1, blk, timeout_ms);
        if (st != RL_OK) return st;
        op.algo = "bruck";
        return rl_end_op(c, &op, bruck_all_to_all(c, &op, out, in, blk));
    }
    size_t *t = malloc(sizeof(size_t) * 2 * (size_t)P);
    if (!t) return RL_ERR_NOMEM;
    for (int i = 0; i < P; i++) {
        t[i] = count;
        t[P + i] = (size_t)i * count;
    }
    int st = rl_all_to_all_v(c, out, t, t + P, in, t, t + P, dt, timeout_ms);
    free(t);
    return st;
}
