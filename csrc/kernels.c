/*
 * kernels.c - elementwise reduction and scaling kernels, dtype and op names.
 *
 * Semantics follow numpy, because the Python layer and the tests treat numpy
 * as the reference:
 *   - integer SUM / PROD wrap modulo 2^bits (np.add / np.multiply on arrays).
 *     The arithmetic is done in unsigned types: signed overflow is undefined
 *     behaviour in C, unsigned overflow is defined to wrap, and two's
 *     complement makes the bits the same.
 *   - MIN / MAX on floats propagate NaN like np.minimum / np.maximum, and
 *     when a == b (e.g. -0.0 vs +0.0) return b, as numpy does.
 *   - bool: SUM = OR, PROD = AND, MIN = AND, MAX = OR, BAND/BOR/BXOR the
 *     logical versions; any nonzero input byte counts as true and the output
 *     is always 0 or 1.
 *   - float16 / bfloat16 are widened to float32, combined, and rounded to
 *     nearest-even once (what numpy does for float16 arithmetic).
 *
 * SIMD dispatch.  The extension is built with -O3 and no -march flag, so the
 * wheel runs on any x86-64.  Every kernel body is written once as a plain
 * loop (always_inline) and instantiated twice: in a baseline function and in
 * a function compiled with __attribute__((target("avx2,f16c"))), where GCC
 * and Clang vectorise the same loops with 256-bit registers.  The variant is
 * picked once, at the first call, from cpuid (which also tells whether the
 * OS saves the YMM registers).  Setting the environment
 * variable RINGLET_SIMD=baseline forces the portable path, so a suspected
 * SIMD bug can be ruled out (and so the tests can compare both paths).
 * float16 on the AVX2 path uses the F16C conversion instructions directly;
 * the software conversions below produce the same bits (checked over all
 * 65536 inputs by tests/test_c_units.py).
 *
 * Aliasing.  dst may be the same pointer as a or b (the collectives reduce
 * in place).  The pointers are therefore NOT declared restrict: that would
 * be a promise the callers break.  Instead the loops carry `#pragma GCC
 * ivdep`, which only asserts that there is no loop-carried dependence; that
 * holds for exact aliasing, because iteration i reads a[i] and b[i] before it
 * writes dst[i] and touches no other element.  Without the pragma GCC would
 * add a run-time overlap check that fails for dst == a and falls back to
 * scalar code on exactly the hot in-place case.  Partial overlap (dst == a+1)
 * is not allowed by the contract.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ringlet.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define RL_X86_DISPATCH 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define RL_X86_DISPATCH 0
#endif

#if defined(__clang__)
#define RL_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define RL_IVDEP _Pragma("GCC ivdep")
#else
#define RL_IVDEP
#endif

/* Force inlining so that one loop body is compiled separately inside each
 * target-specific wrapper (a default-target callee may be inlined into an
 * avx2 caller, and is then vectorised for AVX2). */
#define RL_INLINE static inline __attribute__((always_inline))

/* ---- names and validity ---------------------------------------------- */

/* Size in bytes of one element of dt; 0 for an out-of-range value. */
size_t rl_dtype_size(rl_dtype dt) {
    switch (dt) {
    case RL_F16: case RL_BF16: case RL_I16: case RL_U16: return 2;
    case RL_F32: case RL_I32: case RL_U32: return 4;
    case RL_F64: case RL_I64: case RL_U64: return 8;
    case RL_I8: case RL_U8: case RL_BOOL: return 1;
    default: return 0;
    }
}

/* numpy's name of dt ("bfloat16" is ml_dtypes' name); a static string. */
const char *rl_dtype_name(rl_dtype dt) {
    switch (dt) {
    case RL_F16: return "float16";
    case RL_BF16: return "bfloat16";
    case RL_F32: return "float32";
    case RL_F64: return "float64";
    case RL_I8: return "int8";
    case RL_U8: return "uint8";
    case RL_I32: return "int32";
    case RL_I64: return "int64";
    case RL_BOOL: return "bool";
    case RL_I16: return "int16";
    case RL_U16: return "uint16";
    case RL_U32: return "uint32";
    case RL_U64: return "uint64";
    default: return "unknown-dtype";
    }
}

