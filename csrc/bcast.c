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
 * Across hosts (rl_comm_set_hosts) the tree follows the hosts (hosts_tree);
 * the flat shape stops at bcast_flat_bytes there, beyond which its extra
 * copies over the root's host link cost more than a hop.
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

/* The children of index v in a binomial tree of n indices rooted at 0 (the
 * powers of two below v's lowest set bit; the root's: every one below n),
 * largest subtree first; returns how many, and *parent (-1 for the root). */
static int binomial(int v, int n, int *parent, int *kids) {
    int low = 1;
    while (low < n && !(v & low)) low <<= 1;
    *parent = v ? v - low : -1;
    int k = 0;
    for (int mask = low >> 1; mask > 0; mask >>= 1)
        if (v + mask < n) kids[k++] = v + mask;
    return k;
}

/* The rank of host h that receives from other hosts: the root on its own
 * host, else the lowest comm rank there. */
static int host_leader(const rl_comm *c, int h, int root) {
    return c->host_of[root] == h ? root : c->host_rank[c->host_off[h]];
}

/* Host h's i-th rank counted from its leader (index 0), wrapping. */
static int host_member(const rl_comm *c, int h, int root, int i) {
    int L = c->host_off[h + 1] - c->host_off[h];
    int from = c->local_idx[host_leader(c, h, root)];
    return c->host_rank[c->host_off[h] + (from + i) % L];
}

/* Across hosts (rl_comm_set_hosts): the root sends to each other host's
 * leader (to every one itself up to RL_BCAST_FLAT_MAX hosts and
 * bcast_flat_bytes, else by a binomial tree over the hosts numbered from the
 * root's), and each leader to the rest of its host (every one itself up to
 * RL_BCAST_FLAT_MAX ranks there, else a binomial tree).  One copy over each
 * host's link, and a small message crosses between hosts once on its way to
 * any rank.  Returns the number of children in kids; *parent is -1 at the
 * root. */
static int hosts_tree(const rl_comm *c, size_t len, int root, int *parent, int *kids) {
    int H = c->nhosts, me = c->rank, h = c->host_of[me], hr = c->host_of[root];
    int n = 0, p, idx[32];
    *parent = -1;
    if (me == host_leader(c, h, root)) {
        int hv = (h - hr + H) % H;
        if (H <= RL_BCAST_FLAT_MAX && (int64_t)len <= rl_tune.bcast_flat_bytes) {
            if (hv) *parent = root;
            else
                for (int i = 1; i < H; i++) kids[n++] = host_leader(c, (hr + i) % H, root);
        } else {
            int k = binomial(hv, H, &p, idx);
            if (p >= 0) *parent = host_leader(c, (hr + p) % H, root);
            for (int i = 0; i < k; i++) kids[n++] = host_leader(c, (hr + idx[i]) % H, root);
        }
    }
    int L = c->host_off[h + 1] - c->host_off[h];
    int v = (c->local_idx[me] - c->local_idx[host_leader(c, h, root)] + L) % L;
    if (L <= RL_BCAST_FLAT_MAX) {
        if (v) *parent = host_member(c, h, root, 0);
        else
            for (int i = 1; i < L; i++) kids[n++] = host_member(c, h, root, i);
    } else {
        int k = binomial(v, L, &p, idx);
        if (p >= 0) *parent = host_member(c, h, root, p);
        for (int i = 0; i < k; i++) kids[n++] = host_member(c, h, root, idx[i]);
    }
    return n;
}

/* This rank's place in the tree of a broadcast of len bytes from root: its
 * parent (-1 at the root) and its children (the return value counts them,
 * at most RL_TREE_KIDS_MAX).  reduce.c runs it backwards across hosts. */
int rl_tree_shape(const rl_comm *c, size_t len, int root, int *parent, int *kids) {
    int P = c->size, v = rl_mod(c->rank - root, P), n = 0;
    *parent = -1;
    if (P <= RL_BCAST_FLAT_MAX && ((int64_t)len <= rl_tune.bcast_flat_bytes || c->nhosts <= 1)) {
        if (v) *parent = root;
        else
            for (int k = 1; k < P; k++) kids[n++] = rl_mod(root + k, P);
        return n;
    }
    if (c->nhosts > 1) return hosts_tree(c, len, root, parent, kids);
    int idx[32];
    n = binomial(v, P, parent, idx);
    if (*parent >= 0) *parent = rl_mod(*parent + root, P);
    for (int k = 0; k < n; k++) kids[k] = rl_mod(idx[k] + root, P);
    return n;
}

static int tree_bcast(rl_comm *c, const rl_opdesc *op, char *buf, size_t len, int root) {
    chain_bc a = {buf, len, len, NULL};
    rl_stream s[RL_TREE_KIDS_MAX];
    int parent, kids[RL_TREE_KIDS_MAX];
    int n = rl_tree_shape(c, len, root, &parent, kids);
    memset(s, 0, sizeof s);
    if (parent >= 0) {
        s[0].peer = parent;
        s[0].nseg = 1;
        s[0].where = whole_where;
        int st = rl_run_streams(c, op, s, 1, &a);
        if (st != RL_OK) return st;
        memset(s, 0, sizeof s);
    }
    for (int k = 0; k < n; k++) {
        s[k].peer = kids[k];
        s[k].is_send = 1;
        s[k].nseg = 1;
        s[k].where = whole_where;
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
        int flat = c->size <= RL_BCAST_FLAT_MAX &&
                   ((int64_t)len <= rl_tune.bcast_flat_bytes || c->nhosts <= 1);
        op.algo = c->nhosts > 1 && !flat ? "hosts_tree" : "binomial_tree";
        st = tree_bcast(c, &op, buf, len, root);
    } else {
        op.algo = "chain";
        st = chain_bcast(c, &op, buf, len, root);
    }
    return rl_end_op(c, &op, st);
}
