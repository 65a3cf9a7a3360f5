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
 * The measure is CPU time, not a count of runnable threads: counts taken
 * in one instant are noise when 4 ranks share 2 cores (a rank that was
 * runnable when the count was read sleeps by the time its state is).  Over
 * windows of RL_BUSY_WINDOW_NS the CPU time the whole host used
 * (/proc/stat) less the time this host's ranks used (/proc/<pid>/stat of
 * each; init() passes their pids with rl_set_host_pids) is what others
 * used.  The host is busy when others used at least RL_BUSY_OTHERS of a
 * core and the ranks (each wanting a core while it spins) plus the others
 * want more cores than there are; idle after RL_BUSY_CALM quiet windows in
 * a row.  Without pids (a C program that never called it) the host counts
 * as idle.  Whichever waiter needs the verdict first samples, at most every
 * RL_BUSY_SAMPLE_NS.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define RL_BUSY_SAMPLE_NS 20000000LL  /* 20 ms */
#define RL_BUSY_WINDOW_NS 100000000LL /* 100 ms: ten ticks of the CPU clock */
#define RL_BUSY_OTHERS 0.3            /* of one core */
#define RL_BUSY_CALM 2
#define RL_HOST_PIDS_MAX 256

static int64_t sampled_at; /* rl_now_ns() of the last sample; 0: never */
static int busy, calm;     /* written by the sampling thread only */
static int host_pids[RL_HOST_PIDS_MAX], n_host_pids;
static int64_t win_at;                   /* start of the current window; 0: none */
static long long win_host, win_ours;     /* CPU ticks at its start */
static double last_others = -1;          /* cores others used in the last window */

void rl_set_host_pids(const int *pids, int n) {
    if (n < 0 || n > RL_HOST_PIDS_MAX) n = 0;
    for (int i = 0; i < n; i++) host_pids[i] = pids[i];
    __atomic_store_n(&n_host_pids, n, __ATOMIC_RELEASE);
    __atomic_store_n(&win_at, 0, __ATOMIC_RELAXED); /* a new set of ranks: a new window */
    last_others = -1;
}

static ssize_t read_file(const char *path, char *buf, size_t n) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t got = read(fd, buf, n - 1);
    close(fd);
    if (got >= 0) buf[got] = 0;
    return got;
}

/* CPU ticks the host spent busy (every state but idle and iowait), or -1. */
static long long host_ticks(void) {
    char buf[512];
    if (read_file("/proc/stat", buf, sizeof buf) <= 0 || strncmp(buf, "cpu ", 4) != 0) return -1;
    long long v[8] = {0}, sum = 0;
    char *p = buf + 4;
    for (int i = 0; i < 8; i++) v[i] = strtoll(p, &p, 10);
    for (int i = 0; i < 8; i++) sum += v[i];
    return sum - v[3] - v[4];
}

/* User + system ticks of a process, its exited threads included, or -1. */
static long long proc_ticks(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    if (read_file(path, buf, sizeof buf) <= 0) return -1;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p) return -1;
    p += 2; /* field 3, the state */
    for (int field = 3; field < 14; field++) {
        while (*p && *p != ' ') p++;
        while (*p == ' ') p++;
    }
    char *end;
    long long ut = strtoll(p, &end, 10), st = strtoll(end, NULL, 10);
    return ut + st;
}

static long long ours_ticks(int n) {
    long long sum = 0;
    for (int i = 0; i < n; i++) {
        long long t = proc_ticks(host_pids[i]);
        if (t > 0) sum += t; /* a rank that exited stops counting */
    }
    return sum;
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
    int n = __atomic_load_n(&n_host_pids, __ATOMIC_ACQUIRE);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (n == 0 || cpus < 1) return 0;
    int64_t start = __atomic_load_n(&win_at, __ATOMIC_RELAXED);
    if (start != 0 && now_ns - start < RL_BUSY_WINDOW_NS)
        return __atomic_load_n(&busy, __ATOMIC_RELAXED);
    long long h = host_ticks(), o = ours_ticks(n);
    if (h < 0) return 0;
    int v = __atomic_load_n(&busy, __ATOMIC_RELAXED);
    if (start != 0) {
        double secs = (double)(now_ns - start) * 1e-9, hz = (double)sysconf(_SC_CLK_TCK);
        double others = ((double)(h - win_host) - (double)(o - win_ours)) / (secs * hz);
        double ranks = rl_tune.host_ranks > 0 ? (double)rl_tune.host_ranks : 1.0;
        int loaded = others >= RL_BUSY_OTHERS && ranks + others > (double)cpus;
        last_others = others;
        if (loaded) {
            v = 1;
            calm = 0;
        } else if (v) {
            v = ++calm < RL_BUSY_CALM;
        }
    }
    win_host = h;
    win_ours = o;
    __atomic_store_n(&win_at, now_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&busy, v, __ATOMIC_RELAXED);
    return v;
}

