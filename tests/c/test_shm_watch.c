/*
 * test_shm_watch.c - unit test of the peer watch in rl_comm_shm_ready
 * (csrc/shm.c): once every rank attached, each rank opens a pidfd on every
 * peer's process, from the pid that peer wrote into its control block, so
 * that a peer killed later fails waits at once instead of at the deadline.
 *
 * A peer whose process is gone by then (it died after writing its pid) must
 * fail the set-up naming it, not leave it unwatched: its pid names no
 * process, an exited one, or another process that got the pid since.  A
 * system limit (EMFILE) fails it too; a pidfd_open that the kernel lacks or a
 * seccomp filter refuses, or a peer in another pid namespace, leaves the peer
 * unwatched as before.
 *
 * A 2-rank segment is laid out by attach() in this process (comm rank 0);
 * rank 1 is only its control block, written by hand with the pid of a child
 * process (dead, exited, alive) as if rank 1 had attached and was watching.
 * Plain C, run by tests/test_shm.py (under AddressSanitizer); shm.c is
 * compiled in here, so build with every other file of csrc/:
 *     gcc -O2 -std=gnu11 -Wall -Werror -Icsrc tests/c/test_shm_watch.c \
 *         $(ls csrc/[a-z]*.c | grep -v shm.c) -pthread -o /tmp/test_shm_watch
 * Prints "SKIP: ..." and exits 0 where pidfd_open is unavailable; else one
 * line per failure and exit 1 if anything failed, or "all N checks passed".
 */
#include "../../csrc/shm.c" /* first: its _GNU_SOURCE must precede every system header */

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include "check.h"

/* The cases that fail must fail at once, far within it. */
#define DEADLINE_MS 20000
#define AT_ONCE_MS 5000

static char what[1024];
static rl_endpoint peers[2];
static rl_ctx ctx;
static int world[2] = {0, 1};
static rl_comm comm;

static rl_shm *attach_segment(void) {
    rl_comm *c = &comm;
    size_t size = rl_shm_segment_bytes(2);
    int fd = memfd_create("ringlet-test-shm-watch", MFD_CLOEXEC);
    check(fd >= 0 && ftruncate(fd, (off_t)size) == 0, "memfd_create and ftruncate of the segment");
    rl_error err;
    int st = attach(c, fd, size, 1, SHM_COLL, &err);
    snprintf(what, sizeof what, "attach() lays out a 2-rank segment (%.300s)", err.msg);
    check(st == RL_OK, what);
    close(fd);
    return st == RL_OK ? c->shm : NULL;
}

/* A segment laid out here where rank 1 attached as process pid with the
 * identity given and watches already, as if it had gone through set-up. */
static rl_shm *segment_with_peer(pid_t pid, uint64_t start, uint32_t pidns) {
    rl_shm *s = attach_segment();
    if (!s) return NULL;
    s->hdr->cma_bytes = 0; /* no single-copy probe of a process that is no rank */
    shm_ctrl *p = &s->ctrl[1];
    p->start = start;
    p->pidns = pidns;
    p->timens = s->ctrl[0].timens;
    __atomic_store_n(&p->pid, (int32_t)pid, __ATOMIC_RELEASE);
    __atomic_fetch_add(&s->hdr->attached, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&s->hdr->watching, 1, __ATOMIC_SEQ_CST);
    return s;
}

/* This rank's set-up on the segment attached; the comm stays attached for checks. */
static int ready(const char *name, int64_t *ms) {
    if (!comm.shm) return -1;
    int64_t t0 = rl_now_ns();
    int st = rl_comm_shm_ready(&comm, DEADLINE_MS);
    *ms = (rl_now_ns() - t0) / 1000000;
    printf("%s: status %d after %lld ms: %s\n", name, st, (long long)*ms,
           comm.err.status ? comm.err.msg : "-");
    return st;
}

static int ready_with_peer(const char *name, pid_t pid, uint64_t start, uint32_t pidns,
                           int64_t *ms) {
    segment_with_peer(pid, start, pidns);
    return ready(name, ms);
}

