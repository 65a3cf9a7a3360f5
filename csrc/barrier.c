/*
 * barrier.c - flat barrier up to 4 ranks, dissemination barrier above.
 *
 * Flat (3 or 4 ranks): every other rank sends rank 0 an empty frame (tag 0)
 * and waits for its release (tag 1); rank 0 waits for all of them, then
 * releases all.  2(P-1) frames and two hops.  With more ranks than cores
 * every frame costs CPU a waiting peer needs, and up to 4 ranks that outweighs
 * the extra hop (figures: docs/algorithms.md, "barrier").  At 2 ranks
 * dissemination is one exchange, one hop.
 *
 * Dissemination: round k = 0 .. ceil(log2 P)-1: send an empty frame to
 * (r + 2^k) mod P and wait for one from (r - 2^k) mod P.  After round k every
 * rank has heard, directly or transitively, from 2^(k+1) ranks, so after the
 * last round no rank leaves before all have arrived.  P ceil(log2 P) frames.
 * Frames are 48-byte headers.
 */
#include <string.h>

#include "internal.h"

#define RL_BARRIER_FLAT_MAX 4

static void empty_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    (void)alg; (void)s; (void)i;
    *p = NULL;
    *l = 0;
}

static int flat_barrier(rl_comm *c, const rl_opdesc *op) {
    rl_stream s[RL_BARRIER_FLAT_MAX];
    int n = c->rank ? 1 : c->size - 1, st;
    memset(s, 0, sizeof s);
    for (int k = 0; k < n; k++) {
        s[k].peer = c->rank ? 0 : k + 1;
        s[k].is_send = c->rank != 0; /* arrivals go to rank 0 ... */
        s[k].nseg = 1;
        s[k].where = empty_where;
    }
    if ((st = rl_run_streams(c, op, s, n, NULL)) != RL_OK) return st;
    for (int k = 0; k < n; k++) {
        s[k].is_send = !s[k].is_send; /* ... and releases come back */
        s[k].tag_base = 1;
    }
    return rl_run_streams(c, op, s, n, NULL);
}

int rl_barrier(rl_comm *c, int64_t timeout_ms) {
    rl_opdesc op;
    int st = rl_begin_op(c, &op, RL_OP_BARRIER, 0, 0, -1, 0, timeout_ms);
    if (st != RL_OK) return st;
    int P = c->size, r = c->rank;
    if (c->shm && P > 1) return rl_end_op(c, &op, rl_shm_barrier(c, &op));
    if (P > 2 && P <= RL_BARRIER_FLAT_MAX) {
        op.algo = "flat";
        return rl_end_op(c, &op, flat_barrier(c, &op));
    }
    op.algo = "dissemination";
    uint32_t tag = 0;
    for (int d = 1; d < P && st == RL_OK; d <<= 1, tag++)
        st = rl_exchange(c, &op, rl_mod(r + d, P), NULL, rl_mod(r - d, P), NULL, 0, tag);
    return rl_end_op(c, &op, st);
}
