/* test_tq3.c — TQ3 bit planes and the key/value row codecs (cuda/tq3.c).
 *
 * Quality bounds (Gaussian N(0,1) data, NMSE = Σ‖x − x̂‖² / Σ‖x‖²):
 *   keys   ≤ 0.036: the 3-bit Lloyd–Max quantizer of N(0,1) has distortion 0.03455; rotated
 *          unit-vector coordinates are close to N(0,1/d), and the least-squares γ can only
 *          lower the error of the direction code, so 0.036 leaves ~4% for the finite-d effects.
 *   values ≤ 0.05: kv_format.h fixes the grid to 8 uniform levels of step 0.5860σ centred on
 *          the mean (the MSE-optimal uniform quantizer of a Gaussian, distortion 0.0374) unless
 *          min/max is narrower. A plain min/max grid would give ≈ 0.04, 0.046, 0.054 at
 *          d = 64, 128, 256 (the range of d Gaussians grows with d); the clipped grid holds
 *          ≈ 0.037–0.038 at every d, so 0.05 leaves room for σ estimation noise.
 *   outliers (4 channels × 20): the rotation mixes them into every coordinate, so the bound is
 *          1.5 × the Gaussian figure of the same d, as the design asks.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
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

static const float cent[KV_TQ3_LEVELS] = KV_TQ3_CENTROIDS_INIT;
static const uint32_t dims[] = {64, 128, 256};

static void test_tq3_pack_roundtrip(void **state)
{
    (void)state;
    uint32_t planes[256 / 32 * 3], code[256];
    rng_state = 11;
    for (size_t k = 0; k < 3; k++) {
        uint32_t d = dims[k];
        memset(planes, 0xA5, sizeof planes); /* set must overwrite whatever was there */
        for (uint32_t i = 0; i < d; i++) {
            code[i] = (uint32_t)(rng_u64() & 7);
            kv_tq3_code_set(planes, i, code[i]);
        }
        for (uint32_t i = 0; i < d; i++)
            assert_int_equal(kv_tq3_code_get(planes, i), code[i]);
        /* every code value at every position, neighbours untouched */
        for (uint32_t i = 0; i < d; i++) {
            for (uint32_t c = 0; c < 8; c++) {
                kv_tq3_code_set(planes, i, c);
                assert_int_equal(kv_tq3_code_get(planes, i), c);
                if (i > 0)
                    assert_int_equal(kv_tq3_code_get(planes, i - 1), code[i - 1]);
                if (i + 1 < d)
                    assert_int_equal(kv_tq3_code_get(planes, i + 1), code[i + 1]);
            }
            kv_tq3_code_set(planes, i, code[i]);
        }
    }
}

static void test_tq3_plane_layout(void **state)
{
    (void)state;
    uint32_t w[6] = {0};
    /* code_i = i mod 8: plane k holds bit k of (j mod 8) at bit j */
    for (uint32_t i = 0; i < 64; i++)
        kv_tq3_code_set(w, i, i % 8);
    for (int g = 0; g < 2; g++) {
        assert_int_equal(w[3 * g + 0], 0xAAAAAAAAu);
        assert_int_equal(w[3 * g + 1], 0xCCCCCCCCu);
        assert_int_equal(w[3 * g + 2], 0xF0F0F0F0u);
    }
    memset(w, 0, sizeof w);
    kv_tq3_code_set(w, 33, 5); /* group 1, j = 1, code 101b */
    kv_tq3_code_set(w, 31, 6); /* group 0, j = 31, code 110b */
    assert_int_equal(w[0], 0);
    assert_int_equal(w[1], 0x80000000u);
    assert_int_equal(w[2], 0x80000000u);
    assert_int_equal(w[3], 0x2u);
    assert_int_equal(w[4], 0);
    assert_int_equal(w[5], 0x2u);
}

/* NMSE of keys (kind 0) or values (kind 1) over rows of N(0,1) with `outliers` channels ×20. */
static double tq3_nmse(uint32_t d, int kind, int outliers, int rows, uint64_t seed)
{
    float x[256], y[256];
    uint32_t planes[256 / 32 * 3];
    uint16_t a, b;
    double err = 0, tot = 0;
    for (int r = 0; r < rows; r++) {
        for (uint32_t i = 0; i < d; i++)
            x[i] = (float)rng_gauss() * ((int)(i * 37 % d) < outliers ? 20.0f : 1.0f);
        if (kind == 0) {
            kv_tq3_encode_key(seed, d, x, planes, &a);
            kv_tq3_decode_key(seed, d, planes, a, y);
        } else {
            kv_tq3_encode_value(seed, d, x, planes, &a, &b);
            kv_tq3_decode_value(seed, d, planes, a, b, y);
        }
        for (uint32_t i = 0; i < d; i++) {
            err += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
            tot += (double)x[i] * x[i];
        }
    }
    return err / tot;
}

