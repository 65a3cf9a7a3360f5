/*
 * wait.c - how loaded the host is, for the wait policy of every transport.
 *
 * A waiting rank that spins sees its peer's reply sooner than one that
 * sleeps, but only while the host has a core for each runnable thread.  When
 * other processes want the cores too (data loaders, other jobs, more ranks
 * than cores), a spinner burns the time slice its peer or its own next step
 * needs, and the scheduler then charges it for that: blocking at once is
 * faster there (docs/experiments.md, "Busy host").  rl_host_contended()
 * says which case holds, sampling the kernel's count of runnable threads at
 * most every RL_CONTENTION_SAMPLE_NS.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

#define RL_CONTENTION_SAMPLE_NS 20000000LL /* 20 ms */

static int64_t sampled_at; /* rl_now_ns() of the last sample; 0: never */
static int contended;

/* Threads runnable right now, host-wide (the fourth field of /proc/loadavg,
 * "running/total"), or -1 if it cannot be read. */
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
    if (last != 0 && now_ns - last < RL_CONTENTION_SAMPLE_NS)
        return __atomic_load_n(&contended, __ATOMIC_RELAXED);
    /* One thread samples; the others keep the last verdict meanwhile. */
    if (!__atomic_compare_exchange_n(&sampled_at, &last, now_ns, 0, __ATOMIC_RELAXED,
                                     __ATOMIC_RELAXED))
        return __atomic_load_n(&contended, __ATOMIC_RELAXED);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int running = runnable_now();
    int v = running > 0 && cpus > 0 && running > cpus;
    __atomic_store_n(&contended, v, __ATOMIC_RELAXED);
    return v;
}

int rl_host_busy(void) { return rl_host_contended(rl_now_ns()); }
