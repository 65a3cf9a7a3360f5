/*
 * check.h - the tiny harness of the C unit-test programs in tests/c/: count
 * checks, print each failure, and end with one summary line and exit code.
 */
#ifndef RL_TEST_CHECK_H
#define RL_TEST_CHECK_H

#include <stdio.h>

static int checks, failures;

static void check(int ok, const char *what) {
    checks++;
    if (!ok) {
        failures++;
        fprintf(stderr, "FAIL: %s\n", what);
    }
}

/* "all N checks passed" and 0, or "F of N checks failed" and 1. */
static int check_report(void) {
    if (failures) {
        fprintf(stderr, "%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("all %d checks passed\n", checks);
    return 0;
}

#endif
