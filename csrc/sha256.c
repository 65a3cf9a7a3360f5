/*
 * sha256.c - SHA-256 (FIPS 180-4), HMAC-SHA256 (RFC 2104), constant-time
 * comparison and OS randomness, for the connection handshake.
 *
 * Portable C: message words are assembled from bytes with shifts, so the
 * code gives the same digest on little- and big-endian hosts and never makes
 * an unaligned load.  Speed is not a goal (a handshake hashes a few hundred
 * bytes); clarity and checkability are.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* syscall() and O_CLOEXEC also under -std=c11 */
#endif
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#if defined(__linux__)
#include <sys/syscall.h>
#if defined(SYS_getrandom)
#define RL_HAVE_GETRANDOM_SYSCALL 1
#endif
#endif

#include "ringlet.h"

/* ---- SHA-256 ----------------------------------------------------------- */

/* First 32 bits of the fractional parts of the cube roots of the first 64
 * primes (FIPS 180-4, 4.2.2). */
static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

/* Running state of one hash: chaining value, bytes seen, partial block. */
typedef struct {
    uint32_t h[8];
    uint64_t total;   /* message bytes absorbed so far */
    uint8_t buf[64];  /* the first (total % 64) bytes of the current block */
} sha256_ctx;

static uint32_t rotr(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

static uint32_t load_be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void store_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* The compression function (FIPS 180-4, 6.2.2) on one 64-byte block. */
static void sha256_block(uint32_t h[8], const uint8_t *block) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++) w[t] = load_be32(block + 4 * t);
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3];
    uint32_t e = h[4], f = h[5], g = h[6], k = h[7];
    for (int t = 0; t < 64; t++) {
        uint32_t S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t t1 = k + S1 + ch + K[t] + w[t];
        uint32_t S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        uint32_t t2 = S0 + maj;
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += k;
}

/* Initial hash value (FIPS 180-4, 5.3.3). */
static void sha256_init(sha256_ctx *c) {
    static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, H0, sizeof H0);
    c->total = 0;
}

/* Absorb len bytes: fill the partial block, then hash whole blocks straight
 * from the caller's memory, then keep the remainder. */
static void sha256_update(sha256_ctx *c, const void *msg, size_t len) {
    const uint8_t *p = msg;
    size_t have = (size_t)(c->total % 64);
    c->total += len;
    if (have) {
        size_t take = 64 - have < len ? 64 - have : len;
        memcpy(c->buf + have, p, take);
        p += take;
        len -= take;
        if (have + take < 64) return;
        sha256_block(c->h, c->buf);
    }
    for (; len >= 64; p += 64, len -= 64) sha256_block(c->h, p);
    if (len) memcpy(c->buf, p, len);
}

/* Pad (FIPS 180-4, 5.1.1): a 1 bit, zeros up to 56 mod 64, then the message
 * length in bits as a 64-bit big-endian number. */
static void sha256_final(sha256_ctx *c, uint8_t out[32]) {
    uint64_t bits = c->total * 8;
    size_t have = (size_t)(c->total % 64);
    c->buf[have++] = 0x80;
    if (have > 56) { /* no room for the length: pad out this block */
        memset(c->buf + have, 0, 64 - have);
        sha256_block(c->h, c->buf);
        have = 0;
    }
    memset(c->buf + have, 0, 56 - have);
    store_be32(c->buf + 56, (uint32_t)(bits >> 32));
    store_be32(c->buf + 60, (uint32_t)bits);
    sha256_block(c->h, c->buf);
    for (int i = 0; i < 8; i++) store_be32(out + 4 * i, c->h[i]);
}

/* out = SHA-256(msg[0..len)).  msg may be NULL when len is 0. */
void rl_sha256(const void *msg, size_t len, uint8_t out[32]) {
    sha256_ctx c;
    sha256_init(&c);
    if (len) sha256_update(&c, msg, len);
    sha256_final(&c, out);
}

/* out = HMAC-SHA256(key, msg) (RFC 2104): H((K ^ opad) || H((K ^ ipad) || msg))
 * where K is the key zero-padded to the 64-byte block, after hashing it first
 * if it is longer than a block.  key / msg may be NULL when their length is
 * 0.  out may alias key or msg: it is written last. */
void rl_hmac_sha256(const uint8_t *key, size_t keylen, const void *msg, size_t len,
                    uint8_t out[32]) {
    uint8_t k[64] = {0}, pad[64], inner[32];
    if (keylen > 64) rl_sha256(key, keylen, k);
    else if (keylen) memcpy(k, key, keylen);

    sha256_ctx c;
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
    sha256_init(&c);
    sha256_update(&c, pad, 64);
    if (len) sha256_update(&c, msg, len);
    sha256_final(&c, inner);

    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
    sha256_init(&c);
    sha256_update(&c, pad, 64);
    sha256_update(&c, inner, 32);
    sha256_final(&c, out);
    /* Best-effort wipe of key material left on the stack. */
    memset(k, 0, sizeof k);
    memset(pad, 0, sizeof pad);
    memset(&c, 0, sizeof c);
}

/* 1 when the n bytes at a and b are equal, else 0.  Looks at every byte
 * whatever it finds (no early exit), so the time taken reveals nothing about
 * where a MAC first differs.  The volatile accumulator keeps the compiler from
 * turning the loop back into an early-exit comparison. */
int rl_ct_equal(const void *a, const void *b, size_t n) {
    const volatile uint8_t *x = a, *y = b;
    volatile uint8_t diff = 0;
    for (size_t i = 0; i < n; i++) diff |= x[i] ^ y[i];
    /* Branch-free 0 -> 1, 1..255 -> 0. */
    return (int)(((uint32_t)diff - 1u) >> 8 & 1u);
}

/* ---- OS randomness ----------------------------------------------------- */

/* Fill buf from /dev/urandom, retrying short reads and EINTR.  0 on
 * success, -1 with errno set otherwise. */
static int urandom_fill(uint8_t *p, size_t n) {
    int fd;
    do {
        fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return -1;
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int saved = r < 0 ? errno : EIO; /* 0 bytes: the device ran dry */
            close(fd);
            errno = saved;
            return -1;
        }
        p += r;
        n -= (size_t)r;
    }
    close(fd);
    return 0;
}

/* Fill buf with n bytes from the kernel's CSPRNG.  Uses the getrandom(2)
 * system call (through syscall(), so it also works with C libraries older
 * than glibc 2.25); a call returns at most 32 MiB - 1 bytes and may be cut
 * short by a signal, hence the loop.  Falls back to /dev/urandom when the
 * kernel lacks getrandom (ENOSYS) or a seccomp filter forbids it (EPERM).
 * getrandom blocks only until the pool is first seeded at boot.  Returns 0
 * on success, -1 (errno set) on failure.  Building with
 * -DRL_RANDOM_FORCE_URANDOM skips getrandom, so tests can cover the
 * fallback. */
int rl_random_bytes(void *buf, size_t n) {
    uint8_t *p = buf;
#if defined(RL_HAVE_GETRANDOM_SYSCALL) && !defined(RL_RANDOM_FORCE_URANDOM)
    while (n) {
        long r = syscall(SYS_getrandom, p, n, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == ENOSYS || errno == EPERM) break; /* use the device */
            return -1;
        }
        if (r == 0) break; /* never seen; do not spin on it */
        p += r;
        n -= (size_t)r;
    }
    if (n == 0) return 0;
#endif
    return urandom_fill(p, n);
}
