/*
 * test_units.c - unit tests of csrc/sha256.c: SHA-256 and HMAC-SHA256 against
 * published test vectors, rl_ct_equal, rl_random_bytes; and of kernels.c's
 * rl_copy_stream, rl_copy and rl_move.  Plain C, run by
 * tests/test_c_units.py; by hand:
 *     gcc -O2 -std=gnu11 -Wall -Werror -Icsrc tests/c/test_units.c \
 *         csrc/sha256.c csrc/kernels.c -o /tmp/test_units && /tmp/test_units
 * Prints one line per failure and exits 1 if anything failed, else prints
 * "all N checks passed" and exits 0.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ringlet.h"
#include "check.h"

static void to_hex(const uint8_t *d, size_t n, char *out) {
    for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", d[i]);
}

static void check_digest(const uint8_t d[32], const char *want_hex, const char *what) {
    char got[65];
    to_hex(d, 32, got);
    int ok = strcmp(got, want_hex) == 0;
    check(ok, what);
    if (!ok) fprintf(stderr, "      got  %s\n      want %s\n", got, want_hex);
}

static void check_sha(const void *msg, size_t len, const char *want, const char *what) {
    uint8_t d[32];
    rl_sha256(msg, len, d);
    check_digest(d, want, what);
}

static void check_hmac(const void *key, size_t klen, const void *msg, size_t mlen,
                       const char *want, const char *what) {
    uint8_t d[32];
    rl_hmac_sha256(key, klen, msg, mlen, d);
    check_digest(d, want, what);
}

/* FIPS 180-2 appendix B / NIST CSRC examples. */
static void test_sha256_vectors(void) {
    check_sha("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
              "SHA-256 of \"abc\"");
    check_sha("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
              "SHA-256 of the empty string");
    check_sha(NULL, 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
              "SHA-256 of (NULL, 0)");
    const char *m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    check_sha(m448, strlen(m448),
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
              "SHA-256 of the 448-bit message");
    const char *m896 = "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno"
                       "ijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
    check_sha(m896, strlen(m896),
              "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1",
              "SHA-256 of the 896-bit message");
    char *million = malloc(1000000);
    if (!million) {
        check(0, "malloc for the million-'a' message");
        return;
    }
    memset(million, 'a', 1000000);
    check_sha(million, 1000000,
              "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0",
              "SHA-256 of one million 'a'");
    free(million);
}

/* Every length 0..299 crosses the padding boundaries (55/56/64 bytes and
 * their multiples).  The digests are chained into one SHA-256 whose value
 * was computed with Python's hashlib:
 *   acc = sha256(); for i in range(300):
 *       acc.update(sha256(bytes((j*7+i) & 255 for j in range(i))).digest())
 * (an independent implementation, so a padding bug cannot cancel out). */
static void test_sha256_lengths(void) {
    uint8_t msg[300], d[32], all[300 * 32];
    for (int i = 0; i < 300; i++) {
        for (int j = 0; j < i; j++) msg[j] = (uint8_t)(j * 7 + i);
        rl_sha256(msg, (size_t)i, all + 32 * i);
    }
    rl_sha256(all, sizeof all, d);
    check_digest(d, "d5238871a46ac4a1a75ac3fb19d645b0b3b9e5f35f5f720e2b240d605c6b694e",
                 "SHA-256 of lengths 0..299 (chained, against hashlib)");
}

/* RFC 4231 section 4 (case 5, a truncated output, does not apply). */
static void test_hmac_vectors(void) {
    uint8_t k[131], m[50];
    memset(k, 0x0b, 20);
    check_hmac(k, 20, "Hi There", 8,
               "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
               "HMAC RFC 4231 case 1");
    const char *m2 = "what do ya want for nothing?";
    check_hmac("Jefe", 4, m2, strlen(m2),
               "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
               "HMAC RFC 4231 case 2");
    memset(k, 0xaa, 20);
    memset(m, 0xdd, 50);
    check_hmac(k, 20, m, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
               "HMAC RFC 4231 case 3");
    for (int i = 0; i < 25; i++) k[i] = (uint8_t)(i + 1);
    memset(m, 0xcd, 50);
    check_hmac(k, 25, m, 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
               "HMAC RFC 4231 case 4");
    memset(k, 0xaa, 131);
    const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    check_hmac(k, 131, m6, strlen(m6),
               "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
               "HMAC RFC 4231 case 6 (131-byte key)");
    const char *m7 = "This is a test using a larger than block-size key and a larger than "
                     "block-size data. The key needs to be hashed before being used by the "
                     "HMAC algorithm.";
    check_hmac(k, 131, m7, strlen(m7),
               "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
               "HMAC RFC 4231 case 7 (131-byte key and data)");
}

