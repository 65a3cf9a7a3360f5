/*
 * kernel_bench.c - throughput of rl_reduce_kernel (float32 SUM) on 64 MiB
 * buffers next to memcpy of the same size, to show whether the kernel runs
 * at memory bandwidth.
 *
 * Build and run (same flags as setup.py: -O3, no -march):
 *     gcc -O3 -std=gnu11 -Wall -Wextra -Icsrc bench/c/kernel_bench.c \
 *         csrc/kernels.c -o /tmp/kernel_bench && /tmp/kernel_bench
 * RINGLET_SIMD=baseline measures the portable path instead.
 *
 * Each figure is the median of 11 timed runs after one warm-up run.
 * Bytes counted:
 *   reduce:  3 x 64 MiB per run (read a, read b, write dst), and elements/s;
 *            also measured in place (dst == a, what the collectives do), where
 *            2 x 64 MiB are read and 64 MiB written all the same.
 *   memcpy:  64 MiB copied per run, and the 2 x 64 MiB it touches.
 * Write-allocate traffic (the cache reading dst before writing it) is not
 * counted in either, so the two are comparable.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ringlet.h"

#define RUNS 11
#define BYTES ((size_t)64 << 20)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static double median(double *t) {
    qsort(t, RUNS, sizeof *t, cmp_double);
    return t[RUNS / 2];
}

static float *alloc_f32(size_t n, float value) {
    float *p = aligned_alloc(64, n * sizeof *p);
    if (!p) {
        fprintf(stderr, "kernel_bench: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++) p[i] = value + (float)(i & 1023); /* fault pages in */
    return p;
}

/* Median seconds of rl_reduce_kernel(dst, a, b) over RUNS runs. */
static double time_reduce(float *dst, const float *a, const float *b, size_t n) {
    double t[RUNS];
    rl_reduce_kernel(dst, a, b, n, RL_F32, RL_SUM); /* warm-up */
    for (int r = 0; r < RUNS; r++) {
        double t0 = now_s();
        rl_reduce_kernel(dst, a, b, n, RL_F32, RL_SUM);
        t[r] = now_s() - t0;
    }
    return median(t);
}

int main(void) {
    size_t n = BYTES / sizeof(float);
    float *a = alloc_f32(n, 1.0f), *b = alloc_f32(n, 2.0f), *d = alloc_f32(n, 0.0f);
    const double mib = (double)BYTES / (1 << 20), gb = (double)BYTES / 1e9;

    double tr = time_reduce(d, a, b, n);
    /* In place, as the collectives call it.  Values grow by b each run; they
     * stay finite (at most ~1e4 after 12 runs), so no slow path is hit. */
    double ti = time_reduce(a, a, b, n);

    double tm[RUNS];
    memcpy(d, b, BYTES); /* warm-up */
    for (int r = 0; r < RUNS; r++) {
        double t0 = now_s();
        memcpy(d, b, BYTES);
        tm[r] = now_s() - t0;
        /* Keep the copy observable so it cannot be optimised away. */
        if (d[r] != b[r]) return 1;
    }
    double tc = median(tm);

    printf("simd path: %s\n", rl_simd_info());
    printf("rl_reduce_kernel f32 SUM  %.0f MiB x 3: %7.2f ms  %6.2f Gelem/s  %6.2f GB/s touched"
           " (a, b read + dst written)\n",
           mib, tr * 1e3, (double)n / tr / 1e9, 3 * gb / tr);
    printf("rl_reduce_kernel f32 SUM in place (dst == a): %7.2f ms  %6.2f Gelem/s  %6.2f GB/s "
           "touched\n",
           ti * 1e3, (double)n / ti / 1e9, 3 * gb / ti);
    printf("memcpy %.0f MiB:                    %7.2f ms  %6.2f GB/s copied  %6.2f GB/s touched"
           " (read + written)\n",
           mib, tc * 1e3, gb / tc, 2 * gb / tc);
    free(a);
    free(b);
    free(d);
    return 0;
}