/* Upper-case name of a reduction op, as in ReduceOp; a static string. */
const char *rl_op_name(rl_redop op) {
    switch (op) {
    case RL_SUM: return "SUM";
    case RL_PROD: return "PROD";
    case RL_MIN: return "MIN";
    case RL_MAX: return "MAX";
    case RL_AVG: return "AVG";
    case RL_BAND: return "BAND";
    case RL_BOR: return "BOR";
    case RL_BXOR: return "BXOR";
    default: return "unknown-reduce-op";
    }
}

static int is_floating(rl_dtype dt) {
    return dt == RL_F16 || dt == RL_BF16 || dt == RL_F32 || dt == RL_F64;
}

/* 1 when op is defined for dt: SUM/PROD/MIN/MAX for every dtype, AVG for
 * floating dtypes only (an integer mean would need a rounding rule numpy
 * does not have), BAND/BOR/BXOR for integers and bool only.  0 for any
 * out-of-range enum value. */
int rl_op_valid(rl_dtype dt, rl_redop op) {
    if ((unsigned)dt >= RL_NDTYPES || (unsigned)op >= RL_NOPS) return 0;
    switch (op) {
    case RL_SUM: case RL_PROD: case RL_MIN: case RL_MAX: return 1;
    case RL_AVG: return is_floating(dt);
    case RL_BAND: case RL_BOR: case RL_BXOR: return !is_floating(dt);
    default: return 0;
    }
}

/* ---- float16 / bfloat16 conversions (software) ------------------------ */

RL_INLINE float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f); /* the defined way to reinterpret bits */
    return f;
}

RL_INLINE uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* IEEE binary16 -> binary32, exact.  A signalling NaN comes back quiet with
 * its payload kept, which is what the F16C instruction VCVTPH2PS does. */
RL_INLINE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) /* inf, or NaN with the quiet bit set */
        return bits_to_f32(sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0));
    if (exp != 0) /* normal: rebias the exponent from 15 to 127 */
        return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
    if (man == 0) return bits_to_f32(sign); /* +-0 */
    /* Subnormal: man * 2^-24.  Shift the leading 1 up to bit 10 (the
     * implicit bit) and lower the exponent by one per shift. */
    uint32_t e = 113; /* the exponent of 2^-14 in float32 is 127 - 14 */
    while (!(man & 0x400u)) {
        man <<= 1;
        e--;
    }
    return bits_to_f32(sign | (e << 23) | ((man & 0x3ffu) << 13));
}

/* binary32 -> binary16, rounded to nearest, ties to even, whatever the
 * FPU rounding mode (integer arithmetic on the bits).  Overflow gives inf;
 * NaN stays NaN (quiet, sign and top payload bits kept, like VCVTPS2PH). */
RL_INLINE uint16_t f32_to_f16(float f) {
    uint32_t u = f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
    /* 65520 = 0x477ff000 is halfway between 65504 (largest half, odd
     * mantissa) and 65536: ties go to even, i.e. to infinity. */
    if (u >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (u >= 0x38800000u) { /* result is a normal half (>= 2^-14) */
        /* Drop 13 mantissa bits with round-half-even: adding 0xfff plus the
         * lowest kept bit carries into the kept bits exactly when the dropped
         * part is above half, or equal to half with the kept part odd.  A
         * carry out of the mantissa bumps the exponent, which is also right. */
        u += 0xfffu + ((u >> 13) & 1u);
        return (uint16_t)(sign | ((u - (112u << 23)) >> 13));
    }
    /* Subnormal half (or zero): the result is round(f / 2^-24).  At or
     * below 2^-25 (0x33000000, a tie with zero) it rounds to zero. */
    if (u <= 0x33000000u) return sign;
    uint32_t e = u >> 23;                       /* 102 .. 112 here */
    uint32_t man = (u & 0x7fffffu) | 0x800000u; /* value = man * 2^(e-150) */
    uint32_t shift = 126u - e;                  /* f / 2^-24 = man >> shift */
    uint32_t r = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) r++; /* may reach 0x400: min normal */
    return (uint16_t)(sign | r);
}