/* Key lengths 0..199 cross the 64-byte "hash the key first" boundary;
 * chained like test_sha256_lengths, value from Python's hmac module:
 *   acc = sha256(); for i in range(200):
 *       k = bytes((j*13+i) & 255 for j in range(i))
 *       m = bytes((j*5+3*i) & 255 for j in range(300-i))
 *       acc.update(hmac.new(k, m, 'sha256').digest()) */
static void test_hmac_lengths(void) {
    uint8_t key[200], msg[300], d[32], all[200 * 32];
    for (int i = 0; i < 200; i++) {
        for (int j = 0; j < i; j++) key[j] = (uint8_t)(j * 13 + i);
        for (int j = 0; j < 300 - i; j++) msg[j] = (uint8_t)(j * 5 + 3 * i);
        rl_hmac_sha256(key, (size_t)i, msg, (size_t)(300 - i), all + 32 * i);
    }
    rl_sha256(all, sizeof all, d);
    check_digest(d, "ba92d28c8f1f8f6d3764c9f138cc69d3c650395f531f6371c11c07072e21a31e",
                 "HMAC with key lengths 0..199 (chained, against Python hmac)");

    /* out may alias the message: it is written only at the end. */
    uint8_t buf[32];
    memcpy(buf, "0123456789abcdef0123456789abcdef", 32);
    uint8_t want[32];
    rl_hmac_sha256((const uint8_t *)"key", 3, buf, 32, want);
    rl_hmac_sha256((const uint8_t *)"key", 3, buf, 32, buf);
    check(memcmp(buf, want, 32) == 0, "HMAC with out aliasing msg");
}

static void test_ct_equal(void) {
    uint8_t a[64], b[64];
    for (int i = 0; i < 64; i++) a[i] = b[i] = (uint8_t)(i * 37 + 1);
    check(rl_ct_equal(a, b, 64) == 1, "rl_ct_equal: equal buffers give 1");
    check(rl_ct_equal(a, b, 0) == 1, "rl_ct_equal: zero length gives 1");
    check(rl_ct_equal(NULL, NULL, 0) == 1, "rl_ct_equal: (NULL, NULL, 0) gives 1");
    /* Every single-bit difference at every position must be seen. */
    int all_detected = 1;
    for (int i = 0; i < 64; i++)
        for (int bit = 0; bit < 8; bit++) {
            b[i] ^= (uint8_t)(1u << bit);
            if (rl_ct_equal(a, b, 64) != 0) all_detected = 0;
            if (rl_ct_equal(a, b, (size_t)i) != 1) all_detected = 0; /* prefix still equal */
            b[i] ^= (uint8_t)(1u << bit);
        }
    check(all_detected, "rl_ct_equal: every single-bit difference gives 0");
    memset(b, 0, 64);
    memset(a, 0xff, 64);
    check(rl_ct_equal(a, b, 64) == 0, "rl_ct_equal: all bytes differ gives 0");
}

static void test_random_bytes(void) {
    check(rl_random_bytes(NULL, 0) == 0, "rl_random_bytes(NULL, 0) succeeds");

    uint8_t x[64] = {0}, y[64] = {0};
    check(rl_random_bytes(x, sizeof x) == 0 && rl_random_bytes(y, sizeof y) == 0,
          "rl_random_bytes: 64-byte calls succeed");
    check(memcmp(x, y, sizeof x) != 0, "rl_random_bytes: two draws differ");

    /* 40 MiB is more than one getrandom call returns on kernels that cap a
     * call at 32 MiB - 1 (newer ones return it all at once), so there the
     * short-read loop runs.  Either way the tail must have been written. */
    size_t big = 40u << 20;
    uint8_t *buf = calloc(big, 1);
    if (!buf) {
        check(0, "calloc for the 40 MiB draw");
        return;
    }
    check(rl_random_bytes(buf, big) == 0, "rl_random_bytes: a 40 MiB draw succeeds");
    size_t zeros = 0;
    for (size_t i = big - 4096; i < big; i++) zeros += buf[i] == 0;
    check(zeros < 64, "rl_random_bytes: the end of a 40 MiB draw is filled");

    /* Byte histogram over 1 MiB: chi-square with 255 degrees of freedom has
     * mean 255 and sd 22.6; 400 is over 6 sd out. */
    double count[256] = {0};
    for (size_t i = 0; i < (1u << 20); i++) count[buf[i]] += 1;
    double e = (1u << 20) / 256.0, chi2 = 0;
    for (int v = 0; v < 256; v++) chi2 += (count[v] - e) * (count[v] - e) / e;
    char what[96];
    snprintf(what, sizeof what, "rl_random_bytes: byte histogram is uniform (chi2 %.1f)", chi2);
    check(chi2 < 400, what);
    free(buf);
}

