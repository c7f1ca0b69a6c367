/* test_fp8.c — e4m3 and binary16 scalar conversions and the FP8 row codec (cuda/fp8.c).
 *
 * The scalar conversions must be bit-exact with CUDA (__nv_cvt_float_to_fp8 SATFINITE E4M3,
 * __float2half_rn), so these tests use exact equality everywhere and compare against
 * references written independently of fp8.c: a decode formula built from ldexp, and a
 * brute-force "nearest of all 256 codes, ties to the even code" search in double.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvkern.h"

static uint64_t rng_state;

static uint64_t rng_u64(void)
{
    return kv_splitmix64(rng_state++);
}

static double rng_gauss(void)
{
    double a = ((double)(rng_u64() >> 11) + 1.0) * 0x1p-53;
    double b = (double)(rng_u64() >> 11) * 0x1p-53;
    return sqrt(-2.0 * log(a)) * cos(6.283185307179586 * b);
}

static float f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* e4m3 value of a code from the format definition, NaN for S.1111.111. */
static double fp8_ref_decode(int c)
{
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7)
        return NAN;
    double v = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    return s ? -v : v;
}

/* Brute force: the code nearest to x among all finite codes of x's sign; ties to the code with
 * an even mantissa LSB; |x| > 464 saturates (SATFINITE); NaN → 0x7F. */
static uint8_t fp8_ref_encode(float x)
{
    if (isnan(x))
        return 0x7F;
    int neg = signbit(x) != 0;
    if (fabs((double)x) > 464.0)
        return (uint8_t)((neg << 7) | 0x7E);
    double best = INFINITY;
    int bc = -1;
    for (int m = 0; m < 0x7F; m++) {
        double err = fabs(fp8_ref_decode(m) - fabs((double)x));
        if (err < best || (err == best && (m & 1) == 0)) {
            best = err;
            bc = m;
        }
    }
    return (uint8_t)((neg << 7) | bc);
}

static void test_fp8_decode_all_codes(void **state)
{
    (void)state;
    for (int c = 0; c < 256; c++) {
        float got = kv_fp8_to_float((uint8_t)c);
        double want = fp8_ref_decode(c);
        if (isnan(want)) {
            assert_true(isnan(got));
        } else {
            assert_true((double)got == want);
            assert_int_equal(signbit(got) != 0, (c >> 7) != 0);
        }
    }
    assert_true(kv_fp8_to_float(0x7E) == 448.0f);
    assert_true(kv_fp8_to_float(0x01) == 0x1p-9f);
    assert_true(kv_fp8_to_float(0x08) == 0x1p-6f);
}

static void test_fp8_roundtrip_all_codes(void **state)
{
    (void)state;
    for (int c = 0; c < 256; c++) {
        uint8_t back = kv_fp8_from_float(kv_fp8_to_float((uint8_t)c));
        if ((c & 0x7F) == 0x7F)
            assert_int_equal(back, 0x7F); /* NaN of either sign → 0x7F, as CUDA */
        else
            assert_int_equal(back, c); /* includes -0 → 0x80 */
    }
}

/* Every midpoint between adjacent codes goes to the even code; its float neighbours go to
 * the nearer code. Midpoints of e4m3 values need 5 significant bits: exact in float. */
static void test_fp8_midpoints(void **state)
{
    (void)state;
    for (int sign = 0; sign <= 1; sign++) {
        for (int c = 0; c < 0x7E; c++) {
            float lo = kv_fp8_to_float((uint8_t)c), hi = kv_fp8_to_float((uint8_t)(c + 1));
            float mid = 0.5f * (lo + hi);
            assert_true((double)mid == 0.5 * ((double)lo + (double)hi));
            float s = sign ? -1.0f : 1.0f;
            int even = (c & 1) == 0 ? c : c + 1;
            uint8_t sb = (uint8_t)(sign << 7);
            assert_int_equal(kv_fp8_from_float(s * mid), sb | even);
            assert_int_equal(kv_fp8_from_float(s * nextafterf(mid, 0.0f)), sb | c);
            assert_int_equal(kv_fp8_from_float(s * nextafterf(mid, INFINITY)), sb | (c + 1));
        }
    }
    /* zero/min-subnormal boundary: 2^-10 is the tie and goes to 0 */
    assert_int_equal(kv_fp8_from_float(0x1p-10f), 0x00);
    assert_int_equal(kv_fp8_from_float(nextafterf(0x1p-10f, 1.0f)), 0x01);
    assert_int_equal(kv_fp8_from_float(-0x1p-10f), 0x80);
    assert_int_equal(kv_fp8_from_float(3 * 0x1p-10f), 0x02);  /* 1.5 ulp → even 2 */
    assert_int_equal(kv_fp8_from_float(15 * 0x1p-10f), 0x08); /* 7.5 → 8 = min normal */
    assert_int_equal(kv_fp8_from_float(FLT_TRUE_MIN), 0x00);
    assert_int_equal(kv_fp8_from_float(-FLT_TRUE_MIN), 0x80);
    assert_int_equal(kv_fp8_from_float(15.5f), 0x58); /* carry into the exponent */
}

