/*
 * test_scratch.c - unit test of rl_scratch (csrc/transport.c): the staging
 * area starts half a page from the user buffer it serves, holds the bytes
 * asked for at every such offset, grows and is reused, and an impossible
 * size fails with RL_ERR_NOMEM and a message.  Plain C, run by
 * tests/test_c_units.py (under AddressSanitizer where gcc has it, which turns
 * a write past the area into a failure); by hand:
 *     gcc -O2 -std=gnu11 -Wall -Werror -Icsrc tests/c/test_scratch.c csrc/[a-z]*.c \
 *         -pthread -o /tmp/test_scratch && /tmp/test_scratch
 * Prints one line per failure and exits 1 if anything failed, else prints
 * "all N checks passed" and exits 0.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "check.h"

int main(void) {
    rl_comm c;
    rl_opdesc op;
    memset(&c, 0, sizeof c);
    memset(&op, 0, sizeof op);
    pthread_mutex_init(&c.err_lock, NULL);
    char what[160];

    /* A page-aligned "user buffer" to take offsets from. */
    char *user = NULL;
    if (posix_memalign((void **)&user, 4096, 8192) != 0) {
        check(0, "posix_memalign for the user buffer");
        return 1;
    }
    static const size_t offs[] = {0, 1, 16, 64, 2047, 2048, 2049, 4032, 4095};
    static const size_t lens[] = {1, 100, 4096, 65536, 65537, (size_t)1 << 20};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        for (size_t oi = 0; oi < sizeof offs / sizeof offs[0]; oi++) {
            size_t len = lens[li], off = offs[oi];
            char *p = NULL;
            int st = rl_scratch(&c, &op, len, user + off, &p);
            snprintf(what, sizeof what, "rl_scratch(len %zu, near page + %zu) returns RL_OK", len, off);
            check(st == RL_OK && p != NULL, what);
            if (st != RL_OK || !p) continue;
            size_t got = (size_t)((uintptr_t)p % 4096), want = (off + 2048) % 4096;
            snprintf(what, sizeof what,
                     "rl_scratch(len %zu, near page + %zu): starts at page + %zu, not %zu",
                     len, off, got, want);
            check(got == want, what);
            snprintf(what, sizeof what, "rl_scratch(len %zu, near page + %zu): inside the block",
                     len, off);
            check(p >= c.scratch && c.scratch_len >= len, what);
            /* Every byte asked for is usable (ASan flags a write past the block). */
            memset(p, (int)(0x40 + oi), len);
            int same = 1;
            for (size_t i = 0; i < len; i += 4093) same &= p[i] == (char)(0x40 + oi);
            same &= p[len - 1] == (char)(0x40 + oi);
            snprintf(what, sizeof what, "rl_scratch(len %zu, near page + %zu): holds len bytes",
                     len, off);
            check(same, what);
        }
    }
    /* Without a user buffer the area starts on a page; a smaller request
     * reuses the block instead of allocating again. */
    char *big = c.scratch, *p = NULL;
    check(rl_scratch(&c, &op, 10, NULL, &p) == RL_OK && p == big && (uintptr_t)p % 4096 == 0,
          "rl_scratch(near NULL): the block's start, on a page, no new block");
    check(c.scratch_len == (size_t)1 << 20, "rl_scratch: a smaller request keeps the block");

    /* An impossible size fails cleanly and leaves no block behind. */
    p = NULL;
    int st = rl_scratch(&c, &op, SIZE_MAX - 100, user, &p);
    check(st == RL_ERR_NOMEM, "rl_scratch(SIZE_MAX - 100) returns RL_ERR_NOMEM");
    check(c.scratch == NULL && c.scratch_len == 0, "rl_scratch: a failed growth leaves no block");
    check(strstr(c.err.msg, "scratch") != NULL, "rl_scratch: the failure says what it was");

    free(c.scratch);
    free(user);
    return check_report();
}