/* bfloat16 is the upper half of a float32 (ml_dtypes layout): widening is
 * a shift. */
RL_INLINE float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

/* float32 -> bfloat16, round to nearest even with the same carry trick as
 * f32_to_f16 (it also rounds correctly into subnormals and up to inf).
 * Written without branches so the AVX2 build vectorises it.  NaN is kept
 * quiet (the carry could otherwise turn a NaN into inf). */
RL_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x0040u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* ---- elementwise loops ------------------------------------------------ */

/* Defines `name(d, a, b, n)`: d[i] = EXPR(x = a[i], y = b[i]).  See the
 * file comment for why the loop may ignore aliasing (RL_IVDEP). */
#define RL_BINARY(name, T, EXPR)                                          \
    RL_INLINE void name(T *d, const T *a, const T *b, size_t n) {         \
        RL_IVDEP                                                          \
        for (size_t i = 0; i < n; i++) {                                  \
            T x = a[i], y = b[i];                                         \
            d[i] = (T)(EXPR);                                             \
        }                                                                 \
    }

/* numpy's minimum/maximum: NaN if either is NaN (x != x tests NaN without
 * needing -fno-finite-math), otherwise the smaller/larger, b on ties. */
#define RL_FMIN(x, y) (((x) < (y) || (x) != (x)) ? (x) : (y))
#define RL_FMAX(x, y) (((x) > (y) || (x) != (x)) ? (x) : (y))

RL_BINARY(f32_sum, float, x + y)
RL_BINARY(f32_prod, float, x * y)
RL_BINARY(f32_min, float, RL_FMIN(x, y))
RL_BINARY(f32_max, float, RL_FMAX(x, y))
RL_BINARY(f64_sum, double, x + y)
RL_BINARY(f64_prod, double, x * y)
RL_BINARY(f64_min, double, RL_FMIN(x, y))
RL_BINARY(f64_max, double, RL_FMAX(x, y))

/* Wrapping integer arithmetic and bitwise ops, on the unsigned type of the
 * same width (int8 and uint8 share these, as do int16 / uint16, int32 /
 * uint32 and int64 / uint64 bits).  uint8 operands promote to int, but
 * 255 * 255 fits; uint16 ones would overflow int (65535 * 65535), so their
 * product is taken in uint32_t; 32- and 64-bit unsigned operands are not
 * promoted on any ABI ringlet supports. */
RL_BINARY(u8_sum, uint8_t, x + y)
RL_BINARY(u8_prod, uint8_t, x * y)
RL_BINARY(u8_and, uint8_t, x & y)
RL_BINARY(u8_or, uint8_t, x | y)
RL_BINARY(u8_xor, uint8_t, x ^ y)
RL_BINARY(u16_sum, uint16_t, x + y)
RL_BINARY(u16_prod, uint16_t, (uint32_t)x * y)
RL_BINARY(u16_and, uint16_t, x & y)
RL_BINARY(u16_or, uint16_t, x | y)
RL_BINARY(u16_xor, uint16_t, x ^ y)
RL_BINARY(u32_sum, uint32_t, x + y)
RL_BINARY(u32_prod, uint32_t, x * y)
RL_BINARY(u32_and, uint32_t, x & y)
RL_BINARY(u32_or, uint32_t, x | y)
RL_BINARY(u32_xor, uint32_t, x ^ y)
RL_BINARY(u64_sum, uint64_t, x + y)
RL_BINARY(u64_prod, uint64_t, x * y)
RL_BINARY(u64_and, uint64_t, x & y)
RL_BINARY(u64_or, uint64_t, x | y)
RL_BINARY(u64_xor, uint64_t, x ^ y)

