/*
 * test_connect_partial.c - unit test of the connector's handshake in
 * csrc/transport.c (connect_once) when one of its sends stops part way, which
 * a kernel does only when the connection breaks under it:
 *
 * - the HELLO cut off after 4 bytes by a reset: the acceptor never read it
 *   whole, so this is an eviction and the connector retries (and connects);
 *   it must not look at the reply it never received.  Run under valgrind
 *   (tests/test_c_units.py does), that look is an uninitialised read;
 * - the HELLO cut off by another error: that status, naming the HELLO;
 * - our proof cut off by a reset: the peer closed the connection.
 *
 * The sends are cut by a wrapper around send(): link with -Wl,--wrap=send.
 * Both ranks are contexts of this process, so the acceptor is the real one.
 *     gcc -O0 -g -std=gnu11 -Wall -Werror -Icsrc tests/c/test_connect_partial.c \
 *         csrc/[a-z]*.c -pthread -Wl,--wrap=send -o /tmp/test_connect_partial \
 *         && valgrind -q --error-exitcode=99 /tmp/test_connect_partial
 * Prints one line per failure and exits 1 if anything failed, else prints
 * "all N checks passed" and exits 0.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "internal.h"
#include "check.h"

#define DEADLINE_MS 5000

/* The connector's next send of a `len`-byte handshake frame puts out `pass`
 * bytes; its next send on that socket then fails with `err`.  Only sends
 * with flags MSG_NOSIGNAL alone are cut: the connector's handshake makes
 * those, the listener thread adds MSG_DONTWAIT to its own. */
static struct {
    int armed, cutting, fd, err;
    size_t len, pass;
} fault;

ssize_t __real_send(int fd, const void *buf, size_t len, int flags);

ssize_t __wrap_send(int fd, const void *buf, size_t len, int flags) {
    if (flags == MSG_NOSIGNAL) {
        if (fault.armed && len == fault.len) {
            fault.armed = 0;
            fault.cutting = 1;
            fault.fd = fd;
            if (fault.pass) return __real_send(fd, buf, fault.pass, flags);
        }
        if (fault.cutting && fd == fault.fd) {
            fault.cutting = 0;
            errno = fault.err;
            return -1;
        }
    }
    return __real_send(fd, buf, len, flags);
}

static void arm(size_t len, size_t pass, int err) {
    fault.len = len;
    fault.pass = pass;
    fault.err = err;
    fault.cutting = 0;
    fault.armed = 1;
}

/* Comm rank 0 of world ranks {0, 1} on ctx0 connects to ctx1's listener,
 * with the fault armed; returns the status, the comm's error in *err. */
static int connect_with_fault(rl_ctx *ctx0, uint32_t comm_id, size_t len, size_t pass,
                              int e, rl_error *err) {
    static const int world[2] = {0, 1};
    rl_comm *c = NULL;
    int st = rl_comm_create(&c, ctx0, comm_id, 0, 2, world, err);
    check(st == RL_OK && c, "rl_comm_create");
    if (!c) return st;
    arm(len, pass, e);
    st = rl_comm_connect(c, 1, DEADLINE_MS);
    check(!fault.armed && !fault.cutting, "the armed send was made and cut");
    fault.armed = 0;
    *err = c->err;
    rl_comm_destroy(c);
    return st;
}

int main(void) {
    char what[1024];
    uint8_t secret[32], job[16];
    memset(secret, 7, sizeof secret);
    memset(job, 9, sizeof job);
    rl_ctx *ctx0 = NULL, *ctx1 = NULL;
    rl_error err;
    int st = rl_ctx_create(&ctx0, 0, 2, "127.0.0.1", secret, sizeof secret, job, &err);
    check(st == RL_OK, "rl_ctx_create (rank 0)");
    st = rl_ctx_create(&ctx1, 1, 2, "127.0.0.1", secret, sizeof secret, job, &err);
    check(st == RL_OK, "rl_ctx_create (rank 1)");
    if (!ctx0 || !ctx1) {
        rl_ctx_destroy(ctx0);
        rl_ctx_destroy(ctx1);
        return check_report();
    }
    rl_ctx_set_peer(ctx0, 1, "127.0.0.1", rl_ctx_port(ctx1));

    /* 68: HELLO_LEN in transport.c; 32: the proof. */
    st = connect_with_fault(ctx0, 11, 68, 4, EPIPE, &err);
    snprintf(what, sizeof what, "a HELLO reset after 4 bytes is retried and connects "
             "(status %d: %.300s)", st, err.msg);
    check(st == RL_OK, what);

    st = connect_with_fault(ctx0, 12, 68, 4, EIO, &err);
    snprintf(what, sizeof what, "a HELLO cut by EIO fails as a system error naming the HELLO "
             "(status %d, errno %d: %.300s)", st, err.sys_errno, err.msg);
    check(st == RL_ERR_SYSTEM && err.sys_errno == EIO && strstr(err.msg, "sending our HELLO"),
          what);

    st = connect_with_fault(ctx0, 13, 32, 4, EPIPE, &err);
    snprintf(what, sizeof what, "a proof reset after 4 bytes is a closed peer (status %d: %.300s)",
             st, err.msg);
    check(st == RL_ERR_PEER_CLOSED && strstr(err.msg, "sending our proof"), what);

    rl_ctx_destroy(ctx0);
    rl_ctx_destroy(ctx1);
    return check_report();
}
