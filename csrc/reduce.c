/*
 * reduce.c - reduce to a root: binomial tree for small messages, pipelined
 * chain for large ones.  Only the root's buffer changes.
 *
 * Binomial tree (v = (r - root) mod P): for mask = 1, 2, 4, ...: if v has
 * the mask bit, send the partial result to v - mask and stop; otherwise
 * receive v + mask's partial result (when that rank exists) and reduce it
 * in.  ceil(log2 P) steps, N bytes per message.  Non-roots accumulate in
 * scratch from their first receive on, so their input stays untouched.
 *
 * Chain: data flows from v = P-1 towards the root.  Rank v receives segment
 * k of the partial result from v+1 into one of RL_NSLOT scratch slots,
 * reduces its own segment k into it and forwards it to v-1 while the next
 * segments arrive.  The root reduces into its buffer.  Each link carries N
 * bytes once, pipelined.
 */
#include <string.h>

#include "internal.h"

#define RL_NSLOT 4

typedef struct {
    char *buf;     /* this rank's data (root: also the result) */
    char *scratch; /* RL_NSLOT segments */
    size_t len, seg, esz;
    rl_dtype dt;
    rl_redop op;
    int is_root, is_tail, P;
    rl_stream *send, *recv;
} chain_rd;

static size_t seg_len(const chain_rd *a, int i) {
    size_t off = (size_t)i * a->seg;
    return off >= a->len ? 0 : (a->len - off < a->seg ? a->len - off : a->seg);
}
static char *slot(const chain_rd *a, int i) { return a->scratch + (size_t)(i % RL_NSLOT) * a->seg; }

static int rc_recv_ready(void *alg, rl_stream *s, int i) {
    chain_rd *a = alg;
    (void)s;
    /* The slot is free once the segment that used it last was sent on. */
    return a->is_root || i < RL_NSLOT || a->send->cur > i - RL_NSLOT;
}
static void rc_recv_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    (void)s;
    *p = slot(alg, i);
    *l = seg_len(alg, i);
}
static int rc_recv_done(void *alg, rl_stream *s, int i) {
    chain_rd *a = alg;
    (void)s;
    size_t l = seg_len(a, i);
    char *mine = a->buf + (size_t)i * a->seg;
    if (a->is_root) {
        rl_reduce_kernel(mine, mine, slot(a, i), l / a->esz, a->dt, a->op);
        if (a->op == RL_AVG) rl_scale_kernel(mine, l / a->esz, a->dt, 1.0 / a->P);
    } else {
        rl_reduce_kernel(slot(a, i), slot(a, i), mine, l / a->esz, a->dt, a->op);
    }
    return RL_OK;
}
static int rc_send_ready(void *alg, rl_stream *s, int i) {
    chain_rd *a = alg;
    (void)s;
    return a->is_tail || a->recv->cur > i;
}
static void rc_send_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    chain_rd *a = alg;
    (void)s;
    *p = a->is_tail ? a->buf + (size_t)i * a->seg : slot(a, i);
    *l = seg_len(a, i);
}

static int chain_reduce(rl_comm *c, const rl_opdesc *op, char *buf, size_t count,
                        rl_dtype dt, rl_redop rop, int root) {
    int P = c->size, v = rl_mod(c->rank - root, P);
    chain_rd a;
    memset(&a, 0, sizeof a);
    a.buf = buf;
    a.esz = rl_dtype_size(dt);
    a.len = count * a.esz;
    a.seg = ((size_t)rl_tune.segment_bytes / a.esz) * a.esz;
    if (a.seg == 0) a.seg = a.esz;
    a.dt = dt;
    a.op = rop;
    a.P = P;
    a.is_root = v == 0;
    a.is_tail = v == P - 1;
    int st = rl_scratch(c, op, a.seg * RL_NSLOT, buf, &a.scratch);
    if (st != RL_OK) return st;
    int nseg = rl_nseg(a.len, a.seg);
    rl_stream s[2];
    int n = 0;
    memset(s, 0, sizeof s);
    if (!a.is_tail) {
        s[n].peer = rl_mod(v + 1 + root, P);
        s[n].nseg = nseg;
        s[n].ready = rc_recv_ready;
        s[n].where = rc_recv_where;
        s[n].done = rc_recv_done;
        a.recv = &s[n];
        n++;
    }
    if (!a.is_root) {
        s[n].peer = rl_mod(v - 1 + root, P);
        s[n].is_send = 1;
        s[n].nseg = nseg;
        s[n].ready = rc_send_ready;
        s[n].where = rc_send_where;
        a.send = &s[n];
        n++;
    }
    return rl_run_streams(c, op, s, n, &a);
}