/* MIN / MAX need the signedness of the dtype. */
RL_BINARY(i8_min, int8_t, x < y ? x : y)
RL_BINARY(i8_max, int8_t, x > y ? x : y)
RL_BINARY(u8_min, uint8_t, x < y ? x : y)
RL_BINARY(u8_max, uint8_t, x > y ? x : y)
RL_BINARY(i16_min, int16_t, x < y ? x : y)
RL_BINARY(i16_max, int16_t, x > y ? x : y)
RL_BINARY(u16_min, uint16_t, x < y ? x : y)
RL_BINARY(u16_max, uint16_t, x > y ? x : y)
RL_BINARY(u32_min, uint32_t, x < y ? x : y)
RL_BINARY(u32_max, uint32_t, x > y ? x : y)
RL_BINARY(u64_min, uint64_t, x < y ? x : y)
RL_BINARY(u64_max, uint64_t, x > y ? x : y)
RL_BINARY(i32_min, int32_t, x < y ? x : y)
RL_BINARY(i32_max, int32_t, x > y ? x : y)
RL_BINARY(i64_min, int64_t, x < y ? x : y)
RL_BINARY(i64_max, int64_t, x > y ? x : y)

/* bool as numpy stores it: one byte, any nonzero value is true. */
RL_BINARY(bool_and, uint8_t, (x != 0) & (y != 0))
RL_BINARY(bool_or, uint8_t, (x != 0) | (y != 0))
RL_BINARY(bool_xor, uint8_t, (x != 0) ^ (y != 0))

/* float16 / bfloat16 in software: widen, combine in float32, round once.
 * Each op is its own loop so the op switch stays outside the loop. */
#define RL_HALF(name, TO_F32, FROM_F32, EXPR)                             \
    RL_INLINE void name(uint16_t *d, const uint16_t *a, const uint16_t *b, \
                        size_t n) {                                       \
        RL_IVDEP                                                          \
        for (size_t i = 0; i < n; i++) {                                  \
            float x = TO_F32(a[i]), y = TO_F32(b[i]);                     \
            d[i] = FROM_F32(EXPR);                                        \
        }                                                                 \
    }

RL_HALF(f16_sum_soft, f16_to_f32, f32_to_f16, x + y)
RL_HALF(f16_prod_soft, f16_to_f32, f32_to_f16, x * y)
RL_HALF(f16_min_soft, f16_to_f32, f32_to_f16, RL_FMIN(x, y))
RL_HALF(f16_max_soft, f16_to_f32, f32_to_f16, RL_FMAX(x, y))
RL_HALF(bf16_sum, bf16_to_f32, f32_to_bf16, x + y)
RL_HALF(bf16_prod, bf16_to_f32, f32_to_bf16, x * y)
RL_HALF(bf16_min, bf16_to_f32, f32_to_bf16, RL_FMIN(x, y))
RL_HALF(bf16_max, bf16_to_f32, f32_to_bf16, RL_FMAX(x, y))

/* ---- float16 with F16C ------------------------------------------------ */
#if RL_X86_DISPATCH
/* np.minimum / np.maximum on 8 floats.  MINPS(x, y) is (x < y ? x : y),
 * which already gives y when y is NaN or on ties; a blend then puts back x
 * where x is NaN.  Same result as RL_FMIN / RL_FMAX, lane by lane. */
#define RL_V_SUM(x, y) _mm256_add_ps(x, y)
#define RL_V_PROD(x, y) _mm256_mul_ps(x, y)
#define RL_V_MIN(x, y) _mm256_blendv_ps(_mm256_min_ps(x, y), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q))
#define RL_V_MAX(x, y) _mm256_blendv_ps(_mm256_max_ps(x, y), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q))

/* Defines an F16C kernel: 8 halves per step, VCVTPH2PS to widen and
 * VCVTPS2PH with an explicit round-to-nearest-even immediate (so the MXCSR
 * rounding mode does not matter).  The last n % 8 elements are copied into
 * zero-padded blocks and go through the same instructions, so a call never
 * mixes hardware and software rounding. */
