/*
 * rooted.c - gather and scatter (and their v forms, uneven blocks), direct.
 *
 * The root talks to every other rank at once (one stream each, driven
 * concurrently by the engine); every other rank sends or receives one frame
 * of n elements.  The root moves (P-1) * n elements; a tree would not move
 * fewer bytes through the root's link, only hide latency for tiny
 * messages, which these ops rarely carry in training.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
    char *base;
    size_t blk;
    const size_t *counts, *displs; /* the v forms at the root: per peer, in elements */
    size_t esz;
} rooted;

static void rt_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    rooted *a = alg;
    (void)i;
    if (a->counts) {
        *p = a->base + a->displs[s->peer] * a->esz;
        *l = a->counts[s->peer] * a->esz;
        return;
    }
    *p = a->base + (size_t)s->peer * a->blk;
    *l = a->blk;
}
static void one_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    rooted *a = alg;
    (void)s; (void)i;
    *p = a->base;
    *l = a->blk;
}

/* Every other rank exchanges one frame with the root; the root drives one
 * stream per peer at once, its own block copied (cp) while they wait.  Each
 * header carries the pair's byte count. */
static int run_rooted(rl_comm *c, rl_opdesc *op, int gather, int root, rooted *a,
                      rl_idle_copy *cp) {
    if (c->rank != root) {
        rl_stream s;
        memset(&s, 0, sizeof s);
        s.peer = root;
        s.is_send = gather;
        s.nseg = 1;
        s.where = one_where;
        s.total = a->blk;
        return rl_run_streams(c, op, &s, 1, a);
    }
    rl_stream *s = calloc((size_t)(c->size - 1), sizeof *s);
    if (!s) return rl_fail(c, op, RL_ERR_NOMEM, -1, 0, "out of memory");
    int n = 0;
    for (int p = 0; p < c->size; p++) {
        if (p == root) continue;
        s[n].peer = p;
        s[n].is_send = !gather;
        s[n].nseg = 1;
        s[n].where = rt_where;
        s[n].total = a->counts ? a->counts[p] * a->esz : a->blk;
        n++;
    }
    int st = rl_run_streams_copy(c, op, s, n, a, cp);
    free(s);
    return st;
}

static int rooted_op(rl_comm *c, int opcode, void *many, void *one, size_t count,
                     rl_dtype dt, int root, int64_t timeout_ms) {
    rl_opdesc op;
    size_t blk = count * rl_dtype_size(dt);
    int st = rl_begin_op(c, &op, opcode, dt, 0, root, blk, timeout_ms);
    if (st != RL_OK) return st;
    rl_note_rooted(c, &op);
    int gather = opcode == RL_OP_GATHER;
    if (c->shm && c->size > 1 && count)
        return rl_end_op(c, &op, rl_shm_rooted(c, &op, gather, many, one, blk, root));
    rl_idle_copy cp = {NULL, NULL, 0, 0};
    if (c->rank == root) {
        char *mine = (char *)many + (size_t)root * blk;
        if (mine != (char *)one) {
            cp.dst = gather ? mine : (char *)one;
            cp.src = gather ? (const char *)one : mine;
            /* The root's own block is copied while its sockets wait, unless
             * `one` overlaps the buffer the streams use. */
            if (c->size == 1 || rl_overlap(one, blk, many, blk * (size_t)c->size))
                rl_move(cp.dst, cp.src, blk);
            else
                cp.len = blk;
        }
    }
    op.algo = c->size == 1 || count == 0 ? "local" : "direct";
    if (c->size == 1 || count == 0) return rl_end_op(c, &op, RL_OK);
    rooted a = {c->rank == root ? many : one, blk, NULL, NULL, 0};
    return rl_end_op(c, &op, run_rooted(c, &op, gather, root, &a, &cp));
}