static int tree_reduce(rl_comm *c, const rl_opdesc *op, char *buf, size_t count,
                       rl_dtype dt, rl_redop rop, int root) {
    int P = c->size, v = rl_mod(c->rank - root, P);
    size_t len = count * rl_dtype_size(dt);
    /* The partial result is read from buf until the first receive; that
     * reduction writes it to scratch on non-roots (their input stays
     * untouched), so a leaf sends its input as it is and nobody copies it. */
    const char *acc = buf;
    char *sum = buf, *tmp = NULL;
    uint32_t tag = 0;
    for (int mask = 1; mask < P; mask <<= 1, tag++) {
        if (v & mask) {
            return rl_exchange(c, op, rl_mod(v - mask + root, P), acc, -1, NULL, len, tag);
        }
        if (v + mask < P) {
            if (!tmp) { /* first child: [sum (non-root) | received] */
                char *scratch;
                int st = rl_scratch(c, op, (v != 0 ? 2 : 1) * len, buf, &scratch);
                if (st != RL_OK) return st;
                tmp = scratch;
                if (v != 0) {
                    sum = scratch;
                    tmp = scratch + len;
                }
            }
            int st = rl_exchange(c, op, -1, NULL, rl_mod(v + mask + root, P), tmp, len, tag);
            if (st != RL_OK) return st;
            rl_reduce_kernel(sum, acc, tmp, count, dt, rop); /* the lower rank's first */
            acc = sum;
        }
    }
    if (v == 0 && rop == RL_AVG) rl_scale_kernel(buf, count, dt, 1.0 / P);
    return RL_OK;
}

/* Across hosts (rl_comm_set_hosts): the broadcast's hosts' tree run
 * backwards (rl_tree_shape).  A rank takes its children's partial results
 * at once, each into its own scratch block, reduces them into its own in the
 * order the tree lists them, and sends the sum to its parent: one copy over
 * each host's link, and a small message from any rank crosses between hosts
 * once on its way to the root. */
typedef struct {
    char *in;
    const char *out;
    size_t len;
    rl_stream *first;
} hosts_rd;

static void hr_where(void *alg, rl_stream *s, int i, char **p, size_t *l) {
    hosts_rd *a = alg;
    (void)i;
    *p = s->is_send ? (char *)a->out : a->in + (size_t)(s - a->first) * a->len;
    *l = a->len;
}

static int hosts_reduce(rl_comm *c, const rl_opdesc *op, char *buf, size_t count,
                        rl_dtype dt, rl_redop rop, int root) {
    size_t len = count * rl_dtype_size(dt);
    int parent, kids[RL_TREE_KIDS_MAX];
    int n = rl_tree_shape(c, len, root, &parent, kids);
    rl_stream s[RL_TREE_KIDS_MAX];
    hosts_rd a = {NULL, buf, len, s};
    memset(s, 0, sizeof s);
    if (n) {
        /* [sum (non-root) | a child's block each] */
        char *scratch;
        int st = rl_scratch(c, op, (size_t)(n + (parent >= 0)) * len, buf, &scratch);
        if (st != RL_OK) return st;
        a.in = scratch + (parent >= 0 ? len : 0);
        for (int k = 0; k < n; k++) {
            s[k].peer = kids[k];
            s[k].nseg = 1;
            s[k].where = hr_where;
        }
        if ((st = rl_run_streams(c, op, s, n, &a)) != RL_OK) return st;
        char *sum = parent >= 0 ? scratch : buf; /* non-roots keep their input */
        const char *acc = buf;
        for (int k = 0; k < n; k++, acc = sum)
            rl_reduce_kernel(sum, acc, a.in + (size_t)k * len, count, dt, rop);
        a.out = sum;
        memset(s, 0, sizeof s);
    }
    if (parent < 0) {
        if (rop == RL_AVG) rl_scale_kernel(buf, count, dt, 1.0 / c->size);
        return RL_OK;
    }
    s[0].peer = parent;
    s[0].is_send = 1;
    s[0].nseg = 1;
    s[0].where = hr_where;
    return rl_run_streams(c, op, s, 1, &a);
}

int rl_reduce(rl_comm *c, void *buf, size_t count, rl_dtype dt, rl_redop rop,
              int root, int64_t timeout_ms) {
    if ((unsigned)dt >= RL_NDTYPES || !rl_op_valid(dt, rop) || root < 0 ||
        root >= c->size || (!buf && count))
        return RL_ERR_INVALID;
    rl_opdesc op;
    size_t len = count * rl_dtype_size(dt);
    int st = rl_begin_op(c, &op, RL_OP_REDUCE, dt, rop, root, len, timeout_ms);
    if (st == RL_OK) rl_note_rooted(c, &op);
    if (st != RL_OK) return st;
    if (c->size == 1 || count == 0) {
        op.algo = "local";
        return rl_end_op(c, &op, RL_OK);
    }
    if (c->shm) return rl_end_op(c, &op, rl_shm_all_reduce(c, &op, buf, count, dt, rop, root));
    if ((int64_t)len <= rl_tune.reduce_small_bytes && c->nhosts > 1) {
        op.algo = "hosts_tree";
        st = hosts_reduce(c, &op, buf, count, dt, rop, root);
    } else if ((int64_t)len <= rl_tune.reduce_small_bytes) {
        op.algo = "binomial_tree";
        st = tree_reduce(c, &op, buf, count, dt, rop, root);
    } else {
        op.algo = "chain";
        st = chain_reduce(c, &op, buf, count, dt, rop, root);
    }
    return rl_end_op(c, &op, st);
}
