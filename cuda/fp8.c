/* fp8.c — scalar e4m3 and binary16 conversions, and the FP8 row codec (CPU twins).
 *
 * e4m3 (OCP FP8, "fn" variant): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities,
 * S.1111.111 (0x7F/0xFF) is NaN, the largest finite value is S.1111.110 = ±448, the smallest
 * subnormal is 2^-9. kv_fp8_from_float reproduces __nv_cvt_float_to_fp8(x, __NV_SATFINITE,
 * __NV_E4M3) bit for bit — the semantics were learned from the host path of cuda_fp8.hpp and
 * are re-derived here on the float's own bits (no code taken):
 *
 *   NaN (any sign, any payload)        → 0x7F           (the header canonicalises NaN first)
 *   |x| > 464 (448 + half an ulp), ±inf → 0x7E | sign   (SATFINITE)
 *   |x| ≤ 2^-10 (half the min subnormal) → 0x00 | sign  (so -0 and tiny negatives give 0x80)
 *   otherwise round to nearest, ties to even, in the normal or the subnormal grid; a carry out
 *   of the mantissa moves to the next binade naturally because codes are ordered like values.
 *
 * Exactness argument: every e4m3 value is a float, the rounding decision only needs the float's
 * bits below the kept mantissa (normal) or below the 2^-9 grid (subnormal), and float→double is
 * exact, so rounding the float directly gives the same code as CUDA's double-based host path
 * and as the hardware cvt.rn.satfinite.e4m3x2.f32. tests/unit/test_fp8.c checks every code,
 * every midpoint and its float neighbours, and 1M random floats against an independent
 * brute-force nearest-code reference computed in double.
 *
 * Row codec: scale = amax/448 with IEEE division, code = fp8(x / scale) with IEEE division (the
 * GPU uses __fdiv_rn, never a reciprocal multiply, so both sides produce the same codes);
 * decode x = fp8_to_float(code) * scale. Non-finite inputs: amax is taken over FINITE |x| only,
 * so one inf or NaN does not wipe out the row; ±inf then saturates to ±448·scale and NaN
 * encodes as 0x7F (decodes to NaN — garbage in stays visible). A row whose finite amax is
 * below FLT_MIN (zero or subnormal) gets scale 1.0: amax/448 would underflow, and a GPU with
 * flush-to-zero would disagree on it; with scale 1 every such value encodes to ±0.
 */
#include "kvkern.h"

#include <float.h>
#include <math.h>
#include <string.h>

static uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Round-to-nearest-even of `v >> sh` (sh ≥ 1, sh < 32). */
static uint32_t shr_rne(uint32_t v, uint32_t sh)
{
    uint32_t q = v >> sh;
    uint32_t rem = v & ((1u << sh) - 1u);
    uint32_t half = 1u << (sh - 1);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return q;
}

uint8_t kv_fp8_from_float(float x)
{
    uint32_t u = f32_bits(x);
    uint32_t a = u & 0x7FFFFFFFu;
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);

    if (a > 0x7F800000u)
        return 0x7F;     /* NaN, sign dropped as in CUDA */
    if (a > 0x43E80000u) /* > 464.0f, includes inf */
        return (uint8_t)(sign | 0x7E);
    if (a <= 0x3A800000u) /* ≤ 2^-10: rounds to zero (the tie goes to even 0) */
        return sign;

    int e = (int)(a >> 23) - 127; /* unbiased exponent, -10 ≤ e ≤ 8 here */
    uint32_t code;
    if (e >= -6) {
        /* normal: keep 3 of 23 fraction bits. A rounding carry out of the mantissa lands in
         * the exponent field (codes are ordered like values), e.g. 15.5 → 16 = 0x58. */
        code = ((uint32_t)(e + 7) << 3) + shr_rne(a & 0x7FFFFFu, 20);
    } else {
        /* subnormal grid of 2^-9: value/2^-9 = sig·2^(e-14); 8 means the min normal 0x08. */
        uint32_t sig = (a & 0x7FFFFFu) | 0x800000u; /* value = sig·2^(e-23) */
        code = shr_rne(sig, (uint32_t)(14 - e));
    }
    /* 0x7F cannot come out: only 464 exactly would reach it, and that tie goes to even 448. */
    return (uint8_t)(sign | code);
}

float kv_fp8_to_float(uint8_t c)
{
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
    if (e == 0xF && m == 7)
        return f32_from_bits(sign | 0x7FC00000u); /* NaN keeps its sign bit */
    if (e == 0) {
        /* subnormal m·2^-9: exact in float */
        float v = (float)m * 0x1p-9f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((e - 7 + 127) << 23) | (m << 20));
}

uint16_t kv_half_from_float(float x)
{
    uint32_t u = f32_bits(x);
    uint32_t a = u & 0x7FFFFFFFu;
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);

    if (a > 0x7F800000u)
        return 0x7FFF; /* NaN → canonical NaN, as __float2half_rn */
    if (a == 0x7F800000u)
        return (uint16_t)(sign | 0x7C00u); /* ±inf */
    if (a >= 0x477FF000u)                  /* ≥ 65520 = max + half ulp: ties to even inf */
        return (uint16_t)(sign | 0x7C00u);
    if (a <= 0x33000000u) /* ≤ 2^-25: half the min subnormal → ±0 */
        return sign;
    int e = (int)(a >> 23) - 127;
    uint32_t h;
    if (e >= -14) {
        /* normal: the exponent field and the fraction are contiguous, so adding the rounded
         * fraction to the biased exponent carries correctly into the next binade (and 65504 +
         * carry cannot reach here: those inputs were caught above). */
        uint32_t frac = a & 0x7FFFFFu;
        uint32_t trunc = frac >> 13;
        h = ((uint32_t)(e + 15) << 10) + trunc + (shr_rne(frac, 13) - trunc);
    } else {
        /* subnormal grid of 2^-24: value/2^-24 = sig·2^(e+1) (e ≤ -15, so shift ≥ 14). */
        uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
        h = shr_rne(sig, (uint32_t)(-1 - e));
    }
    return (uint16_t)(sign | h);
}

float kv_half_to_float(uint16_t hb)
{
    uint32_t sign = (uint32_t)(hb & 0x8000u) << 16;
    uint32_t e = (hb >> 10) & 0x1Fu, m = hb & 0x3FFu;
    if (e == 0x1F)
        return f32_from_bits(sign | 0x7F800000u | (m << 13)); /* inf, or NaN with payload */
    if (e == 0) {
        float v = (float)m * 0x1p-24f; /* exact: m < 2^10 */
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((e - 15 + 127) << 23) | (m << 13));
}

void kv_fp8_encode_row(uint32_t d, const float *x, uint8_t *code, float *scale)
{
    float amax = 0.0f;
    for (uint32_t i = 0; i < d; i++) {
        float a = fabsf(x[i]);
        if (isfinite(a) && a > amax)
            amax = a;
    }
    float s = amax >= FLT_MIN ? amax / KV_FP8_MAX : 1.0f;
    for (uint32_t i = 0; i < d; i++)
        code[i] = kv_fp8_from_float(x[i] / s);
    *scale = s;
}

void kv_fp8_decode_row(uint32_t d, const uint8_t *code, float scale, float *x)
{
    for (uint32_t i = 0; i < d; i++)
        x[i] = kv_fp8_to_float(code[i]) * scale;
}