int rl_host_busy(void) { return rl_host_contended(rl_now_ns()); }

double rl_host_others(void) {
    rl_host_contended(rl_now_ns());
    return last_others;
}

/* ---- how far apart two CPUs are --------------------------------------------
 * A cache line bounced between two threads pinned to the two CPUs.  A
 * virtual machine's vCPUs may sit on distant cores of the host for a while,
 * and then every line a rank stages for its peer crosses at several times
 * the usual cost (docs/experiments.md): benchmarks record this beside their
 * rounds. */
typedef struct {
    uint64_t line __attribute__((aligned(64)));
    int cpu[2];
    int iters, batches;
    int64_t deadline_ns;
    int failed; /* affinity refused or the deadline passed */
    double best_ns;
} rtt_probe;

#define RTT_STOP UINT64_MAX

static int rtt_pin(rtt_probe *p, int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0) return 1;
    __atomic_store_n(&p->failed, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&p->line, RTT_STOP, __ATOMIC_RELEASE);
    return 0;
}

/* Wait until the line holds want; 0 once told to stop or past the deadline. */
static int rtt_await(rtt_probe *p, uint64_t want) {
    for (uint32_t spins = 1;; spins++) {
        uint64_t v = __atomic_load_n(&p->line, __ATOMIC_ACQUIRE);
        if (v == want) return 1;
        if (v == RTT_STOP) return 0;
        if ((spins & 0xfff) == 0 && rl_now_ns() > p->deadline_ns) {
            __atomic_store_n(&p->failed, 1, __ATOMIC_RELAXED);
            __atomic_store_n(&p->line, RTT_STOP, __ATOMIC_RELEASE);
            return 0;
        }
    }
}

static void *rtt_echo(void *arg) {
    rtt_probe *p = arg;
    if (!rtt_pin(p, p->cpu[1])) return NULL;
    for (uint64_t v = 1; rtt_await(p, v); v += 2)
        __atomic_store_n(&p->line, v + 1, __ATOMIC_RELEASE);
    return NULL;
}

static void *rtt_serve(void *arg) {
    rtt_probe *p = arg;
    if (!rtt_pin(p, p->cpu[0]) || !rtt_await(p, 0)) return NULL;
    uint64_t v = 0;
    for (int b = 0; b < p->batches; b++) {
        int64_t t0 = rl_now_ns();
        for (int i = 0; i < p->iters; i++) {
            __atomic_store_n(&p->line, v + 1, __ATOMIC_RELEASE);
            if (!rtt_await(p, v + 2)) return NULL;
            v += 2;
        }
        double ns = (double)(rl_now_ns() - t0) / p->iters;
        if (b == 0 || ns < p->best_ns) p->best_ns = ns;
    }
    __atomic_store_n(&p->line, RTT_STOP, __ATOMIC_RELEASE);
    return NULL;
}

double rl_core_roundtrip_ns(int cpu_a, int cpu_b, int iters, int64_t timeout_ms) {
    if (cpu_a < 0 || cpu_b < 0 || cpu_a == cpu_b || cpu_a >= CPU_SETSIZE ||
        cpu_b >= CPU_SETSIZE || iters < 1 || timeout_ms < 1)
        return -1;
    rtt_probe *p = aligned_alloc(64, sizeof *p);
    if (!p) return -1;
    memset(p, 0, sizeof *p);
    p->cpu[0] = cpu_a;
    p->cpu[1] = cpu_b;
    p->iters = iters;
    p->batches = 5;
    p->deadline_ns = rl_now_ns() + timeout_ms * 1000000LL;
    pthread_t t[2];
    int started = 0;
    if (pthread_create(&t[0], NULL, rtt_echo, p) == 0) started++;
    if (started == 1 && pthread_create(&t[1], NULL, rtt_serve, p) == 0) started++;
    if (started < 2) {
        p->failed = 1;
        __atomic_store_n(&p->line, RTT_STOP, __ATOMIC_RELEASE);
    }
    for (int i = 0; i < started; i++) pthread_join(t[i], NULL);
    double out = p->failed ? -1 : p->best_ns;
    free(p);
    return out;
}
