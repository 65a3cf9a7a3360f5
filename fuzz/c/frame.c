/*
 * frame.c - libFuzzer harness: arbitrary bytes from a peer into the frame
 * decoders of the C core (the engine's rl_check_header / abort path for
 * collectives, and p2p.c's header parse and unexpected-frame buffering).
 *
 * Comm rank 0 of a real 2-rank communicator runs one operation while
 * everything "rank 1 sends" is the fuzz input, written into the other end of
 * a socketpair that stands in for the authenticated connection, then closed
 * for writing.  The op must end with RL_OK or a clean error status and never
 * hang (the peer's EOF ends every wait at once) or touch memory it should not
 * (AddressSanitizer / UBSan).
 *
 * Input: op u8 | dtype u8 | count u8 | tag u32 | peer's bytes...
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"

#define NOPS_FUZZED 11
#define TIMEOUT_MS 20000
#define HANG_NS 5e9

static rl_ctx *ctx;

static void init_once(void) {
    if (ctx) return;
    /* Small thresholds and segments so a few bytes of input reach the
     * segmented and pipelined algorithms as well as the latency ones. */
    rl_tuning t;
    rl_tuning_defaults(&t);
    t.segment_bytes = 64;
    t.allreduce_small_bytes = 128;
    t.bcast_small_bytes = 128;
    t.reduce_small_bytes = 128;
    t.spin_us = 0;
    t.p2p_unexpected_bytes = 1 << 16;
    rl_set_tuning(&t);
    uint8_t job[16] = {0};
    rl_error err;
    if (rl_ctx_create(&ctx, 0, 2, "127.0.0.1", (const uint8_t *)"fuzz", 4, job, &err) != RL_OK) {
        fprintf(stderr, "frame fuzzer: rl_ctx_create: %s\n", err.msg);
        abort();
    }
}

static void run_op(rl_comm *c, int op, rl_dtype dt, size_t count, uint32_t tag) {
    size_t es = rl_dtype_size(dt), n = count * es;
    /* Two ranks: buffers of 2 blocks cover every op's largest argument. */
    char *a = calloc(2 * n + 1, 1), *b = calloc(2 * n + 1, 1);
    if (!a || !b) abort();
    rl_redop rop = rl_op_valid(dt, RL_SUM) ? RL_SUM : RL_MAX;
    int st;
    int64_t t0 = rl_now_ns();
    switch (op) {
    case 0: st = rl_recv(c, a, count, dt, 1, tag, TIMEOUT_MS); break;
    case 1: st = rl_all_reduce(c, a, count, dt, rop, TIMEOUT_MS); break;
    case 2: st = rl_broadcast(c, a, count, dt, 1, TIMEOUT_MS); break;
    case 3: st = rl_reduce(c, a, count, dt, rop, 0, TIMEOUT_MS); break;
    case 4: st = rl_all_gather(c, a, b, count, dt, TIMEOUT_MS); break;
    case 5: st = rl_reduce_scatter(c, a, b, count, dt, rop, TIMEOUT_MS); break;
    case 6: st = rl_all_to_all(c, a, b, count, dt, TIMEOUT_MS); break;
    case 7: st = rl_gather(c, a, b, count, dt, 0, TIMEOUT_MS); break;
    case 8: st = rl_scatter(c, a, b, count, dt, 1, TIMEOUT_MS); break;
    case 9: st = rl_barrier(c, TIMEOUT_MS); break;
    default:
        /* Two receives: frames of the second tag that arrive first are
         * buffered as unexpected, then matched. */
        st = rl_recv(c, a, count, dt, 1, tag + 1, TIMEOUT_MS);
        if (st == RL_OK) st = rl_recv(c, a, count, dt, 1, tag, TIMEOUT_MS);
        break;
    }
    if (getenv("RINGLET_FUZZ_VERBOSE"))
        fprintf(stderr, "op %d dtype %d count %zu: status %d %s\n", op, (int)dt, count, st,
                rl_comm_error(c)->msg);
    if (rl_now_ns() - t0 > (int64_t)HANG_NS) {
        /* The peer's EOF is there from the start: a wait is a hang. */
        fprintf(stderr, "frame fuzzer: op %d took %.1f s: %s\n", op, (rl_now_ns() - t0) / 1e9,
                rl_comm_error(c)->msg);
        abort();
    }
    /* An ABORT frame carries the sender's failure class (timeout, peer
     * closed, desync, auth, protocol: engine.c keeps them); anything else is
     * not something a peer's bytes should cause. */
    if (st != RL_OK && st != RL_ERR_PEER_CLOSED && st != RL_ERR_PROTOCOL &&
        st != RL_ERR_DESYNC && st != RL_ERR_ABORTED && st != RL_ERR_AUTH &&
        st != RL_ERR_TIMEOUT) {
        fprintf(stderr, "frame fuzzer: op %d returned status %d: %s\n", op, st,
                rl_comm_error(c)->msg);
        abort();
    }
    if (st != RL_OK && rl_comm_error(c)->msg[0] == 0) {
        fprintf(stderr, "frame fuzzer: op %d failed with status %d but no message\n", op, st);
        abort();
    }
    free(a);
    free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    init_once();
    if (size < 7) return 0;
    int op = data[0] % NOPS_FUZZED;
    rl_dtype dt = (rl_dtype)(data[1] % RL_NDTYPES);
    size_t count = data[2];
    uint32_t tag;
    memcpy(&tag, data + 3, 4);
    data += 7;
    size -= 7;

    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) abort();
    int big = 1 << 20;
    (void)setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    (void)setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    /* The peer's bytes are all in flight before the op starts. */
    for (size_t off = 0; off < size;) {
        ssize_t w = send(sv[1], data + off, size - off, MSG_NOSIGNAL);
        if (w <= 0) abort();
        off += (size_t)w;
    }
    shutdown(sv[1], SHUT_WR);

    rl_comm *c;
    rl_error err;
    int world[2] = {0, 1};
    if (rl_comm_create(&c, ctx, 7, 0, 2, world, &err) != RL_OK) abort();
    c->fds[1] = sv[0]; /* the only step the public API cannot take */
    if (fcntl(sv[0], F_SETFL, O_NONBLOCK) != 0) abort();
    run_op(c, op, dt, count, tag);
    rl_comm_destroy(c); /* closes sv[0] */
    close(sv[1]);
    return 0;
}