#define RL_F16C(name, VEXPR)                                                          \
    __attribute__((target("avx2,f16c"))) static void name(                           \
        uint16_t *d, const uint16_t *a, const uint16_t *b, size_t n) {                \
        size_t i = 0;                                                                 \
        for (; i + 8 <= n; i += 8) {                                                  \
            __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));    \
            __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));    \
            _mm_storeu_si128((__m128i *)(d + i),                                      \
                             _mm256_cvtps_ph(VEXPR(x, y), _MM_FROUND_TO_NEAREST_INT)); \
        }                                                                             \
        if (i < n) {                                                                  \
            uint16_t ta[8] = {0}, tb[8] = {0}, td[8];                                 \
            memcpy(ta, a + i, (n - i) * 2);                                           \
            memcpy(tb, b + i, (n - i) * 2);                                           \
            __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)ta));         \
            __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tb));         \
            _mm_storeu_si128((__m128i *)td,                                           \
                             _mm256_cvtps_ph(VEXPR(x, y), _MM_FROUND_TO_NEAREST_INT)); \
            memcpy(d + i, td, (n - i) * 2);                                           \
        }                                                                             \
    }

RL_F16C(f16_sum_f16c, RL_V_SUM)
RL_F16C(f16_prod_f16c, RL_V_PROD)
RL_F16C(f16_min_f16c, RL_V_MIN)
RL_F16C(f16_max_f16c, RL_V_MAX)

/* buf[i] = half(float(buf[i]) * factor), 8 at a time (tail as above). */
__attribute__((target("avx2,f16c"))) static void f16_scale_f16c(uint16_t *buf, size_t n,
                                                                float factor) {
    __m256 f = _mm256_set1_ps(factor);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(buf + i)));
        _mm_storeu_si128((__m128i *)(buf + i),
                         _mm256_cvtps_ph(_mm256_mul_ps(x, f), _MM_FROUND_TO_NEAREST_INT));
    }
    if (i < n) {
        uint16_t t[8] = {0};
        memcpy(t, buf + i, (n - i) * 2);
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        _mm_storeu_si128((__m128i *)t,
                         _mm256_cvtps_ph(_mm256_mul_ps(x, f), _MM_FROUND_TO_NEAREST_INT));
        memcpy(buf + i, t, (n - i) * 2);
    }
}
#define RL_F16C_CALL(fn, ...) fn(__VA_ARGS__)
#else
/* No F16C anywhere: the `f16c` branches below are never taken. */
#define RL_F16C_CALL(fn, ...) ((void)0)
#endif

/* ---- the dispatch body, compiled once per target ---------------------- */

/* The whole dtype x op switch.  `f16c` is a compile-time constant in each
 * wrapper, so the unused float16 branch disappears.  The caller has checked
 * rl_op_valid, so every case reached here is defined. */