static void test_tq3_quality(void **state)
{
    (void)state;
    rng_state = 21;
    for (size_t k = 0; k < 3; k++) {
        uint32_t d = dims[k];
        double kg = tq3_nmse(d, 0, 0, 2000, 0x51 + k), vg = tq3_nmse(d, 1, 0, 2000, 0x61 + k);
        double ko = tq3_nmse(d, 0, 4, 2000, 0x71 + k), vo = tq3_nmse(d, 1, 4, 2000, 0x81 + k);
        print_message("d=%u  key NMSE %.4f (outliers %.4f)  value NMSE %.4f (outliers %.4f)\n", d,
                      kg, ko, vg, vo);
        assert_true(kg <= 0.036);
        assert_true(vg <= 0.05);
        assert_true(ko <= 1.5 * kg);
        assert_true(vo <= 1.5 * vg);
        /* lower bounds: a 3-bit code cannot beat these; catches a test that compares x to x */
        assert_true(kg >= 0.02);
        assert_true(vg >= 0.02);
    }
}

/* The stored key is exactly the documented one: nearest centroid per coordinate and the
 * least-squares γ = ‖k‖⟨y,ĉ⟩/‖ĉ‖², recomputed here in double. */
static void test_tq3_key_contract(void **state)
{
    (void)state;
    float k[256], y[256], kh[256];
    uint32_t planes[256 / 32 * 3];
    uint16_t nh;
    rng_state = 31;
    for (size_t s = 0; s < 3; s++) {
        uint32_t d = dims[s];
        for (int rep = 0; rep < 200; rep++) {
            for (uint32_t i = 0; i < d; i++)
                k[i] = (float)rng_gauss() * 0.3f;
            kv_tq3_encode_key(9, d, k, planes, &nh);
            kv_rot_forward(9, d, k, y);
            double n = 0, dot = 0, c2 = 0;
            for (uint32_t i = 0; i < d; i++)
                n += (double)k[i] * k[i];
            n = sqrt(n);
            for (uint32_t i = 0; i < d; i++) {
                double z = y[i] * sqrt((double)d) / n;
                uint32_t c = kv_tq3_code_get(planes, i);
                for (int o = 0; o < 8; o++) /* nearest, up to float rounding of z */
                    assert_true(fabs(z - cent[c]) <= fabs(z - cent[o]) + 1e-5);
                dot += y[i] / n * cent[c] / sqrt((double)d);
                c2 += (double)cent[c] * cent[c] / d;
            }
            double g = n * dot / c2, gh = kv_half_to_float(nh);
            /* FP16 rounding is half an ulp (2^-11 rel); the encoder's float z can move g across
             * a rounding midpoint, so allow one full ulp. */
            assert_true(fabs(gh - g) <= g * 0x1p-10);
            /* decode = γ·Rᵀĉ */
            kv_tq3_decode_key(9, d, planes, nh, kh);
            float t[256], ref[256];
            for (uint32_t i = 0; i < d; i++)
                t[i] = (float)(gh * cent[kv_tq3_code_get(planes, i)] / sqrt((double)d));
            kv_rot_inverse(9, d, t, ref);
            for (uint32_t i = 0; i < d; i++)
                assert_float_equal(kh[i], ref[i], 1e-6 * gh);
        }
    }
}

/* k = s (the sign vector) rotates to exactly sqrt(d)·e_0: coordinates 1..d-1 are exactly 0,
 * the midpoint between codes 3 and 4, and must take the UPPER code 4. */
static void test_tq3_key_tie_goes_up(void **state)
{
    (void)state;
    for (size_t s = 0; s < 3; s++) {
        uint32_t d = dims[s];
        float k[256];
        uint32_t planes[256 / 32 * 3];
        uint16_t nh;
        for (uint32_t i = 0; i < d; i++)
            k[i] = kv_rot_sign(123, i);
        kv_tq3_encode_key(123, d, k, planes, &nh);
        assert_int_equal(kv_tq3_code_get(planes, 0), 7);
        for (uint32_t i = 1; i < d; i++)
            assert_int_equal(kv_tq3_code_get(planes, i), 4);
    }
}