static void test_fp8_saturation_and_specials(void **state)
{
    (void)state;
    const float big[] = {448.0f,  449.0f, 460.0f,  464.0f,  nextafterf(464.0f, INFINITY),
                         1000.0f, 1e30f,  FLT_MAX, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        assert_int_equal(kv_fp8_from_float(big[i]), 0x7E);
        assert_int_equal(kv_fp8_from_float(-big[i]), 0xFE);
    }
    assert_int_equal(kv_fp8_from_float(nextafterf(448.0f, 0.0f)), 0x7E);
    assert_int_equal(kv_fp8_from_float(416.0f), 0x7D);
    assert_int_equal(kv_fp8_from_float(432.0f), 0x7E); /* tie 416|448 → even mantissa 6 */
    assert_int_equal(kv_fp8_from_float(400.0f), 0x7C); /* tie 384|416 → even mantissa 4 */
    assert_int_equal(kv_fp8_from_float(NAN), 0x7F);
    assert_int_equal(kv_fp8_from_float(-NAN), 0x7F);
    assert_int_equal(kv_fp8_from_float(f32(0xFFC00001u)), 0x7F);
    assert_int_equal(kv_fp8_from_float(f32(0x7F800001u)), 0x7F); /* signalling NaN */
    assert_int_equal(kv_fp8_from_float(0.0f), 0x00);
    assert_int_equal(kv_fp8_from_float(-0.0f), 0x80);
}

static void test_fp8_random_vs_bruteforce(void **state)
{
    (void)state;
    rng_state = 0xF8F8;
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)rng_u64();
        if (i % 8 != 0) /* 7 of 8: exponents 2^-14 … 2^10, where every rounding case lives */
            u = (u & 0x807FFFFFu) | ((uint32_t)(127 - 14 + (rng_u64() % 25)) << 23);
        float x = f32(u);
        uint8_t got = kv_fp8_from_float(x), want = fp8_ref_encode(x);
        if (got != want)
            fail_msg("x=%a got 0x%02x want 0x%02x", (double)x, got, want);
    }
}

/* ---- binary16 ---------------------------------------------------------------------------- */
static double half_ref_decode(uint16_t h)
{
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

/* Round to the binary16 grid in double (nearbyint = ties to even in the default mode). */
static double half_ref_round(float x)
{
    double a = fabs((double)x);
    if (a >= 65520.0)
        return signbit(x) ? -INFINITY : INFINITY;
    int e;
    frexp(a, &e); /* a = f·2^e, f ∈ [0.5, 1) → ulp 2^(e-11), at least 2^-24 */
    int q = e - 11 < -24 ? -24 : e - 11;
    double r = ldexp(nearbyint(ldexp(a, -q)), q);
    return signbit(x) ? -r : r;
}

static void test_half_exhaustive(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kv_half_to_float((uint16_t)h);
        double want = half_ref_decode((uint16_t)h);
        uint16_t back = kv_half_from_float(f);
        if (isnan(want)) {
            assert_true(isnan(f));
            assert_int_equal(back, 0x7FFF); /* canonical NaN, as __float2half_rn */
        } else {
            assert_true((double)f == want);
            assert_int_equal(back, h);
        }
    }
}

static void test_half_boundaries(void **state)
{
    (void)state;
    assert_int_equal(kv_half_from_float(65504.0f), 0x7BFF);
    assert_int_equal(kv_half_from_float(nextafterf(65520.0f, 0.0f)), 0x7BFF);
    assert_int_equal(kv_half_from_float(65520.0f), 0x7C00); /* tie, 0x7BFF odd → inf */
    assert_int_equal(kv_half_from_float(-1e9f), 0xFC00);
    assert_int_equal(kv_half_from_float(INFINITY), 0x7C00);
    assert_int_equal(kv_half_from_float(0x1p-24f), 0x0001);
    assert_int_equal(kv_half_from_float(0x1p-25f), 0x0000);
    assert_int_equal(kv_half_from_float(-0x1p-25f), 0x8000);
    assert_int_equal(kv_half_from_float(nextafterf(0x1p-25f, 1.0f)), 0x0001);
    assert_int_equal(kv_half_from_float(3 * 0x1p-25f), 0x0002);
    assert_int_equal(kv_half_from_float(1.0f + 0x1p-11f), 0x3C00);
    assert_int_equal(kv_half_from_float(1.0f + 3 * 0x1p-11f), 0x3C02);
    assert_int_equal(kv_half_from_float(0x1p-14f - 0x1p-25f), 0x0400); /* to min normal */
    assert_int_equal(kv_half_from_float(NAN), 0x7FFF);
    assert_int_equal(kv_half_from_float(-NAN), 0x7FFF);
    assert_int_equal(kv_half_from_float(-0.0f), 0x8000);
}

