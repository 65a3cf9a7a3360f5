/*
 * test_bcast_tree.c - unit test of the TCP broadcast's tree (csrc/bcast.c,
 * rl_tree_shape) over ranks on several hosts (rl_comm_set_hosts).
 *
 * For layouts of hosts (consecutive, interleaved, uneven, more than 4 ranks
 * on a host, more than 4 hosts), every root and sizes on both sides of
 * bcast_flat_bytes, the shapes the ranks compute must form one tree: every
 * rank but the root has one parent, which lists it among its children, and
 * following parents reaches the root.  Across hosts it must send one copy
 * over each host's link (H - 1 edges between hosts, none into the root's
 * host), and a message of at most bcast_flat_bytes over at most 4 hosts must
 * cross between hosts at most once on its way to any rank.  Without a host
 * table the ranks keep the one-host shapes (flat up to 4 ranks, else binomial).
 *
 * Plain C, run by tests/test_c_units.py (under AddressSanitizer); bcast.c is
 * compiled in here, so build with every other file of csrc/:
 *     gcc -O2 -std=gnu11 -Wall -Werror -Icsrc tests/c/test_bcast_tree.c \
 *         $(ls csrc/[a-z]*.c | grep -v bcast.c) -pthread -o /tmp/test_bcast_tree
 * Prints one line per failure and exits 1 if anything failed, else prints
 * "all N checks passed" and exits 0.
 */
#include "../../csrc/bcast.c"

#include <stdlib.h>

#include "check.h"

#define PMAX 24

/* One layout: a host letter per comm rank. */
static const char *LAYOUTS[] = {
    "aabb", "abab", "aaab", "ab", "abc", "aabbccdd", "aaaaabbbb", "aabbccddeeff",
    "aaaaaaaabc", "abcdefgh", "aabbbbbbccd", "abcdefghijklmnopqrstuvwx",
};

static int shapes(rl_comm *c, size_t len, int root, int *parent, int kids[][RL_TREE_KIDS_MAX],
                  int *nkids) {
    for (int r = 0; r < c->size; r++) {
        c->rank = r;
        nkids[r] = rl_tree_shape(c, len, root, &parent[r], kids[r]);
        if (nkids[r] < 0 || nkids[r] > RL_TREE_KIDS_MAX) return 0;
    }
    return 1;
}

/* The tree's defects for one root and size, as one line (empty: none). */
static void judge(rl_comm *c, const char *layout, size_t len, int root, char *what, size_t n) {
    int P = c->size, parent[PMAX], kids[PMAX][RL_TREE_KIDS_MAX], nkids[PMAX];
    int H = c->nhosts > 1 ? c->nhosts : 1;
    what[0] = 0;
    if (!shapes(c, len, root, parent, kids, nkids)) {
        snprintf(what, n, "%s root %d len %zu: a child count out of range", layout, root, len);
        return;
    }
    int crossing = 0;
    for (int r = 0; r < P; r++) {
        if ((r == root) != (parent[r] < 0)) {
            snprintf(what, n, "%s root %d len %zu: rank %d has parent %d", layout, root, len, r,
                     parent[r]);
            return;
        }
        if (r == root) continue;
        int listed = 0;
        for (int k = 0; k < nkids[parent[r]]; k++) listed += kids[parent[r]][k] == r;
        if (listed != 1) {
            snprintf(what, n, "%s root %d len %zu: rank %d's parent %d lists it %d times", layout,
                     root, len, r, parent[r], listed);
            return;
        }
        int hops = 0, cross = 0;
        for (int q = r; q != root && hops <= P; q = parent[q], hops++)
            if (c->nhosts > 1 && c->host_of[q] != c->host_of[parent[q]]) cross++;
        if (hops > P) {
            snprintf(what, n, "%s root %d len %zu: rank %d never reaches the root", layout, root,
                     len, r);
            return;
        }
        if (c->nhosts > 1 && c->host_of[r] != c->host_of[parent[r]]) {
            crossing++;
            if (c->host_of[r] == c->host_of[root]) {
                snprintf(what, n, "%s root %d len %zu: rank %d, on the root's host, receives from "
                         "another host", layout, root, len, r);
                return;
            }
        }
        int small = (int64_t)len <= rl_tune.bcast_flat_bytes && H <= 4;
        if (c->nhosts > 1 && small && cross > 1) {
            snprintf(what, n, "%s root %d len %zu: the data crosses hosts %d times to rank %d",
                     layout, root, len, cross, r);
            return;
        }
    }
    /* Up to 4 ranks and bcast_flat_bytes the root sends to every rank itself,
     * on one host or several; otherwise one copy per host link. */
    int flat = P <= 4 && (int64_t)len <= rl_tune.bcast_flat_bytes;
    if (c->nhosts > 1 && !flat && crossing != H - 1)
        snprintf(what, n, "%s root %d len %zu: %d copies between hosts, want %d", layout, root,
                 len, crossing, H - 1);
}

int main(void) {
    char what[512];
    rl_comm c;
    memset(&c, 0, sizeof c);
    pthread_mutex_init(&c.op_lock, NULL);
    const size_t lens[] = {4, 8192, 8193, 65536};
    const int nl = (int)(sizeof lens / sizeof lens[0]);

    for (size_t li = 0; li < sizeof LAYOUTS / sizeof LAYOUTS[0]; li++) {
        const char *layout = LAYOUTS[li];
        int P = (int)strlen(layout), host_of[PMAX], distinct = 0, seen[26] = {0};
        for (int r = 0; r < P; r++) {
            host_of[r] = layout[r] - 'a';
            if (!seen[host_of[r]]++) distinct++;
        }
        c.size = P;
        /* the one-host shapes first (no table), then across hosts */
        for (int with = 0; with < 2; with++) {
            if (with) {
                int st = rl_comm_set_hosts(&c, host_of);
                snprintf(what, sizeof what, "%s: rl_comm_set_hosts accepts the table", layout);
                check(st == RL_OK && c.nhosts == distinct, what);
            }
            for (int root = 0; root < P; root++)
                for (int k = 0; k < nl; k++) {
                    judge(&c, layout, lens[k], root, what, sizeof what);
                    check(what[0] == 0, what);
                }
        }
        free(c.host_of);
        c.host_of = NULL;
        c.nhosts = 0;
    }

    /* A host number out of range is refused, and the table stays as it was. */
    int bad[3] = {0, 3, 1};
    c.size = 3;
    check(rl_comm_set_hosts(&c, bad) == RL_ERR_INVALID && c.host_of == NULL,
          "rl_comm_set_hosts refuses a host number >= size");
    bad[1] = -1;
    check(rl_comm_set_hosts(&c, bad) == RL_ERR_INVALID, "rl_comm_set_hosts refuses -1");
    /* Host numbers need not be dense: hosts are renumbered by their lowest rank. */
    int sparse[3] = {2, 0, 2};
    check(rl_comm_set_hosts(&c, sparse) == RL_OK && c.nhosts == 2 && c.host_of[0] == 0 &&
              c.host_of[1] == 1 && c.host_of[2] == 0,
          "rl_comm_set_hosts numbers hosts by their lowest comm rank");
    free(c.host_of);
    return check_report();
}
