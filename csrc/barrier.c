/*
 * barrier.c - dissemination barrier.
 *
 * Round k = 0 .. ceil(log2 P)-1: send an empty frame to (r + 2^k) mod P and
 * wait for one from (r - 2^k) mod P.  After round k every rank has heard,
 * directly or transitively, from 2^(k+1) ranks, so after the last round no
 * rank leaves before all have arrived.  Works for any P; 48-byte frames.
 */
#include <string.h>

#include "internal.h"

int rl_barrier(rl_comm *c, int64_t timeout_ms) {
    rl_opdesc op;
    int st = rl_begin_op(c, &op, RL_OP_BARRIER, 0, 0, -1, 0, timeout_ms);
    if (st != RL_OK) return st;
    int P = c->size, r = c->rank;
    uint32_t tag = 0;
    for (int d = 1; d < P && st == RL_OK; d <<= 1, tag++)
        st = rl_exchange(c, &op, rl_mod(r + d, P), NULL, rl_mod(r - d, P), NULL, 0, tag);
    return rl_end_op(c, st);
}