RL_INLINE void reduce_body(void *dst, const void *a, const void *b, size_t n, rl_dtype dt,
                           rl_redop op, int f16c) {
    if (op == RL_AVG) op = RL_SUM; /* the caller scales once at the end */
    switch (dt) {
    case RL_F32:
        switch (op) {
        case RL_SUM: f32_sum(dst, a, b, n); return;
        case RL_PROD: f32_prod(dst, a, b, n); return;
        case RL_MIN: f32_min(dst, a, b, n); return;
        case RL_MAX: f32_max(dst, a, b, n); return;
        default: return;
        }
    case RL_F64:
        switch (op) {
        case RL_SUM: f64_sum(dst, a, b, n); return;
        case RL_PROD: f64_prod(dst, a, b, n); return;
        case RL_MIN: f64_min(dst, a, b, n); return;
        case RL_MAX: f64_max(dst, a, b, n); return;
        default: return;
        }
    case RL_F16:
        if (f16c) {
            switch (op) {
            case RL_SUM: RL_F16C_CALL(f16_sum_f16c, dst, a, b, n); return;
            case RL_PROD: RL_F16C_CALL(f16_prod_f16c, dst, a, b, n); return;
            case RL_MIN: RL_F16C_CALL(f16_min_f16c, dst, a, b, n); return;
            case RL_MAX: RL_F16C_CALL(f16_max_f16c, dst, a, b, n); return;
            default: return;
            }
        }
        switch (op) {
        case RL_SUM: f16_sum_soft(dst, a, b, n); return;
        case RL_PROD: f16_prod_soft(dst, a, b, n); return;
        case RL_MIN: f16_min_soft(dst, a, b, n); return;
        case RL_MAX: f16_max_soft(dst, a, b, n); return;
        default: return;
        }
    case RL_BF16:
        switch (op) {
        case RL_SUM: bf16_sum(dst, a, b, n); return;
        case RL_PROD: bf16_prod(dst, a, b, n); return;
        case RL_MIN: bf16_min(dst, a, b, n); return;
        case RL_MAX: bf16_max(dst, a, b, n); return;
        default: return;
        }
    case RL_I8: case RL_U8:
        switch (op) {
        case RL_SUM: u8_sum(dst, a, b, n); return;
        case RL_PROD: u8_prod(dst, a, b, n); return;
        case RL_MIN:
            if (dt == RL_I8) i8_min(dst, a, b, n); else u8_min(dst, a, b, n);
            return;
        case RL_MAX:
            if (dt == RL_I8) i8_max(dst, a, b, n); else u8_max(dst, a, b, n);
            return;
        case RL_BAND: u8_and(dst, a, b, n); return;
        case RL_BOR: u8_or(dst, a, b, n); return;
        case RL_BXOR: u8_xor(dst, a, b, n); return;
        default: return;
        }
    case RL_I16: case RL_U16:
        switch (op) {
        case RL_SUM: u16_sum(dst, a, b, n); return;
        case RL_PROD: u16_prod(dst, a, b, n); return;
        case RL_MIN:
            if (dt == RL_I16) i16_min(dst, a, b, n); else u16_min(dst, a, b, n);
            return;
        case RL_MAX:
            if (dt == RL_I16) i16_max(dst, a, b, n); else u16_max(dst, a, b, n);
            return;
        case RL_BAND: u16_and(dst, a, b, n); return;
        case RL_BOR: u16_or(dst, a, b, n); return;
        case RL_BXOR: u16_xor(dst, a, b, n); return;
        default: return;
        }
    case RL_I32: case RL_U32:
        switch (op) {
        case RL_SUM: u32_sum(dst, a, b, n); return;
        case RL_PROD: u32_prod(dst, a, b, n); return;
        case RL_MIN:
            if (dt == RL_I32) i32_min(dst, a, b, n); else u32_min(dst, a, b, n);
            return;
        case RL_MAX:
            if (dt == RL_I32) i32_max(dst, a, b, n); else u32_max(dst, a, b, n);
            return;
        case RL_BAND: u32_and(dst, a, b, n); return;
        case RL_BOR: u32_or(dst, a, b, n); return;
        case RL_BXOR: u32_xor(dst, a, b, n); return;
        default: return;
        }
    case RL_I64: case RL_U64:
        switch (op) {
        case RL_SUM: u64_sum(dst, a, b, n); return;
        case RL_PROD: u64_prod(dst, a, b, n); return;
        case RL_MIN:
            if (dt == RL_I64) i64_min(dst, a, b, n); else u64_min(dst, a, b, n);
            return;
        case RL_MAX:
            if (dt == RL_I64) i64_max(dst, a, b, n); else u64_max(dst, a, b, n);
            return;
        case RL_BAND: u64_and(dst, a, b, n); return;
        case RL_BOR: u64_or(dst, a, b, n); return;
        case RL_BXOR: u64_xor(dst, a, b, n); return;
        default: return;
        }
    case RL_BOOL:
        switch (op) {
        case RL_SUM: case RL_MAX: case RL_BOR: bool_or(dst, a, b, n); return;
        case RL_PROD: case RL_MIN: case RL_BAND: bool_and(dst, a, b, n); return;
        case RL_BXOR: bool_xor(dst, a, b, n); return;
        default: return;
        }
    default:
        return;
    }
}

/* buf[i] *= factor.  The factor is rounded to the compute type first, as
 * numpy does for `array_f32 *= python_float` (NEP 50: a Python float does
 * not widen the array's dtype); half types compute in float32 and round
 * once. */