/* gather_v / scatter_v: the root's blocks differ in size (counts[p] elements
 * at displs[p] of `many`), each other rank's is its own `count`.  Over a
 * group's segment, rl_shm_rooted_v.  Over TCP every pair exchanges one frame
 * whose header carries that pair's byte count, so a root and a rank that
 * disagree on it fail as a desync naming both sizes. */
static int rooted_v(rl_comm *c, int opcode, void *many, const size_t *counts,
                    const size_t *displs, void *one, size_t count, rl_dtype dt, int root,
                    int64_t timeout_ms) {
    rl_opdesc op;
    size_t esz = rl_dtype_size(dt);
    int st = rl_begin_op(c, &op, opcode, dt, 0, root, 0, timeout_ms);
    if (st != RL_OK) return st;
    int gather = opcode == RL_OP_GATHER, P = c->size, r = c->rank;
    rl_note_rooted(c, &op);
    if (c->shm && P > 1)
        return rl_end_op(c, &op, rl_shm_rooted_v(c, &op, gather, many, counts, displs, one,
                                                 count * esz, esz, root));
    op.algo = P == 1 ? "local" : "direct";
    if (r != root) {
        rooted a = {one, count * esz, NULL, NULL, esz};
        return rl_end_op(c, &op, run_rooted(c, &op, gather, root, &a, NULL));
    }
    rl_idle_copy cp = {NULL, NULL, 0, 0};
    char *mine = (char *)many + displs[r] * esz;
    size_t span = 0;
    for (int p = 0; p < P; p++)
        if ((displs[p] + counts[p]) * esz > span) span = (displs[p] + counts[p]) * esz;
    if (mine != (char *)one) {
        cp.dst = gather ? mine : (char *)one;
        cp.src = gather ? (const char *)one : mine;
        if (P == 1 || rl_overlap(one, count * esz, many, span))
            rl_move(cp.dst, cp.src, count * esz);
        else
            cp.len = count * esz;
    }
    if (P <= 1) return rl_end_op(c, &op, RL_OK);
    rooted a = {many, 0, counts, displs, esz};
    return rl_end_op(c, &op, run_rooted(c, &op, gather, root, &a, &cp));
}

int rl_gather_v(rl_comm *c, void *out, const size_t *counts, const size_t *displs,
                const void *in, size_t count, rl_dtype dt, int root, int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || root < 0 || root >= c->size || (count && !in))
        return RL_ERR_INVALID;
    if (c->rank == root && (!counts || !displs || counts[root] != count ||
                            (!out && count)))
        return RL_ERR_INVALID;
    return rooted_v(c, RL_OP_GATHER, out, counts, displs, (void *)in, count, dt, root,
                    timeout_ms);
}

int rl_scatter_v(rl_comm *c, void *out, size_t count, const void *in, const size_t *counts,
                 const size_t *displs, rl_dtype dt, int root, int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || root < 0 || root >= c->size || (count && !out))
        return RL_ERR_INVALID;
    if (c->rank == root && (!counts || !displs || counts[root] != count ||
                            (!in && count)))
        return RL_ERR_INVALID;
    return rooted_v(c, RL_OP_SCATTER, (void *)in, counts, displs, out, count, dt, root,
                    timeout_ms);
}

int rl_gather(rl_comm *c, void *out, const void *in, size_t count, rl_dtype dt,
              int root, int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || root < 0 || root >= c->size ||
        (count && (!in || (c->rank == root && !out))))
        return RL_ERR_INVALID;
    return rooted_op(c, RL_OP_GATHER, out, (void *)in, count, dt, root, timeout_ms);
}

int rl_scatter(rl_comm *c, void *out, const void *in, size_t count, rl_dtype dt,
               int root, int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || root < 0 || root >= c->size ||
        (count && (!out || (c->rank == root && !in))))
        return RL_ERR_INVALID;
    return rooted_op(c, RL_OP_SCATTER, (void *)in, out, count, dt, root, timeout_ms);
}
