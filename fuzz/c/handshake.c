/*
 * handshake.c - libFuzzer harness: arbitrary bytes into the listener's
 * HELLO / proof state machine (transport.c, hs_step) over real loopback TCP.
 *
 * A real rl_ctx (world rank 1 of 4) listens; each input opens a connection,
 * sends a HELLO and a proof taken from the input, closes its write side and
 * reads whatever the listener answers until it closes.  Checked on every
 * input: the listener answers within a bound (never waits for its handshake
 * deadline once the client has closed), its reply MAC is the one the
 * protocol defines, and a connection is accepted only with a valid HELLO and
 * the right proof.
 *
 * Input: flags u8 | hello (up to 68 bytes) | proof and trailing bytes...
 *   flags bit 0: send the correct proof (computed here) instead of input bytes
 *   flags bit 1: overwrite the HELLO's job id with the right one
 *   flags bit 2: send the HELLO in two writes
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "internal.h"

#define HELLO_LEN 68
#define MY_RANK 1
#define WORLD 4
static const uint8_t SECRET[] = "fuzz-secret";

static rl_ctx *ctx;
static uint8_t key[32];
static const uint8_t JOB[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

static void init_once(void) {
    if (ctx) return;
    rl_error err;
    if (rl_ctx_create(&ctx, MY_RANK, WORLD, "127.0.0.1", SECRET, sizeof SECRET - 1, JOB,
                      &err) != RL_OK) {
        fprintf(stderr, "handshake fuzzer: rl_ctx_create: %s\n", err.msg);
        abort();
    }
    rl_sha256(SECRET, sizeof SECRET - 1, key);
}

static void mac(const char *label, const uint8_t *hello, const uint8_t *nonce_b,
                uint8_t out[32]) {
    uint8_t msg[16 + HELLO_LEN + 32];
    size_t ll = strlen(label);
    memcpy(msg, label, ll);
    memcpy(msg + ll, hello, HELLO_LEN);
    memcpy(msg + ll + HELLO_LEN, nonce_b, 32);
    rl_hmac_sha256(key, sizeof key, msg, ll + HELLO_LEN + 32, out);
}

static void send_all(int fd, const uint8_t *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue; /* libFuzzer's timer signals */
        if (w <= 0) return; /* the listener may close on us: that is its right */
        p += w;
        n -= (size_t)w;
    }
}

/* Read up to n bytes until EOF; a read that times out means the listener
 * kept a closed client waiting. */
static size_t recv_upto(int fd, uint8_t *p, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, p + got, n - got, 0);
        if (r == 0) break;
        if (r < 0) {
            if (errno == EINTR) continue; /* libFuzzer's timer signals */
            if (errno == ECONNRESET) break;
            fprintf(stderr, "handshake fuzzer: no answer from the listener (%s)\n",
                    strerror(errno));
            abort();
        }
        got += (size_t)r;
    }
    return got;
}

static int hello_valid(const uint8_t *h) {
    uint32_t magic, src, dst;
    uint16_t ver, kind;
    memcpy(&magic, h, 4);
    memcpy(&ver, h + 4, 2);
    memcpy(&kind, h + 6, 2);
    memcpy(&src, h + 28, 4);
    memcpy(&dst, h + 32, 4);
    return magic == RL_HANDSHAKE_MAGIC && ver == RL_PROTOCOL_VERSION && kind == 1 &&
           memcmp(h + 8, JOB, 16) == 0 && dst == MY_RANK && src < WORLD && src != MY_RANK;
}

/* A fresh connection to the listener, or -1 when the host has no local port left.
 * A signal (libFuzzer's timers) can interrupt connect(): start over on a new socket. */
