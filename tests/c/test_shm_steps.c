/*
 * test_shm_steps.c - unit test of step_begin (csrc/shm.c), the wait a rank
 * makes before it writes a lane's buffer or slot: every peer must have read
 * the step that used it last (its ack reached step - depth).
 *
 * The case: a rank that only reads in a lane for more than 2^31 steps (a
 * broadcast leaf), then writes in it.  Its cached view of a peer's ack is
 * 2^31 steps old; compared modulo 2^32 with the step it needs, such a value
 * reads as "ahead", and the rank used to overwrite a slot the peer had not
 * read yet.  The cache now counts steps in 64 bits, so the rank reads the
 * peer's ack again and waits for it.
 *
 * A 2-rank segment is laid out by attach() in this process (comm rank 0);
 * rank 1 is only its control block, written by hand.  Plain C, run by
 * tests/test_c_units.py (under AddressSanitizer); shm.c is compiled in here,
 * so build with every other file of csrc/:
 *     gcc -O2 -std=gnu11 -Wall -Werror -Icsrc tests/c/test_shm_steps.c \
 *         $(ls csrc/[a-z]*.c | grep -v shm.c) -pthread -o /tmp/test_shm_steps
 * Prints one line per failure and exits 1 if anything failed, else prints
 * "all N checks passed" and exits 0.
 */
#include "../../csrc/shm.c" /* first: its _GNU_SOURCE must precede every system header */

#include "check.h"

/* A short deadline: the failing case waits for all of it. */
#define DEADLINE_MS 150

static const char *lane_name(int lane) {
    return lane == BIG ? "big" : lane == SMALL ? "small" : "medium";
}

static void begin(rl_opdesc *op) {
    memset(op, 0, sizeof *op);
    op->opcode = RL_OP_BROADCAST;
    op->seq = 1;
    op->start_ns = rl_now_ns();
    op->deadline_ns = rl_deadline_from(op->start_ns, DEADLINE_MS);
}

static void unpoison(rl_comm *c) {
    c->poisoned = 0;
    memset(&c->err, 0, sizeof c->err);
}

int main(void) {
    char what[768];
    rl_endpoint peers[2];
    memset(peers, 0, sizeof peers);
    snprintf(peers[1].host, sizeof peers[1].host, "127.0.0.1");
    peers[1].port = 1;
    rl_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.rank = 0;
    ctx.size = 2;
    ctx.peers = peers;
    int world[2] = {0, 1};
    rl_comm c;
    memset(&c, 0, sizeof c);
    c.ctx = &ctx;
    c.id = 7;
    c.rank = 0;
    c.size = 2;
    c.world = world;
    pthread_mutex_init(&c.err_lock, NULL);

    size_t size = rl_shm_segment_bytes(2);
    int fd = memfd_create("ringlet-test-shm-steps", MFD_CLOEXEC);
    check(fd >= 0 && ftruncate(fd, (off_t)size) == 0, "memfd_create and ftruncate of the segment");
    rl_error err;
    int st = attach(&c, fd, size, 1, SHM_COLL, &err);
    snprintf(what, sizeof what, "attach() lays out a 2-rank segment (%.300s)", err.msg);
    check(st == RL_OK, what);
    close(fd);
    if (st != RL_OK) return check_report();
    rl_shm *s = c.shm;
    const int P = c.size;
    int lanes = 0;

    for (int lane = BIG; lane <= MID; lane++) {
        uint32_t depth = lane == BIG ? 2 : s->pool[lane].slots;
        if (depth == 0) continue; /* no such lane with these knobs */
        lanes++;
        const char *ln = lane_name(lane);
        /* The write begins step S, more than 2^31 steps after this rank's last
         * write in the lane (step 5), when it last read the peers' acks. */
        const uint64_t S = ((uint64_t)1 << 31) + 1000;
        uint64_t *seen = s->ack_seen + (size_t)lane * (size_t)P;
        for (int q = 0; q < P; q++) seen[q] = 5;
        uint32_t *mine = lane_ack(s, 0, lane), *peer = lane_ack(s, 1, lane);

        /* A read step never waits, whatever the acks say. */
        *mine = (uint32_t)(S - 2);
        *peer = 0;
        s->step[lane] = S - 2;
        rl_opdesc op;
        uint32_t out = 0;
        begin(&op);
        st = step_begin(&c, &op, lane, 0, &out);
        snprintf(what, sizeof what, "%s lane: a read step begins at once (status %d)", ln, st);
        check(st == RL_OK && out == (uint32_t)(S - 1), what);

        /* This rank read every step so far; the peer has not finished reading
         * the step whose slot this write reuses (one short of S - depth). */
        *mine = (uint32_t)(S - 1);
        *peer = (uint32_t)(S - depth - 1);
        s->step[lane] = S - 1;
        begin(&op);
        st = step_begin(&c, &op, lane, 1, &out);
        int64_t waited_ms = (rl_now_ns() - op.start_ns) / 1000000;
        snprintf(what, sizeof what,
                 "%s lane: a write %llu steps after the last one waits for the peer one step "
                 "behind and times out (status %d, want %d: a stale cached ack let it overwrite "
                 "an unread %s)", ln, (unsigned long long)(S - 5), st, RL_ERR_TIMEOUT,
                 lane == BIG ? "buffer" : "slot");
        check(st == RL_ERR_TIMEOUT, what);
        snprintf(what, sizeof what, "%s lane: the timeout came at the deadline (%lld ms of %d)",
                 ln, (long long)waited_ms, DEADLINE_MS);
        check(st != RL_ERR_TIMEOUT || waited_ms >= DEADLINE_MS - 5, what);
        snprintf(what, sizeof what, "%s lane: the timeout blames the peer (peer %d: %.300s)", ln,
                 c.err.peer, c.err.msg);
        check(st != RL_ERR_TIMEOUT || c.err.peer == 1, what);
        unpoison(&c);

        /* The peer caught up: the same write goes ahead, and the cache says
         * through which step the peer's ack was read. */
        *peer = (uint32_t)(S - depth);
        s->step[lane] = S - 1;
        begin(&op);
        st = step_begin(&c, &op, lane, 1, &out);
        snprintf(what, sizeof what, "%s lane: with the peer's ack current the write begins "
                 "step %llu (status %d, step %u)", ln, (unsigned long long)S, st, out);
        check(st == RL_OK && out == (uint32_t)S, what);
        snprintf(what, sizeof what, "%s lane: the cached ack is step %llu in 64 bits, not %llu",
                 ln, (unsigned long long)(S - depth), (unsigned long long)seen[1]);
        check(seen[1] == S - depth && seen[0] == S - 1, what);
        unpoison(&c);
    }
    check(lanes >= 1, "at least the big lane was tested");
    rl_shm_detach(&c);
    pthread_mutex_destroy(&c.err_lock);
    return check_report();
}