static void test_tq3_value_contract(void **state)
{
    (void)state;
    float v[256], y[256];
    uint32_t planes[256 / 32 * 3];
    uint16_t sh, zh;
    rng_state = 41;
    for (size_t s = 0; s < 3; s++) {
        uint32_t d = dims[s];
        for (int rep = 0; rep < 200; rep++) {
            for (uint32_t i = 0; i < d; i++)
                v[i] = (float)rng_gauss() * 2.0f + 0.5f;
            kv_tq3_encode_value(5, d, v, planes, &sh, &zh);
            kv_rot_forward(5, d, v, y);
            /* tq3.c's order: sums pairwise (adjacent pairs first), zero extremes as +0 */
            float lo = y[0], hi = y[0], t[256] = {0};
            for (uint32_t i = 0; i < d; i++) {
                lo = fminf(lo, y[i]);
                hi = fmaxf(hi, y[i]);
                t[i] = y[i];
            }
            lo += 0.0f;
            hi += 0.0f;
            for (uint32_t h = 1; h < d; h <<= 1)
                for (uint32_t i = 0; i < d; i += 2 * h)
                    t[i] += t[i + h];
            float sum = t[0], mean = sum / (float)d;
            for (uint32_t i = 0; i < d; i++)
                t[i] = (y[i] - mean) * (y[i] - mean);
            for (uint32_t h = 1; h < d; h <<= 1)
                for (uint32_t i = 0; i < d; i += 2 * h)
                    t[i] += t[i + h];
            float var = t[0];
            float step = 0.5860f * sqrtf(var / (float)d);
            float z0 = lo, s0 = (hi - lo) / 7.0f;
            if (step < s0) {
                z0 = mean - 3.5f * step;
                s0 = step;
            }
            assert_int_equal(zh, kv_half_from_float(z0));
            assert_int_equal(sh, kv_half_from_float(s0));
            float z = kv_half_to_float(zh), sc = kv_half_to_float(sh);
            for (uint32_t i = 0; i < d; i++) {
                float q = rintf((y[i] - z) / sc);
                q = q < 0 ? 0 : q > 7 ? 7 : q;
                assert_int_equal(kv_tq3_code_get(planes, i), (uint32_t)q);
            }
        }
    }
}

static void test_tq3_degenerate(void **state)
{
    (void)state;
    float x[128] = {0}, y[128];
    uint32_t planes[12];
    uint16_t a = 0xFFFF, b = 0xFFFF;
    /* zero key: γ = 0, codes 0, decodes to zero */
    kv_tq3_encode_key(1, 128, x, planes, &a);
    assert_int_equal(a, 0);
    for (int i = 0; i < 12; i++)
        assert_int_equal(planes[i], 0);
    kv_tq3_decode_key(1, 128, planes, a, y);
    for (int i = 0; i < 128; i++)
        assert_true(y[i] == 0.0f);
    /* zero value: scale 0, zero 0 */
    kv_tq3_encode_value(1, 128, x, planes, &a, &b);
    assert_int_equal(a, 0);
    assert_int_equal(b, 0);
    /* constant in the rotated basis: scale 0, codes 0, decodes to the input */
    float r[128];
    for (int i = 0; i < 128; i++)
        r[i] = 0.75f;
    kv_rot_inverse(1, 128, r, x);
    kv_tq3_encode_value(1, 128, x, planes, &a, &b);
    kv_tq3_decode_value(1, 128, planes, a, b, y);
    for (int i = 0; i < 12; i++)
        assert_int_equal(planes[i], 0);
    for (int i = 0; i < 128; i++)
        assert_float_equal(y[i], x[i], 1e-5);
    /* non-finite input: stored as zero, decodes to zeros rather than NaN */
    x[7] = NAN;
    kv_tq3_encode_key(1, 128, x, planes, &a);
    assert_int_equal(a, 0);
    kv_tq3_encode_value(1, 128, x, planes, &a, &b);
    assert_int_equal(a, 0);
    assert_int_equal(b, 0);
    x[7] = INFINITY;
    kv_tq3_encode_key(1, 128, x, planes, &a);
    assert_int_equal(a, 0);
    /* a huge key saturates γ at the FP16 max instead of storing inf */
    for (int i = 0; i < 128; i++)
        x[i] = 1e5f;
    kv_tq3_encode_key(1, 128, x, planes, &a);
    assert_int_equal(a, 0x7BFF);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tq3_pack_roundtrip),  cmocka_unit_test(test_tq3_plane_layout),
        cmocka_unit_test(test_tq3_quality),         cmocka_unit_test(test_tq3_key_contract),
        cmocka_unit_test(test_tq3_key_tie_goes_up), cmocka_unit_test(test_tq3_value_contract),
        cmocka_unit_test(test_tq3_degenerate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
