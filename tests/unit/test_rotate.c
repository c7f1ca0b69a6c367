/* test_rotate.c — the Hadamard rotation R = H·diag(s)/sqrt(d) (cuda/rotate.c).
 *
 * Tolerances: the fast transform does log2(d) ≤ 8 rounds of float adds on values of similar
 * magnitude, so each output carries a relative error of a few 1e-7 of ‖x‖/sqrt(d); 1e-6 rel
 * for norms and round trips, and 1e-5 rel against a dense double product, leave ~10× margin.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "kvkern.h"

static uint64_t rng_state;

static double rng_gauss(void)
{
    double a = ((double)(kv_splitmix64(rng_state++) >> 11) + 1.0) * 0x1p-53;
    double b = (double)(kv_splitmix64(rng_state++) >> 11) * 0x1p-53;
    return sqrt(-2.0 * log(a)) * cos(6.283185307179586 * b);
}

static const uint32_t dims[] = {64, 128, 256};

static double norm2(uint32_t d, const float *x)
{
    double s = 0;
    for (uint32_t i = 0; i < d; i++)
        s += (double)x[i] * x[i];
    return s;
}

/* Sylvester H[i][j] = (-1)^popcount(i & j), built by the recursive definition. */
static void sylvester(uint32_t d, double *h)
{
    h[0] = 1;
    for (uint32_t n = 1; n < d; n <<= 1) {
        for (uint32_t i = 0; i < n; i++) {
            for (uint32_t j = 0; j < n; j++) {
                double v = h[i * d + j];
                h[i * d + j + n] = v;
                h[(i + n) * d + j] = v;
                h[(i + n) * d + j + n] = -v;
            }
        }
    }
}

static void test_rot_orthonormal_and_inverse(void **state)
{
    (void)state;
    float x[256], y[256], z[256];
    rng_state = 1;
    for (size_t k = 0; k < 3; k++) {
        uint32_t d = dims[k];
        for (int rep = 0; rep < 50; rep++) {
            for (uint32_t i = 0; i < d; i++)
                x[i] = (float)rng_gauss() * (rep % 5 == 0 && i < 4 ? 20.0f : 1.0f);
            kv_rot_forward(0xABCDu + rep, d, x, y);
            double nx = norm2(d, x), ny = norm2(d, y);
            assert_true(fabs(sqrt(ny) - sqrt(nx)) <= 1e-6 * sqrt(nx));
            kv_rot_inverse(0xABCDu + rep, d, y, z);
            double e = 0;
            for (uint32_t i = 0; i < d; i++)
                e += ((double)z[i] - x[i]) * ((double)z[i] - x[i]);
            assert_true(sqrt(e) <= 1e-6 * sqrt(nx));
            /* in place gives the same bits as out of place */
            memcpy(z, x, sizeof(float) * d);
            kv_rot_forward(0xABCDu + rep, d, z, z);
            assert_memory_equal(z, y, sizeof(float) * d);
        }
    }
}

static void test_rot_matches_dense(void **state)
{
    (void)state;
    static double h[256 * 256];
    float x[256], y[256], xi[256];
    rng_state = 2;
    for (size_t k = 0; k < 3; k++) {
        uint32_t d = dims[k];
        uint64_t seed = 77 + k;
        sylvester(d, h);
        for (uint32_t i = 0; i < d; i++)
            x[i] = (float)rng_gauss();
        kv_rot_forward(seed, d, x, y);
        kv_rot_inverse(seed, d, x, xi);
        double nx = sqrt(norm2(d, x)), emax = 0, emax_inv = 0;
        for (uint32_t i = 0; i < d; i++) {
            double r = 0, ri = 0; /* (H·diag(s)·x)_i and (diag(s)·H·x)_i */
            for (uint32_t j = 0; j < d; j++) {
                r += h[i * d + j] * kv_rot_sign(seed, j) * x[j];
                ri += h[i * d + j] * x[j];
            }
            r /= sqrt((double)d);
            ri *= kv_rot_sign(seed, i) / sqrt((double)d);
            emax = fmax(emax, fabs(r - y[i]));
            emax_inv = fmax(emax_inv, fabs(ri - xi[i]));
        }
        assert_true(emax <= 1e-5 * nx);
        assert_true(emax_inv <= 1e-5 * nx);
    }
}

static void test_rot_signs_depend_on_seed(void **state)
{
    (void)state;
    for (uint64_t seed = 0; seed < 8; seed++) {
        int diff = 0, neg = 0;
        for (uint32_t i = 0; i < 256; i++) {
            diff += kv_rot_sign(seed, i) != kv_rot_sign(seed + 1, i);
            neg += kv_rot_sign(seed, i) < 0;
        }
        /* Independent fair signs: Binomial(256, 1/2) has sd 8; 80..176 is > 5 sd. */
        assert_in_range(diff, 80, 176);
        assert_in_range(neg, 80, 176);
    }
    /* different seeds rotate differently */
    float x[128], y1[128], y2[128];
    for (int i = 0; i < 128; i++)
        x[i] = (float)(i % 7) - 3.0f;
    kv_rot_forward(1, 128, x, y1);
    kv_rot_forward(2, 128, x, y2);
    assert_memory_not_equal(y1, y2, sizeof y1);
}

static void test_rot_spreads_outlier(void **state)
{
    (void)state;
    /* a one-hot vector maps to ±1/sqrt(d) everywhere: the reason TQ3 tolerates outliers */
    float x[128] = {0}, y[128];
    x[37] = 1.0f;
    kv_rot_forward(5, 128, x, y);
    for (int i = 0; i < 128; i++)
        assert_float_equal(fabsf(y[i]), 1.0f / sqrtf(128.0f), 1e-7);
}

static void test_rot_bad_dim_is_nan(void **state)
{
    (void)state;
    float x[96] = {0}, y[96];
    kv_rot_forward(1, 96, x, y);
    for (int i = 0; i < 96; i++)
        assert_true(isnan(y[i]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rot_orthonormal_and_inverse),
        cmocka_unit_test(test_rot_matches_dense),
        cmocka_unit_test(test_rot_signs_depend_on_seed),
        cmocka_unit_test(test_rot_spreads_outlier),
        cmocka_unit_test(test_rot_bad_dim_is_nan),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