#ifdef FRAME_MAKE_SEEDS
/* Seed maker: rank 1 runs the same op for real on a second context, and
 * whatever it sends to rank 0 (through a relay thread that records it) is
 * the seed.  `make_seeds DIR` writes one file per (op, dtype, count). */
#include <poll.h>
#include <pthread.h>

typedef struct {
    int a, b;      /* relay ends: a faces rank 0, b faces rank 1 */
    uint8_t *rec;  /* what rank 1 sent */
    size_t nrec, cap;
} relay;

static void *relay_main(void *arg) {
    relay *r = arg;
    int open_a = 1, open_b = 1;
    char buf[65536];
    while (open_a || open_b) {
        struct pollfd p[2] = {{open_a ? r->a : -1, POLLIN, 0}, {open_b ? r->b : -1, POLLIN, 0}};
        if (poll(p, 2, 10000) <= 0) break;
        if (p[0].revents) {
            ssize_t n = recv(r->a, buf, sizeof buf, 0);
            if (n <= 0) { open_a = 0; shutdown(r->b, SHUT_WR); }
            else if (send(r->b, buf, (size_t)n, MSG_NOSIGNAL) != n) open_a = 0;
        }
        if (p[1].revents) {
            ssize_t n = recv(r->b, buf, sizeof buf, 0);
            if (n <= 0) { open_b = 0; shutdown(r->a, SHUT_WR); continue; }
            if (r->nrec + (size_t)n > r->cap &&
                !(r->rec = realloc(r->rec, r->cap = (r->nrec + (size_t)n) * 2))) abort();
            memcpy(r->rec + r->nrec, buf, (size_t)n);
            r->nrec += (size_t)n;
            if (send(r->a, buf, (size_t)n, MSG_NOSIGNAL) != n) open_b = 0;
        }
    }
    return NULL;
}

typedef struct { rl_comm *c; int op; rl_dtype dt; size_t count; uint32_t tag; int st; } peer_job;

