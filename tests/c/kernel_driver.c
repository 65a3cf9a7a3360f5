/*
 * kernel_driver.c - runs csrc/kernels.c on data from a file, for
 * tests/test_c_units.py (which checks the results against numpy).  Needs no
 * Python extension: build it with
 *     gcc -O2 -std=gnu11 -Icsrc tests/c/kernel_driver.c csrc/kernels.c
 *
 * Usage:
 *   kernel_driver run IN OUT   IN is a sequence of records, native byte order:
 *        int32 kind (1 = reduce, 2 = scale), int32 dtype, int32 op,
 *        int32 alias (reduce: 0 = separate dst, 1 = dst is a, 2 = dst is b),
 *        uint64 n, float64 factor (scale only), int32 misalign, int32 pad,
 *        then n elements of a (and, for reduce, n elements of b).
 *      For each record OUT receives the n result elements.  Every buffer is
 *      placed `misalign` elements past a 64-byte boundary, and is followed by
 *      guard bytes that must survive the call (so a vector tail that writes
 *      past n is caught).  n == 0 passes NULL pointers.
 *   kernel_driver table        prints rl_op_valid, rl_dtype_size and the names
 *      for every dtype in -1..RL_NDTYPES and op in -1..RL_NOPS, and
 *      rl_simd_info().
 * Exits 0 on success, 1 with a message on stderr otherwise.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ringlet.h"

#define GUARD 64
#define GUARD_BYTE 0xa5

typedef struct {
    int32_t kind, dtype, op, alias;
    uint64_t n;
    double factor;
    int32_t misalign, pad;
} record;

static void die(const char *msg) {
    fprintf(stderr, "kernel_driver: %s\n", msg);
    exit(1);
}

static void read_exact(FILE *f, void *p, size_t len) {
    if (len && fread(p, 1, len, f) != len) die("truncated input record");
}

/* A buffer of len bytes at `misalign` bytes past a 64-byte boundary, followed
 * by GUARD guard bytes.  Returns the data pointer; *base gets what to free. */
static unsigned char *guarded(size_t len, size_t misalign, unsigned char **base) {
    unsigned char *b = aligned_alloc(64, ((misalign + len + GUARD + 63) / 64) * 64);
    if (!b) die("out of memory");
    *base = b;
    memset(b + misalign + len, GUARD_BYTE, GUARD);
    return b + misalign;
}

static void check_guard(const unsigned char *p, size_t len, const char *what) {
    for (size_t i = 0; i < GUARD; i++)
        if (p[len + i] != GUARD_BYTE) {
            fprintf(stderr, "kernel_driver: %s wrote past the end of %s\n",
                    "kernel", what);
            exit(1);
        }
}

static int run(const char *in_path, const char *out_path) {
    FILE *in = fopen(in_path, "rb");
    FILE *out = fopen(out_path, "wb");
    if (!in || !out) die("cannot open input or output file");
    record r;
    while (fread(&r, sizeof r, 1, in) == 1) {
        size_t esz = rl_dtype_size((rl_dtype)r.dtype);
        if (esz == 0) die("record has an invalid dtype");
        size_t len = (size_t)r.n * esz;
        size_t mis = (size_t)(r.misalign & 7) * esz;
        unsigned char *ba, *bb = NULL, *bd = NULL;
        unsigned char *a = guarded(len, mis, &ba);
        read_exact(in, a, len);
        if (r.kind == 2) {
            rl_scale_kernel(r.n ? a : NULL, r.n, (rl_dtype)r.dtype, r.factor);
            check_guard(a, len, "the scaled buffer");
            if (len && fwrite(a, 1, len, out) != len) die("write failed");
        } else if (r.kind == 1) {
            unsigned char *b = guarded(len, mis, &bb);
            read_exact(in, b, len);
            unsigned char *d;
            if (r.alias == 1) d = a;
            else if (r.alias == 2) d = b;
            else {
                d = guarded(len, mis, &bd);
                memset(d, 0x5a, len); /* garbage: the kernel must overwrite it */
            }
            if (r.n == 0) rl_reduce_kernel(NULL, NULL, NULL, 0, (rl_dtype)r.dtype, (rl_redop)r.op);
            else rl_reduce_kernel(d, a, b, r.n, (rl_dtype)r.dtype, (rl_redop)r.op);
            check_guard(a, len, "a");
            check_guard(b, len, "b");
            check_guard(d, len, "dst");
            if (len && fwrite(d, 1, len, out) != len) die("write failed");
        } else {
            die("record has an unknown kind");
        }
        free(ba);
        free(bb);
        free(bd);
    }
    if (!feof(in)) die("read error");
    fclose(in);
    if (fclose(out) != 0) die("write failed");
    return 0;
}

static int table(void) {
    for (int dt = -1; dt <= RL_NDTYPES; dt++) {
        printf("dtype %d %s %zu\n", dt, rl_dtype_name((rl_dtype)dt), rl_dtype_size((rl_dtype)dt));
        for (int op = -1; op <= RL_NOPS; op++)
            printf("valid %d %d %d\n", dt, op, rl_op_valid((rl_dtype)dt, (rl_redop)op));
    }
    for (int op = -1; op <= RL_NOPS; op++) printf("op %d %s\n", op, rl_op_name((rl_redop)op));
    printf("simd %s\n", rl_simd_info());
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "run") == 0) return run(argv[2], argv[3]);
    if (argc == 2 && strcmp(argv[1], "table") == 0) return table();
    fprintf(stderr, "usage: %s run IN OUT | %s table\n", argv[0], argv[0]);
    return 2;
}
