/*
 * alltoall.c - all_to_all with per-peer counts, pairwise exchange.
 *
 * Step s = 1 .. P-1: rank r sends its block for (r + s) mod P and receives
 * the block from (r - s) mod P, both at once.  Every rank sends and receives
 * exactly once per step, so no link is oversubscribed and no rank waits for
 * a busy one.  Each frame is checked against the count the receiver
 * expects, so mismatched count tables fail as a desync naming both sizes.
 */
#include <string.h>

#include "internal.h"

typedef struct {
    char *sp, *rp;
    size_t sl, rl;
} pairx;

static void px_send(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    (void)s; (void)i;
    *p = ((pairx *)alg)->sp;
    *l = ((pairx *)alg)->sl;
}
static void px_recv(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    (void)s; (void)i;
    *p = ((pairx *)alg)->rp;
    *l = ((pairx *)alg)->rl;
}

int rl_all_to_all_v(rl_comm *c, void *out, const size_t *out_counts,
                    const size_t *out_displs, const void *in,
                    const size_t *in_counts, const size_t *in_displs, rl_dtype dt,
                    int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || !out_counts || !out_displs || !in_counts ||
        !in_displs || in_counts[c->rank] != out_counts[c->rank])
        return RL_ERR_INVALID;
    rl_opdesc op;
    size_t esz = rl_dtype_size(dt);
    /* total = 0: block sizes legitimately differ between pairs; each frame's
     * size is checked against this rank's expectation instead. */
    int st = rl_begin_op(c, &op, RL_OP_ALL_TO_ALL, dt, 0, -1, 0, timeout_ms);
    if (st != RL_OK) return st;
    int P = c->size, r = c->rank;
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
        memmove(cp.dst, cp.src, cp.len);
        cp.len = 0;
    }
    for (int step = 1; step < P && st == RL_OK; step++) {
        int to = rl_mod(r + step, P), from = rl_mod(r - step, P);
        pairx x = {(char *)in + in_displs[to] * esz, (char *)out + out_displs[from] * esz,
                   in_counts[to] * esz, out_counts[from] * esz};
        rl_stream s[2];
        memset(s, 0, sizeof s);
        s[0].peer = to;
        s[0].is_send = 1;
        s[0].nseg = 1;
        s[0].tag_base = (uint32_t)step;
        s[0].where = px_send;
        s[1].peer = from;
        s[1].nseg = 1;
        s[1].tag_base = (uint32_t)step;
        s[1].where = px_recv;
        st = rl_run_streams_copy(c, &op, s, 2, &x, step == 1 ? &cp : NULL);
    }
    return rl_end_op(c, st);
}