RL_INLINE void scale_body(void *buf, size_t n, rl_dtype dt, double factor, int f16c) {
    float ff = (float)factor;
    switch (dt) {
    case RL_F32: {
        float *p = buf;
        for (size_t i = 0; i < n; i++) p[i] *= ff;
        return;
    }
    case RL_F64: {
        double *p = buf;
        for (size_t i = 0; i < n; i++) p[i] *= factor;
        return;
    }
    case RL_F16: {
        uint16_t *p = buf;
        if (f16c) {
            RL_F16C_CALL(f16_scale_f16c, p, n, ff);
            return;
        }
        for (size_t i = 0; i < n; i++) p[i] = f32_to_f16(f16_to_f32(p[i]) * ff);
        return;
    }
    case RL_BF16: {
        uint16_t *p = buf;
        for (size_t i = 0; i < n; i++) p[i] = f32_to_bf16(bf16_to_f32(p[i]) * ff);
        return;
    }
    default: /* integers and bool: AVG is not defined for them */
        return;
    }
}

static void reduce_baseline(void *dst, const void *a, const void *b, size_t n, rl_dtype dt,
                            rl_redop op) {
    reduce_body(dst, a, b, n, dt, op, 0);
}

static void scale_baseline(void *buf, size_t n, rl_dtype dt, double factor) {
    scale_body(buf, n, dt, factor, 0);
}

#if RL_X86_DISPATCH
__attribute__((target("avx2,f16c"))) static void reduce_avx2(void *dst, const void *a,
                                                            const void *b, size_t n,
                                                            rl_dtype dt, rl_redop op) {
    reduce_body(dst, a, b, n, dt, op, 1);
}

__attribute__((target("avx2,f16c"))) static void scale_avx2(void *buf, size_t n, rl_dtype dt,
                                                           double factor) {
    scale_body(buf, n, dt, factor, 1);
}
#endif

/* ---- run-time selection ----------------------------------------------- */

enum { LEVEL_UNKNOWN = 0, LEVEL_BASELINE = 1, LEVEL_AVX2_F16C = 2 };

/* Chosen at the first kernel call.  Every thread computes the same value, so
 * a race between two first calls is harmless; the atomic only keeps the
 * access well defined. */
static _Atomic int simd_level;

#if RL_X86_DISPATCH
/* 1 if this CPU has AVX2 and F16C and the OS saves the YMM registers.  Read
 * from cpuid itself: __builtin_cpu_supports needs its runtime half from the
 * compiler's support library, and zig's (which builds the manylinux wheels)
 * answers 0 for everything. */
static int cpu_has_avx2_f16c(void) {
    unsigned a, b, c, d;
    const unsigned osxsave = 1u << 27, avx = 1u << 28, f16c = 1u << 29; /* leaf 1, ecx */
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if ((c & (osxsave | avx | f16c)) != (osxsave | avx | f16c)) return 0;
    unsigned xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & 6u) != 6u) return 0; /* XMM and YMM state enabled by the OS */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (int)((b >> 5) & 1u); /* leaf 7, ebx bit 5: AVX2 */
}
#endif

static int detect_level(void) {
    const char *force = getenv("RINGLET_SIMD");
    if (force && strcmp(force, "baseline") == 0) return LEVEL_BASELINE;
#if RL_X86_DISPATCH
    /* AVX2 CPUs all have F16C; requiring both keeps one fast variant. */
    if (cpu_has_avx2_f16c()) return LEVEL_AVX2_F16C;
#endif
    return LEVEL_BASELINE;
}

static int current_level(void) {
    int level = simd_level; /* seq_cst load: cheap next to any kernel */
    if (level == LEVEL_UNKNOWN) {
        level = detect_level();
        simd_level = level;
    }
    return level;
}

/* dst[i] = a[i] op b[i] for i < n (see ringlet.h).  dst may equal a or b.
 * An invalid (dt, op) pair or enum leaves dst untouched: callers validate
 * with rl_op_valid first, and a no-op is safer than undefined behaviour. */
void rl_reduce_kernel(void *dst, const void *a, const void *b, size_t n, rl_dtype dt,
                      rl_redop op) {
    if (n == 0 || !rl_op_valid(dt, op)) return;
#if RL_X86_DISPATCH
    if (current_level() == LEVEL_AVX2_F16C) {
        reduce_avx2(dst, a, b, n, dt, op);
        return;
    }
#endif
    reduce_baseline(dst, a, b, n, dt, op);
}

/* buf[i] *= factor for float16 / bfloat16 / float32 / float64 (see
 * scale_body for the rounding); a no-op for integer and bool dtypes. */