static void done_with_segment(void) {
    rl_shm_detach(&comm);
    comm.poisoned = 0;
    memset(&comm.err, 0, sizeof comm.err);
}

/* The set-up failed at once with status want, naming peer 1 and its pid,
 * and wrote the abort record that the ranks waiting for this one read. */
static void check_failed(const char *name, int st, int want, int64_t ms, pid_t pid,
                         const char *words) {
    rl_shm *s = comm.shm;
    char pidtext[32];
    snprintf(pidtext, sizeof pidtext, "(pid %d)", (int)pid);
    snprintf(what, sizeof what, "%s: the set-up fails with status %d, not %d (a peer left "
             "unwatched makes later ops wait for their deadline)", name, st, want);
    check(st == want, what);
    snprintf(what, sizeof what, "%s: it fails at once (%lld ms)", name, (long long)ms);
    check(ms < AT_ONCE_MS, what);
    snprintf(what, sizeof what, "%s: the error names peer 1, its pid %d and says \"%s\" "
             "(peer %d: %.300s)", name, (int)pid, words, comm.err.peer, comm.err.msg);
    check(comm.err.peer == 1 && strstr(comm.err.msg, "peer 1 ") &&
          strstr(comm.err.msg, pidtext) && strstr(comm.err.msg, words), what);
    snprintf(what, sizeof what, "%s: the abort record carries it to the other ranks", name);
    check(s && __atomic_load_n(&s->hdr->abort_set, __ATOMIC_ACQUIRE) &&
          s->hdr->abort_rank == 0 && s->hdr->abort_status == want &&
          strstr(s->hdr->abort_reason, pidtext), what);
}

static void check_watched(const char *name, int st, int watched) {
    rl_shm *s = comm.shm;
    snprintf(what, sizeof what, "%s: the set-up succeeds (status %d: %.300s)", name, st,
             comm.err.msg);
    check(st == RL_OK, what);
    snprintf(what, sizeof what, "%s: peer 1 is %s (pidfds: %d)", name,
             watched ? "watched" : "left unwatched", s ? s->npidfds : -1);
    check(s && s->npidfds == watched && (s->pidfds[1] >= 0) == watched, what);
}

/* A child that exits at once; reaped unless keep, so its pid names nothing
 * (or, kept, an exited process). */
static pid_t exited_child(int keep) {
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    siginfo_t info;
    waitid(P_PID, (id_t)pid, &info, WEXITED | (keep ? WNOWAIT : 0));
    return pid;
}

static pid_t live_child(void) {
    pid_t pid = fork();
    if (pid == 0)
        for (;;) pause();
    return pid;
}

static void end_child(pid_t pid) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* From here on pidfd_open fails with ENOSYS in this process, as on a kernel
 * before 5.3 or under a container's seccomp profile.  0 when installed. */