static void test_half_random(void **state)
{
    (void)state;
    rng_state = 0x1616;
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)rng_u64();
        if (i % 8 != 0) /* exponents 2^-26 … 2^16 */
            u = (u & 0x807FFFFFu) | ((uint32_t)(127 - 26 + (rng_u64() % 43)) << 23);
        float x = f32(u);
        if (isnan(x))
            continue;
        double got = (double)kv_half_to_float(kv_half_from_float(x));
        double want = half_ref_round(x);
        if (got != want || signbit(got) != signbit(want))
            fail_msg("x=%a got %a want %a", (double)x, got, want);
    }
}

/* ---- rows -------------------------------------------------------------------------------- */
static void test_fp8_row_gaussian_nmse(void **state)
{
    (void)state;
    enum { D = 128, ROWS = 4096 };
    float x[D], y[D];
    uint8_t code[D];
    double err = 0, tot = 0;
    rng_state = 0x5EED;
    for (int r = 0; r < ROWS; r++) {
        for (int i = 0; i < D; i++)
            x[i] = (float)rng_gauss();
        float s;
        kv_fp8_encode_row(D, x, code, &s);
        kv_fp8_decode_row(D, code, s, y);
        float amax = 0;
        for (int i = 0; i < D; i++) {
            err += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
            tot += (double)x[i] * x[i];
            amax = fmaxf(amax, fabsf(x[i]));
        }
        assert_true(s == amax / 448.0f);
    }
    double nmse = err / tot;
    print_message("fp8 row NMSE on N(0,1), d=128: %.3e\n", nmse);
    /* 3 mantissa bits: relative step 2^-3 of the binade → uniform error ≈ (2^-3·|x|)²/12 ·
     * E[2^(2·floor(log2|x|))/x²] ≈ 1.3e-3 · 0.5 ≈ 6e-4. Bound 1e-3 leaves headroom; the
     * lower bound catches a codec that stopped quantizing. */
    assert_true(nmse < 1e-3);
    assert_true(nmse > 1e-4);
}

static void test_fp8_row_edge_cases(void **state)
{
    (void)state;
    enum { D = 64 };
    float x[D], y[D], s;
    uint8_t code[D];

    memset(x, 0, sizeof x);
    kv_fp8_encode_row(D, x, code, &s);
    assert_true(s == 1.0f);
    for (int i = 0; i < D; i++)
        assert_int_equal(code[i], 0);

    for (int i = 0; i < D; i++)
        x[i] = (float)(i - 20) * 0.25f;
    kv_fp8_encode_row(D, x, code, &s);
    assert_true(s == 43.0f * 0.25f / 448.0f);
    assert_int_equal(code[D - 1], 0x7E); /* the amax element maps to exactly 448 */
    kv_fp8_decode_row(D, code, s, y);
    for (int i = 0; i < D; i++)
        assert_true(fabsf(y[i] - x[i]) <= fabsf(x[i]) * 0.0625f + 1e-7f);

    /* non-finite inputs: amax over finite values, inf saturates, NaN stays NaN */
    x[3] = INFINITY;
    x[4] = -INFINITY;
    x[5] = NAN;
    kv_fp8_encode_row(D, x, code, &s);
    assert_true(s == 43.0f * 0.25f / 448.0f);
    assert_int_equal(code[3], 0x7E);
    assert_int_equal(code[4], 0xFE);
    assert_int_equal(code[5], 0x7F);

    /* all-subnormal row: scale 1, every code ±0 */
    for (int i = 0; i < D; i++)
        x[i] = (i & 1 ? -1.0f : 1.0f) * FLT_TRUE_MIN * (float)(i + 1);
    kv_fp8_encode_row(D, x, code, &s);
    assert_true(s == 1.0f);
    for (int i = 0; i < D; i++)
        assert_int_equal(code[i] & 0x7F, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp8_decode_all_codes),
        cmocka_unit_test(test_fp8_roundtrip_all_codes),
        cmocka_unit_test(test_fp8_midpoints),
        cmocka_unit_test(test_fp8_saturation_and_specials),
        cmocka_unit_test(test_fp8_random_vs_bruteforce),
        cmocka_unit_test(test_half_exhaustive),
        cmocka_unit_test(test_half_boundaries),
        cmocka_unit_test(test_half_random),
        cmocka_unit_test(test_fp8_row_gaussian_nmse),
        cmocka_unit_test(test_fp8_row_edge_cases),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
