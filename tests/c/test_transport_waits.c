/*
 * test_transport_waits.c - unit test of waits in csrc/transport.c and
 * csrc/p2p.c that no other test can reach on demand:
 *
 * - a collective waiting for another thread's op on the same communicator
 *   (op_lock), and a receive from any source waiting for another one
 *   (any_lock), call the interrupt hook every ~90 ms: Ctrl-C ends them with
 *   RL_ERR_INTERRUPTED long before their deadline;
 * - a listener thread that stops on an error (here poll()'s EINVAL, once the
 *   descriptor limit is lowered under it) makes a rank waiting for a peer to
 *   dial fail at once, naming the listener, instead of at its deadline.
 *
 * Plain C with every file of csrc/, run by tests/test_c_units.py; by hand:
 *     gcc -O2 -std=gnu11 -Wall -Werror -Icsrc tests/c/test_transport_waits.c csrc/[a-z]*.c \
 *         -pthread -o /tmp/test_transport_waits && /tmp/test_transport_waits
 * Prints one line per failure and exits 1 if anything failed, else prints
 * "all N checks passed" and exits 0.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "internal.h"
#include "check.h"

/* Deadlines of the waits: an interrupt or a stopped listener must end them
 * well before. */
#define DEADLINE_MS 4000

static int hook_calls;
static int interrupt_now(void) {
    hook_calls++;
    return 1;
}

static double ms_since(int64_t t0) { return (double)(rl_now_ns() - t0) / 1e6; }

/* A 2-rank comm of world ranks {0, 1} on a context that never connects. */
static rl_comm *comm_of(rl_ctx *ctx, int rank) {
    static const int world[2] = {0, 1};
    rl_comm *c = NULL;
    rl_error err;
    int st = rl_comm_create(&c, ctx, 5, rank, 2, world, &err);
    check(st == RL_OK && c, "rl_comm_create");
    return c;
}

static void interrupted_waits(void) {
    char what[1024];
    rl_endpoint peers[2];
    memset(peers, 0, sizeof peers);
    rl_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.rank = 0;
    ctx.size = 2;
    ctx.peers = peers;

    /* Another thread's collective holds the comm (here: this thread holds its lock). */
    rl_comm *c = comm_of(&ctx, 0);
    if (!c) return;
    pthread_mutex_lock(&c->op_lock);
    rl_set_interrupt_hook(interrupt_now);
    hook_calls = 0;
    rl_opdesc op;
    int64_t t0 = rl_now_ns();
    int st = rl_begin_op(c, &op, RL_OP_BARRIER, 0, 0, -1, 0, DEADLINE_MS);
    double took = ms_since(t0);
    snprintf(what, sizeof what, "a collective waiting for another thread's op is interrupted "
             "(status %d, want %d, after %.0f ms of a %d ms deadline)", st, RL_ERR_INTERRUPTED,
             took, DEADLINE_MS);
    check(st == RL_ERR_INTERRUPTED && took < DEADLINE_MS / 2, what);
    snprintf(what, sizeof what, "... at the first hook call, ~90 ms in (%d calls, %.0f ms)",
             hook_calls, took);
    check(hook_calls == 1 && took >= 80, what);
    snprintf(what, sizeof what, "... and the comm is poisoned with the reason (%.300s)", c->err.msg);
    check(c->poisoned && c->err.status == RL_ERR_INTERRUPTED &&
              strstr(c->err.msg, "interrupted while waiting") != NULL, what);
    pthread_mutex_unlock(&c->op_lock);
    rl_comm_destroy(c);

    /* Another thread's receive from any source holds the comm's any_lock. */
    c = comm_of(&ctx, 0);
    if (!c) return;
    pthread_mutex_lock(&c->any_lock);
    hook_calls = 0;
    float buf[1];
    int src = 7;
    t0 = rl_now_ns();
    st = rl_recv_any(c, buf, 1, RL_F32, 3, DEADLINE_MS, &src);
    took = ms_since(t0);
    snprintf(what, sizeof what, "a receive from any source waiting for another one is "
             "interrupted (status %d, want %d, after %.0f ms, %d hook calls)", st,
             RL_ERR_INTERRUPTED, took, hook_calls);
    check(st == RL_ERR_INTERRUPTED && took < DEADLINE_MS / 2 && hook_calls == 1 && src == -1,
          what);
    pthread_mutex_unlock(&c->any_lock);
    rl_comm_destroy(c);
    rl_set_interrupt_hook(NULL);
}

static void stopped_listener(void) {
    char what[1024];
    uint8_t secret[32], job[16];
    memset(secret, 7, sizeof secret);
    memset(job, 9, sizeof job);
    rl_ctx *ctx = NULL;
    rl_error err;
    int st = rl_ctx_create(&ctx, 1, 2, "127.0.0.1", secret, sizeof secret, job, &err);
    snprintf(what, sizeof what, "rl_ctx_create (%.300s)", err.msg);
    check(st == RL_OK && ctx, what);
    if (!ctx) return;
    rl_comm *c = comm_of(ctx, 1);
    if (!c) {
        rl_ctx_destroy(ctx);
        return;
    }
    /* One descriptor allowed: the listener's next poll() of two fails with
     * EINVAL, an error it cannot recover from. */
    struct rlimit saved, one;
    getrlimit(RLIMIT_NOFILE, &saved);
    one = saved;
    one.rlim_cur = 1;
    check(setrlimit(RLIMIT_NOFILE, &one) == 0, "lowering RLIMIT_NOFILE to 1");
    int64_t t0 = rl_now_ns();
    st = rl_comm_connect(c, 0, DEADLINE_MS); /* comm rank 1 waits for rank 0 to dial */
    double took = ms_since(t0);
    setrlimit(RLIMIT_NOFILE, &saved);
    snprintf(what, sizeof what, "waiting for a peer to dial fails at once when the listener "
             "stopped (status %d, want %d, after %.0f ms of %d: %.300s)", st, RL_ERR_SYSTEM,
             took, DEADLINE_MS, c->err.msg);
    check(st == RL_ERR_SYSTEM && took < DEADLINE_MS / 2, what);
    snprintf(what, sizeof what, "... naming the listener and its error (%.300s)", c->err.msg);
    check(strstr(c->err.msg, "listener thread stopped") != NULL &&
              c->err.sys_errno == EINVAL, what);
    rl_comm_destroy(c);
    rl_ctx_destroy(ctx);
}

int main(void) {
    interrupted_waits();
    stopped_listener();
    return check_report();
}
