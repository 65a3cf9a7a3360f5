/*
 * bcast.c - broadcast: binomial tree for small messages, pipelined chain for
 * large ones.  Any root.
 *
 * Ranks are renumbered relative to the root, v = (r - root) mod P.
 *
 * Binomial tree: v receives the whole buffer from v - 2^j, where 2^j is v's
 * highest set bit, then sends it to v + 2^i for every 2^i above that bit
 * (largest subtree first).  ceil(log2 P) steps; a rank sends N bytes to
 * each of its children (the root to ceil(log2 P) of them).  Up to
 * RL_BCAST_FLAT_MAX ranks the root sends to every rank itself instead: at 4
 * ranks that is one more send at the root in place of a second hop, and a
 * hop costs a scheduling delay when ranks outnumber cores (figures:
 * docs/algorithms.md, "broadcast").  With 3 ranks both shapes are the same.
 * Across hosts, beyond bcast_flat_bytes, the extra copies over the root's
 * host link cost more than the hop, and the binomial tree runs.
 *
 * Chain: v receives segments from v-1 and forwards each one to v+1 as soon
 * as it has arrived, so after a fill time of (P-1) segments every link
 * carries data at once.  Each rank sends N bytes once: time ~ N / link
 * bandwidth + (P-1) * segment time, independent of P for large N.
 * With P = 2 nobody forwards, so the root sends the buffer as one frame:
 * segments would only add headers and engine rounds.
 */
#include <string.h>

#include "internal.h"

typedef struct {
    char *buf;
    size_t len, seg;
    rl_stream *recv;
} chain_bc;

static void seg_where(const chain_bc *a, int i, char **p, size_t *l) {
    size_t off = (size_t)i * a->seg;
    *p = a->buf + off;
    *l = off >= a->len ? 0 : (a->len - off < a->seg ? a->len - off : a->seg);
}
static void cb_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    (void)s;
    seg_where(alg, i, p, l);
}
static int cb_send_ready(void *alg, rl_stream *s, int i) {
    chain_bc *a = alg;
    (void)s;
    return a->recv == NULL || a->recv->cur > i;
}

static void whole_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    chain_bc *a = alg;
    (void)s; (void)i;
    *p = a->buf;
    *l = a->len;
}

#define RL_BCAST_FLAT_MAX 4

/* Whether the comm's ranks advertised more than one host address (the same
 * endpoint table on every rank, so every rank answers alike). */
static int spans_hosts(const rl_comm *c) {
    const char *first = rl_peer_host(c, 0, NULL);
    for (int q = 1; q < c->size; q++)
        if (strcmp(rl_peer_host(c, q, NULL), first) != 0) return 1;
    return 0;
}

static int tree_bcast(rl_comm *c, const rl_opdesc *op, char *buf, size_t len, int root) {
    int P = c->size, v = rl_mod(c->rank - root, P);
    chain_bc a = {buf, len, len, NULL};
    rl_stream s[40];
    int n = 0, mask = 1;
    memset(s, 0, sizeof s);
    if (P <= RL_BCAST_FLAT_MAX &&
        ((int64_t)len <= rl_tune.bcast_flat_bytes || !spans_hosts(c))) {
        if (v) {
            s[0].peer = root;
            s[0].nseg = 1;
            s[0].where = whole_where;
            return rl_run_streams(c, op, s, 1, &a);
        }
        for (int k = 1; k < P; k++, n++) {
            s[n].peer = rl_mod(root + k, P);
            s[n].is_send = 1;
            s[n].nseg = 1;
            s[n].where = whole_where;
        }
        return rl_run_streams(c, op, s, n, &a);
    }
    while (mask < P) {
        if (v & mask) {
            s[0].peer = rl_mod(v - mask + root, P);
            s[0].nseg = 1;
            s[0].where = whole_where;
            int st = rl_run_streams(c, op, s, 1, &a);
            if (st != RL_OK) return st;
            break;
        }
        mask <<= 1;
    }
    memset(s, 0, sizeof s);
    for (mask >>= 1; mask > 0; mask >>= 1) {
        if (v + mask < P) {
            s[n].peer = rl_mod(v + mask + root, P);
            s[n].is_send = 1;
            s[n].nseg = 1;
            s[n].where = whole_where;
            n++;
        }
    }
    return n ? rl_run_streams(c, op, s, n, &a) : RL_OK;
}

static int chain_bcast(rl_comm *c, const rl_opdesc *op, char *buf, size_t len, int root) {
    int P = c->size, v = rl_mod(c->rank - root, P);
    chain_bc a = {buf, len, P == 2 ? len : (size_t)rl_tune.segment_bytes, NULL};
    int nseg = rl_nseg(len, a.seg);
    rl_stream s[2];
    int n = 0;
    memset(s, 0, sizeof s);
    if (v > 0) {
        s[n].peer = rl_mod(v - 1 + root, P);
        s[n].nseg = nseg;
        s[n].where = cb_where;
        /* From the root, which only sends, to a rank that only receives:
         * P = 2.  A forwarding sender needs its successor to drain at once. */
        s[n].bulk = v == 1 && P == 2;
        a.recv = &s[n];
        n++;
    }
    if (v < P - 1) {
        s[n].peer = rl_mod(v + 1 + root, P);
        s[n].is_send = 1;
        s[n].nseg = nseg;
        s[n].ready = cb_send_ready;
        s[n].where = cb_where;
        n++;
    }
    return rl_run_streams(c, op, s, n, &a);
}

int rl_broadcast(rl_comm *c, void *buf, size_t count, rl_dtype dt, int root,
                 int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || root < 0 || root >= c->size || (!buf && count))
        return RL_ERR_INVALID;
    rl_opdesc op;
    size_t len = count * rl_dtype_size(dt);
    int st = rl_begin_op(c, &op, RL_OP_BROADCAST, dt, 0, root, len, timeout_ms);
    if (st != RL_OK) return st;
    rl_note_rooted(c, &op);
    if (c->size == 1 || count == 0) {
        op.algo = "local";
        return rl_end_op(c, &op, RL_OK);
    }
    if (c->shm) return rl_end_op(c, &op, rl_shm_broadcast(c, &op, buf, len, root));
    if ((int64_t)len <= rl_tune.bcast_small_bytes) {
        op.algo = "binomial_tree";
        st = tree_bcast(c, &op, buf, len, root);
    } else {
        op.algo = "chain";
        st = chain_bcast(c, &op, buf, len, root);
    }
    return rl_end_op(c, &op, st);
}