typedef void (*copy_fn)(void *dst, const void *src, size_t n);

/* 1 when `copy` equals memcpy for every length in lens, destinations at
 * 0 .. dmax-1 bytes past a 64-byte boundary (every `dstep`-th for lengths
 * over 100000) and sources at 0, 5, 10, 15 or 0, 21, 42, 63 (sstep), and
 * writes nothing in the 64 bytes before or 32 after the range. */
static int copies_like_memcpy(copy_fn copy, const size_t *lens, size_t nlens, size_t dmax,
                              size_t dstep, size_t sstep, const char *what) {
    size_t most = 0;
    for (size_t li = 0; li < nlens; li++)
        if (lens[li] > most) most = lens[li];
    size_t cap = most + 64, room = cap + dmax + 128;
    uint8_t *src = malloc(cap), *dst = malloc(room);
    int ok = src && dst;
    check(ok, what);
    for (size_t i = 0; ok && i < cap; i++) src[i] = (uint8_t)(i * 131 + 7);
    for (size_t li = 0; ok && li < nlens; li++) {
        size_t n = lens[li];
        for (size_t da = 0; da < dmax; da += (n > 100000 ? dstep : 1)) {
            for (size_t sa = 0; sa < 4 * sstep; sa += sstep) {
                memset(dst, 0xA5, room);
                copy(dst + 64 + da, src + sa, n);
                if (memcmp(dst + 64 + da, src + sa, n) != 0) ok = 0;
                for (size_t i = 0; i < 64 + da; i++) ok &= dst[i] == 0xA5;
                for (size_t i = 64 + da + n; i < 64 + da + n + 32; i++) ok &= dst[i] == 0xA5;
            }
        }
    }
    free(src);
    free(dst);
    return ok;
}

/* rl_copy_stream around its thresholds: the memcpy fallback, the 16-byte
 * head, 64-byte blocks, 16-byte and byte tails, at every alignment. */
static void test_copy_stream(void) {
    static const size_t lens[] = {0, 1, 15, 255, 256, 257, 271, 320, 1000, 4096 + 13,
                                  (1u << 20) + 7};
    check(copies_like_memcpy(rl_copy_stream, lens, sizeof lens / sizeof lens[0], 16, 1, 5,
                             "malloc for rl_copy_stream"),
          "rl_copy_stream: equals memcpy at every alignment and length, writes no more");
}

/* rl_copy around its thresholds (memcpy below 4 KiB, the aligning head,
 * 128-byte blocks, byte tails), destinations at every offset from the source
 * modulo 64: both its paths. */
static void test_copy(void) {
    static const size_t lens[] = {0, 1, 4095, 4096, 4097, 4096 + 127, 4096 + 129,
                                  65536 + 16, (1u << 20) + 7};
    check(copies_like_memcpy(rl_copy, lens, sizeof lens / sizeof lens[0], 64, 7, 21,
                             "malloc for rl_copy"),
          "rl_copy: equals memcpy at every relative offset and length, writes no more");
}

/* rl_move equals memmove for overlapping ranges both ways, disjoint ones and
 * the same range. */
static void test_move(void) {
    size_t cap = 4u << 16;
    uint8_t *a = malloc(cap), *b = malloc(cap);
    if (!a || !b) {
        check(0, "malloc for rl_move");
        free(a);
        free(b);
        return;
    }
    static const size_t lens[] = {0, 100, 5000, 65536};
    static const long shifts[] = {0, 1, -1, 16, -16, 4096, -4096, 70000, -70000};
    int ok = 1;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        for (size_t si = 0; si < sizeof shifts / sizeof shifts[0]; si++) {
            for (size_t i = 0; i < cap; i++) a[i] = b[i] = (uint8_t)(i * 29 + 3);
            size_t from = 80000, to = (size_t)((long)from + shifts[si]);
            rl_move(a + to, a + from, lens[li]);
            memmove(b + to, b + from, lens[li]);
            ok &= memcmp(a, b, cap) == 0;
        }
    }
    check(ok, "rl_move: equals memmove for overlaps both ways and disjoint ranges");
    free(a);
    free(b);
}

int main(void) {
    test_sha256_vectors();
    test_sha256_lengths();
    test_hmac_vectors();
    test_hmac_lengths();
    test_ct_equal();
    test_random_bytes();
    test_copy_stream();
    test_copy();
    test_move();
    return check_report();
}