static int connect_listener(void) {
    for (int attempt = 0; attempt < 100; attempt++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) abort();
        struct timeval tv = {10, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        /* Close with a reset: a hundred thousand inputs would otherwise leave as
         * many ports in TIME_WAIT and run the host out of ephemeral ports. */
        struct linger lg = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        struct sockaddr_in sa;
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_port = htons((uint16_t)rl_ctx_port(ctx));
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) return fd;
        int e = errno;
        close(fd);
        if (e == EADDRNOTAVAIL) return -1;
        if (e != EINTR) {
            fprintf(stderr, "handshake fuzzer: connect to the listener failed: %s\n", strerror(e));
            abort();
        }
    }
    fprintf(stderr, "handshake fuzzer: connect interrupted 100 times in a row\n");
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    init_once();
    if (size < 1) return 0;
    int flags = data[0];
    data++;
    size--;
    uint8_t hello[HELLO_LEN];
    size_t hl = size < HELLO_LEN ? size : HELLO_LEN;
    memcpy(hello, data, hl);
    if ((flags & 2) && hl >= 24) memcpy(hello + 8, JOB, 16);
    const uint8_t *rest = data + hl;
    size_t nrest = size - hl;

    int fd = connect_listener();
    if (fd < 0) return 0; /* out of local ports: the host's limit, not the listener's fault */

    if ((flags & 4) && hl > 1) {
        send_all(fd, hello, hl / 2);
        send_all(fd, hello + hl / 2, hl - hl / 2);
    } else {
        send_all(fd, hello, hl);
    }
    int accepted = 0;
    if (hl < HELLO_LEN) {
        shutdown(fd, SHUT_WR);
        uint8_t junk[64];
        if (recv_upto(fd, junk, sizeof junk) != 0) {
            fprintf(stderr, "handshake fuzzer: the listener answered a short HELLO\n");
            abort();
        }
    } else {
        uint8_t reply[64];
        size_t got = recv_upto(fd, reply, sizeof reply);
        if (!hello_valid(hello)) {
            /* The only answer to a wrong HELLO is the 4-byte refusal (status 3). */
            uint32_t refusal = 0;
            if (got == 4) memcpy(&refusal, reply, 4);
            if (got != 0 && !(got == 4 && refusal == 3)) {
                fprintf(stderr, "handshake fuzzer: the listener answered an invalid HELLO\n");
                abort();
            }
            got = 0;
        } else if (got != 0 && got != sizeof reply) {
            abort();
        }
        if (!got && hello_valid(hello)) {
            fprintf(stderr, "handshake fuzzer: the listener dropped a valid HELLO\n");
            abort();
        }
        if (got) {
            uint8_t expect[32], proof[32];
            mac("ringlet/acc", hello, reply, expect);
            if (memcmp(expect, reply + 32, 32) != 0) {
                fprintf(stderr, "handshake fuzzer: the listener's proof is wrong\n");
                abort();
            }
            int good = flags & 1;
            if (good) {
                mac("ringlet/con", hello, reply, proof);
                send_all(fd, proof, 32);
            }
            send_all(fd, rest, nrest);
            shutdown(fd, SHUT_WR);
            uint8_t status[4];
            size_t sg = recv_upto(fd, status, 4);
            uint32_t st = 0;
            memcpy(&st, status, 4);
            if (sg == 4 && st == 0) {
                accepted = 1;
                if (!good) {
                    /* Only the right proof may pass; the input cannot hold
                     * one for a nonce it never saw. */
                    fprintf(stderr, "handshake fuzzer: accepted a wrong proof\n");
                    abort();
                }
            } else if (good && (sg != 4 || st != 2)) {
                fprintf(stderr, "handshake fuzzer: right proof refused with status %u\n", st);
                abort();
            }
        }
    }
    close(fd);
    /* An accepted connection waits in the mailbox for a comm: take it back,
     * and keep the duplicate-claim table small. */
    pthread_mutex_lock(&ctx->lock);
    if (accepted && !ctx->mailbox) {
        pthread_mutex_unlock(&ctx->lock);
        fprintf(stderr, "handshake fuzzer: accepted but not delivered\n");
        abort();
    }
    for (rl_pending_conn *p = ctx->mailbox, *n; p; p = n) {
        n = p->next;
        close(p->fd);
        free(p);
    }
    ctx->mailbox = NULL;
    if (ctx->nclaimed > 1024) ctx->nclaimed = 0;
    pthread_mutex_unlock(&ctx->lock);
    return 0;
}