static void *peer_main(void *arg) {
    peer_job *j = arg;
    size_t n = j->count * rl_dtype_size(j->dt);
    char *a = calloc(2 * n + 1, 1), *b = calloc(2 * n + 1, 1);
    rl_redop rop = rl_op_valid(j->dt, RL_SUM) ? RL_SUM : RL_MAX;
    rl_comm *c = j->c;
    switch (j->op) {
    case 0: j->st = rl_send(c, a, j->count, j->dt, 0, j->tag, TIMEOUT_MS); break;
    case 1: j->st = rl_all_reduce(c, a, j->count, j->dt, rop, TIMEOUT_MS); break;
    case 2: j->st = rl_broadcast(c, a, j->count, j->dt, 1, TIMEOUT_MS); break;
    case 3: j->st = rl_reduce(c, a, j->count, j->dt, rop, 0, TIMEOUT_MS); break;
    case 4: j->st = rl_all_gather(c, a, b, j->count, j->dt, TIMEOUT_MS); break;
    case 5: j->st = rl_reduce_scatter(c, a, b, j->count, j->dt, rop, TIMEOUT_MS); break;
    case 6: j->st = rl_all_to_all(c, a, b, j->count, j->dt, TIMEOUT_MS); break;
    case 7: j->st = rl_gather(c, a, b, j->count, j->dt, 0, TIMEOUT_MS); break;
    case 8: j->st = rl_scatter(c, a, b, j->count, j->dt, 1, TIMEOUT_MS); break;
    case 9: j->st = rl_barrier(c, TIMEOUT_MS); break;
    case 10:
        j->st = rl_send(c, a, j->count, j->dt, 0, j->tag, TIMEOUT_MS);
        if (j->st == RL_OK) j->st = rl_send(c, a, j->count, j->dt, 0, j->tag + 1, TIMEOUT_MS);
        break;
    default: rl_comm_abort(c, RL_ERR_DESYNC, "seed: rank 1 gives up"); j->st = RL_OK; break;
    }
    free(a);
    free(b);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s OUTDIR\n", argv[0]); return 2; }
    init_once();
    rl_ctx *ctx1;
    rl_error err;
    uint8_t job[16] = {0};
    if (rl_ctx_create(&ctx1, 1, 2, "127.0.0.1", (const uint8_t *)"fuzz", 4, job, &err)) abort();
    static const struct { rl_dtype dt; size_t count; } shapes[] = {
        {RL_F32, 0}, {RL_F32, 3}, {RL_F32, 40}, {RL_I64, 33}, {RL_U8, 200}};
    int made = 0;
    for (int op = 0; op <= NOPS_FUZZED; op++) {
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            int p[2], q[2];
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, p) ||
                socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, q)) abort();
            relay r = {p[1], q[1], NULL, 0, 0};
            rl_comm *c0, *c1;
            int world[2] = {0, 1};
            if (rl_comm_create(&c0, ctx, 7, 0, 2, world, &err) ||
                rl_comm_create(&c1, ctx1, 7, 1, 2, world, &err)) abort();
            c0->fds[1] = p[0];
            c1->fds[0] = q[0];
            fcntl(p[0], F_SETFL, O_NONBLOCK);
            fcntl(q[0], F_SETFL, O_NONBLOCK);
            uint32_t tag = 5;
            /* op NOPS_FUZZED: rank 1 aborts while rank 0 runs an all_reduce. */
            int op0 = op == NOPS_FUZZED ? 1 : op;
            peer_job j = {c1, op, shapes[k].dt, shapes[k].count, tag, 0};
            pthread_t rt, pt;
            pthread_create(&rt, NULL, relay_main, &r);
            pthread_create(&pt, NULL, peer_main, &j);
            run_op(c0, op0, shapes[k].dt, shapes[k].count, tag);
            pthread_join(pt, NULL);
            if (j.st != RL_OK) {
                fprintf(stderr, "seed op %d: rank 1 failed: %s\n", op, rl_comm_error(c1)->msg);
                return 1;
            }
            rl_comm_destroy(c1);
            rl_comm_destroy(c0);
            pthread_join(rt, NULL);
            close(p[1]);
            close(q[1]);
            uint8_t head[7] = {(uint8_t)op0, (uint8_t)shapes[k].dt, (uint8_t)shapes[k].count};
            memcpy(head + 3, &tag, 4);
            char path[4096];
            snprintf(path, sizeof path, "%s/op%02d_dt%d_n%zu", argv[1], op, shapes[k].dt,
                     shapes[k].count);
            FILE *f = fopen(path, "wb");
            if (!f) { perror(path); return 1; }
            fwrite(head, 1, 7, f);
            if (r.nrec) fwrite(r.rec, 1, r.nrec, f);
            fclose(f);
            free(r.rec);
            made++;
        }
    }
    rl_ctx_destroy(ctx1);
    printf("wrote %d seeds\n", made);
    return 0;
}
#endif