static int refuse_pidfd_open(void) {
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_pidfd_open, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {(unsigned short)(sizeof code / sizeof code[0]), code};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

int main(void) {
    int probe = (int)syscall(SYS_pidfd_open, getpid(), 0);
    if (probe < 0) {
        printf("SKIP: pidfd_open is unavailable here (%s)\n", strerror(errno));
        return 0;
    }
    close(probe);
    snprintf(peers[1].host, sizeof peers[1].host, "127.0.0.1");
    peers[1].port = 1;
    ctx.rank = 0;
    ctx.size = 2;
    ctx.peers = peers;
    comm.ctx = &ctx;
    comm.id = 9;
    comm.rank = 0;
    comm.size = 2;
    comm.world = world;
    pthread_mutex_init(&comm.err_lock, NULL);
    int64_t ms;
    int st;

    /* What this process publishes about itself. */
    rl_shm *s = attach_segment();
    if (!s) return check_report();
    uint64_t own_start = proc_start_time(getpid());
    uint32_t own_pidns = s->ctrl[0].pidns;
    snprintf(what, sizeof what, "attach publishes this process's start time (%llu) and pid "
             "namespace (%u)", (unsigned long long)s->ctrl[0].start, own_pidns);
    check(own_start && s->ctrl[0].start == own_start && own_pidns, what);
    done_with_segment();

    /* A live peer with its own start time is watched: its pidfd tells its death. */
    pid_t child = live_child();
    st = ready_with_peer("live peer", child, proc_start_time(child), own_pidns, &ms);
    check_watched("live peer", st, 1);
    if (st == RL_OK && comm.shm->pidfds[1] >= 0) {
        kill(child, SIGKILL);
        struct pollfd pf = {comm.shm->pidfds[1], POLLIN, 0};
        check(poll(&pf, 1, DEADLINE_MS) == 1, "live peer: its pidfd tells its death");
    }
    end_child(child);
    done_with_segment();

    /* A peer that died and was reaped before this rank's set-up: ESRCH. */
    child = exited_child(0);
    st = ready_with_peer("dead peer", child, 12345, own_pidns, &ms);
    check_failed("dead peer", st, RL_ERR_PEER_CLOSED, ms, child,
                 "exited or was killed before this rank could watch it");
    done_with_segment();

    /* A peer that exited but was not reaped yet: the pidfd opens, and polls
     * as exited at once. */
    child = exited_child(1);
    st = ready_with_peer("exited peer", child, 0, own_pidns, &ms);
    check_failed("exited peer", st, RL_ERR_PEER_CLOSED, ms, child, "exited or was killed");
    waitpid(child, NULL, 0);
    done_with_segment();

    /* The peer's pid names another process now (reused): the pidfd opens on
     * a live process whose start time is not the one the peer published. */
    child = live_child();
    st = ready_with_peer("reused pid", child, proc_start_time(child) + 1, own_pidns, &ms);
    check_failed("reused pid", st, RL_ERR_PEER_CLOSED, ms, child, "now names another process");
    end_child(child);
    done_with_segment();

    /* A peer that could not read its own start time is still watched. */
    child = live_child();
    st = ready_with_peer("unknown start", child, 0, own_pidns, &ms);
    check_watched("unknown start", st, 1);
    end_child(child);
    done_with_segment();

    /* A peer of another pid namespace: its pid means nothing here. */
    if (own_pidns) {
        child = exited_child(0);
        st = ready_with_peer("other pid namespace", child, 12345, own_pidns + 1, &ms);
        check_watched("other pid namespace", st, 0);
        done_with_segment();
    }

    /* No descriptor left for the pidfd: a clear error, not a silent
     * unwatched peer.  The limit drops to the lowest free descriptor once the
     * segment is attached and the child's start time read. */
    child = live_child();
    if (segment_with_peer(child, proc_start_time(child), own_pidns)) {
        struct rlimit was;
        getrlimit(RLIMIT_NOFILE, &was);
        int lowest = open("/dev/null", O_RDONLY | O_CLOEXEC);
        struct rlimit low = {(rlim_t)lowest, was.rlim_max};
        if (lowest >= 0) close(lowest);
        int limited = lowest >= 0 && setrlimit(RLIMIT_NOFILE, &low) == 0;
        st = limited ? ready("descriptor limit", &ms) : -1;
        setrlimit(RLIMIT_NOFILE, &was);
        check(limited, "descriptor limit: the limit could be lowered");
        check_failed("descriptor limit", st, RL_ERR_SYSTEM, ms, child, "pidfd_open");
        snprintf(what, sizeof what, "descriptor limit: the error carries EMFILE (%d)",
                 comm.err.sys_errno);
        check(comm.err.sys_errno == EMFILE, what);
    }
    done_with_segment();
    end_child(child);

    /* Last (a seccomp filter stays): where pidfd_open is refused, a dead
     * peer is left unwatched, as before, rather than failing every set-up. */
    if (refuse_pidfd_open() == 0) {
        child = exited_child(0);
        st = ready_with_peer("pidfd_open refused", child, 12345, own_pidns, &ms);
        check_watched("pidfd_open refused", st, 0);
        done_with_segment();
    } else {
        printf("note: no seccomp filter could be installed (%s): the ENOSYS case is not run\n",
               strerror(errno));
    }
    pthread_mutex_destroy(&comm.err_lock);
    return check_report();
}
