/*
 * flight_cost.c - what the flight recorder adds to one operation, in plain C.
 *
 * One process, a communicator of one rank: rl_all_reduce then does nothing
 * but rl_begin_op, the algorithm choice and rl_end_op, so the difference
 * between a comm created with trace_entries = 0 and one with 2000 is the
 * recorder's cost per op.  Rounds interleave the two comms (and alternate
 * which goes first) so drifts of a shared machine hit both alike.
 *
 *   cc -O2 -pthread -Icsrc bench/c/flight_cost.c csrc/[a-z]*.c -lm -o /tmp/flight_cost
 *   /tmp/flight_cost [rounds] [calls per round]
 */
#include <stdio.h>
#include <stdlib.h>

#include "ringlet.h"
#include "internal.h"

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double per_call_ns(rl_comm *c, float *buf, int n) {
    int64_t t0 = rl_now_ns();
    for (int i = 0; i < n; i++)
        if (rl_all_reduce(c, buf, 2, RL_F32, RL_SUM, 1000) != RL_OK) exit(1);
    return (double)(rl_now_ns() - t0) / n;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 21;
    int calls = argc > 2 ? atoi(argv[2]) : 200000;
    uint8_t secret[16] = {1}, job[16] = {2};
    rl_error err;
    rl_ctx *ctx;
    if (rl_ctx_create(&ctx, 0, 1, "127.0.0.1", secret, sizeof secret, job, &err) != RL_OK) {
        fprintf(stderr, "ctx: %s\n", err.msg);
        return 1;
    }
    int world = 0;
    rl_tuning t;
    rl_comm *comm[2];
    for (int k = 0; k < 2; k++) {
        rl_get_tuning(&t);
        t.trace_entries = k ? 2000 : 0;
        rl_set_tuning(&t);
        if (rl_comm_create(&comm[k], ctx, (uint32_t)(2 * k), 0, 1, &world, &err) != RL_OK) {
            fprintf(stderr, "comm: %s\n", err.msg);
            return 1;
        }
    }
    float buf[2] = {1, 2};
    per_call_ns(comm[0], buf, calls); /* warm up both */
    per_call_ns(comm[1], buf, calls);
    double *off = malloc(sizeof(double) * (size_t)rounds);
    double *on = malloc(sizeof(double) * (size_t)rounds);
    double *diff = malloc(sizeof(double) * (size_t)rounds);
    for (int r = 0; r < rounds; r++) {
        if (r & 1) {
            on[r] = per_call_ns(comm[1], buf, calls);
            off[r] = per_call_ns(comm[0], buf, calls);
        } else {
            off[r] = per_call_ns(comm[0], buf, calls);
            on[r] = per_call_ns(comm[1], buf, calls);
        }
        diff[r] = on[r] - off[r];
    }
    qsort(off, (size_t)rounds, sizeof *off, cmp);
    qsort(on, (size_t)rounds, sizeof *on, cmp);
    qsort(diff, (size_t)rounds, sizeof *diff, cmp);
    printf("rounds %d x %d calls of a 1-rank all_reduce (begin/end only)\n", rounds, calls);
    printf("recorder off (trace_entries=0):    median %.1f ns/op\n", off[rounds / 2]);
    printf("recorder on  (trace_entries=2000): median %.1f ns/op\n", on[rounds / 2]);
    printf("on - off, per round: median %.1f ns, min %.1f, max %.1f\n", diff[rounds / 2],
           diff[0], diff[rounds - 1]);
    /* On a loaded machine the fastest round of each is the cleaner figure. */
    printf("fastest round: off %.1f ns/op, on %.1f ns/op, on - off %.1f ns\n", off[0], on[0],
           on[0] - off[0]);
    rl_comm_destroy(comm[0]);
    rl_comm_destroy(comm[1]);
    rl_ctx_destroy(ctx);
    free(off);
    free(on);
    free(diff);
    return 0;
}
