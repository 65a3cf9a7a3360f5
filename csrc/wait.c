/*
 * wait.c - how loaded the host is, for the wait policy of every transport.
 *
 * A waiting rank that spins sees its peer's reply sooner than one that
 * sleeps, but only while no other process wants the cores.  When others do
 * (data loaders, other jobs), a spinner burns the time slice its peer or its
 * own next step needs, and the scheduler then makes it wait a whole slice:
 * blocking at once is faster there (docs/experiments.md, "Busy host").  The
 * job's own ranks are not such load: when they alone outnumber the cores,
 * spinning with sched_yield hands the core from rank to rank (spin_yield).
 *
 * The verdict comes from the kernel's count of runnable threads (the fourth
 * field of /proc/loadavg), sampled at most every RL_BUSY_SAMPLE_NS by
 * whichever waiter needs it first:
 *  - while ranks spin they are all runnable, so others = running - host_ranks;
 *    the host turns busy when others >= 1 and running > CPUs;
 *  - while ranks block they are not counted, so the host stays busy while
 *    running (the sampler included) > CPUs, and turns idle only after
 *    RL_BUSY_CALM quiet samples in a row, so a moment when the other load
 *    sleeps does not put every rank back to spinning.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

#define RL_BUSY_SAMPLE_NS 20000000LL /* 20 ms */
#define RL_BUSY_CALM 5

static int64_t sampled_at; /* rl_now_ns() of the last sample; 0: never */
static int busy, calm;     /* written by the sampling thread only */

/* Threads runnable right now, host-wide ("running/total" in /proc/loadavg),
 * or -1 if it cannot be read. */
static int runnable_now(void) {
    char buf[128];
    int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = buf;
    for (int field = 0; field < 3; field++) { /* skip the three averages */
        while (*p && *p != ' ') p++;
        while (*p == ' ') p++;
    }
    if (*p < '0' || *p > '9') return -1;
    return (int)strtol(p, NULL, 10);
}

int rl_host_contended(int64_t now_ns) {
    if (!rl_tune.busy_block) return 0;
    int64_t last = __atomic_load_n(&sampled_at, __ATOMIC_RELAXED);
    if (last != 0 && now_ns - last < RL_BUSY_SAMPLE_NS)
        return __atomic_load_n(&busy, __ATOMIC_RELAXED);
    /* One thread samples; the others keep the last verdict meanwhile. */
    if (!__atomic_compare_exchange_n(&sampled_at, &last, now_ns, 0, __ATOMIC_RELAXED,
                                     __ATOMIC_RELAXED))
        return __atomic_load_n(&busy, __ATOMIC_RELAXED);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int running = runnable_now();
    if (running < 0 || cpus < 1) return 0;
    int v;
    if (!__atomic_load_n(&busy, __ATOMIC_RELAXED)) {
        int64_t ours = rl_tune.host_ranks > 0 ? rl_tune.host_ranks : 1;
        v = running - ours >= 1 && running > cpus;
        calm = 0;
    } else if (running > cpus) {
        v = 1;
        calm = 0;
    } else {
        v = ++calm < RL_BUSY_CALM;
    }
    __atomic_store_n(&busy, v, __ATOMIC_RELAXED);
    return v;
}

int rl_host_busy(void) { return rl_host_contended(rl_now_ns()); }