void rl_scale_kernel(void *buf, size_t n, rl_dtype dt, double factor) {
    if (n == 0 || !is_floating(dt)) return;
#if RL_X86_DISPATCH
    if (current_level() == LEVEL_AVX2_F16C) {
        scale_avx2(buf, n, dt, factor);
        return;
    }
#endif
    scale_baseline(buf, n, dt, factor);
}

/* Copy n bytes with non-temporal stores where the CPU has them (SSE2, the
 * x86-64 baseline): the destination lines are written without being read
 * first and without evicting the working set from the cache.  For a rank's
 * own block of a large all_gather / scatter / all_to_all, which is copied
 * while the same core also runs the socket copies, that is a third less
 * memory traffic than memcpy (glibc only streams above a size near the L3,
 * and the engine copies in slices far below it).  The ranges must not
 * overlap.  The trailing fence orders the streamed stores before anything
 * the caller does next. */
void rl_copy_stream(void *dst, const void *src, size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    char *d = dst;
    const char *s = src;
    if (n < 256) { /* small copies: memcpy is as good and needs no fence */
        memcpy(dst, src, n);
        return;
    }
    size_t head = (size_t)(-(uintptr_t)d & 15u); /* < 16 <= n: align the stores */
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), x0);
        _mm_stream_si128((__m128i *)(d + i + 16), x1);
        _mm_stream_si128((__m128i *)(d + i + 32), x2);
        _mm_stream_si128((__m128i *)(d + i + 48), x3);
    }
    for (; i + 16 <= n; i += 16)
        _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    _mm_sfence();
    memcpy(d + i, s + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* Bulk copies.  glibc's memcpy (2.36) takes `rep movsb` from 4 KiB up to near
 * the L3 size, and on AMD Zen that runs 5-20x slower when the destination
 * sits 1-63 bytes past the source modulo 4 KiB: a page-aligned slot copied
 * into numpy's array, whose data starts 16 bytes past a page (docs/
 * algorithms.md, "Bulk copies").  Only that case goes to a vector loop;
 * elsewhere `rep movsb` is as fast or faster. */
enum { COPY_LOOP_MIN = 4096 };

#if RL_X86_DISPATCH && defined(__x86_64__)
static void copy_sse2(char *d, const char *s, size_t n) {
    size_t head = (size_t)(-(uintptr_t)d & 15u); /* aligned stores */
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_store_si128((__m128i *)(d + i), x0);
        _mm_store_si128((__m128i *)(d + i + 16), x1);
        _mm_store_si128((__m128i *)(d + i + 32), x2);
        _mm_store_si128((__m128i *)(d + i + 48), x3);
    }
    memcpy(d + i, s + i, n - i);
}

__attribute__((target("avx2,f16c"))) static void copy_avx2(char *d, const char *s, size_t n) {
    size_t head = (size_t)(-(uintptr_t)d & 31u);
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i x2 = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i x3 = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_store_si256((__m256i *)(d + i), x0);
        _mm256_store_si256((__m256i *)(d + i + 32), x1);
        _mm256_store_si256((__m256i *)(d + i + 64), x2);
        _mm256_store_si256((__m256i *)(d + i + 96), x3);
    }
    memcpy(d + i, s + i, n - i);
}
#endif

void rl_copy(void *dst, const void *src, size_t n) {
#if RL_X86_DISPATCH && defined(__x86_64__)
    if (n >= COPY_LOOP_MIN && (((uintptr_t)dst - (uintptr_t)src) & 4095u) - 1u < 63u) {
        if (current_level() == LEVEL_AVX2_F16C) copy_avx2(dst, src, n);
        else copy_sse2(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

void rl_move(void *dst, const void *src, size_t n) {
    const char *d = dst, *s = src;
    if (d == s) return;
    if (d + n <= s || s + n <= d) rl_copy(dst, src, n);
    else memmove(dst, src, n);
}

/* The SIMD path the kernels use on this CPU: "avx2,f16c" or "baseline"
 * (also when forced with RINGLET_SIMD=baseline).  A static string. */
const char *rl_simd_info(void) {
    return current_level() == LEVEL_AVX2_F16C ? "avx2,f16c" : "baseline";
}
