/* test_util.c — kvd/util.c: the u64 map against a plain array under random churn (the
 * backward-shift deletion is the subtle part), draining it with kvd_map_pop, reserve making
 * inserts infallible, the allocation wrapper's fail-after-N hook and live counter.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "kv_format.h"
#include "util.h"

#define UNIVERSE 300 /* keys 0..299, with small ranges so probe runs collide and wrap */

static void test_map_random_churn(void **state)
{
    kvd_map_t m;
    kvd_map_init(&m);
    uint64_t ref[UNIVERSE];
    int present[UNIVERSE] = {0};
    uint64_t rng = 12345, count = 0;
    for (int step = 0; step < 200000; step++) {
        rng = kv_splitmix64(rng);
        uint64_t k = rng % UNIVERSE, op = (rng >> 20) % 3;
        /* keys spread over the whole u64 range too: k * a large odd constant */
        uint64_t key = k * 0x9E3779B97F4A7C15ull;
        if (op < 2) {
            assert_int_equal(kvd_map_put(&m, key, step), 0);
            if (!present[k])
                count++;
            present[k] = 1;
            ref[k] = (uint64_t)step;
        } else {
            assert_int_equal(kvd_map_del(&m, key), present[k]);
            if (present[k])
                count--;
            present[k] = 0;
        }
        assert_int_equal(m.len, count);
        if (step % 997 == 0) {
            for (int i = 0; i < UNIVERSE; i++) {
                uint64_t *v = kvd_map_get(&m, i * 0x9E3779B97F4A7C15ull);
                if (present[i]) {
                    assert_non_null(v);
                    assert_int_equal(*v, ref[i]);
                } else {
                    assert_null(v);
                }
            }
            uint64_t pos = 0, kk, vv, seen = 0;
            while (kvd_map_next(&m, &pos, &kk, &vv))
                seen++;
            assert_int_equal(seen, count);
        }
    }
    kvd_map_fini(&m);
}

static void test_reserve_and_fail_hook(void **state)
{
    int64_t live0 = kvd_alloc_live();
    kvd_map_t m;
    kvd_map_init(&m);
    assert_int_equal(kvd_map_reserve(&m, 100), 0);
    int64_t live1 = kvd_alloc_live();
    kvd_alloc_fail_after(1); /* every allocation fails from now on */
    uint64_t fit = m.cap * 3 / 4; /* ≥ 100: what fits under the load limit without growing */
    assert_true(fit >= 100);
    for (uint64_t i = 0; i < fit; i++)
        assert_int_equal(kvd_map_put(&m, i, i), 0); /* reserved: no allocation needed */
    assert_int_equal(kvd_map_put(&m, 100000, 1), -1); /* one more needs to grow: fails */
    assert_null(kvd_map_get(&m, 100000));
    assert_int_equal(m.len, fit);
    assert_int_equal(kvd_map_put(&m, 5, 55), 0); /* overwrite needs no room */
    assert_int_equal(*kvd_map_get(&m, 5), 55);
    assert_null(kvd_malloc(8));
    kvd_alloc_fail_after(3); /* two succeed, the third fails */
    void *a = kvd_malloc(1), *b = kvd_calloc(2, 2), *c = kvd_malloc(1);
    assert_non_null(a);
    assert_non_null(b);
    assert_null(c);
    kvd_alloc_fail_after(0);
    assert_int_equal(kvd_alloc_live(), live1 + 2);
    kvd_free(a);
    kvd_free(b);
    assert_null(kvd_calloc(SIZE_MAX / 2, 4)); /* overflow refused */
    kvd_map_fini(&m);
    assert_int_equal(kvd_alloc_live(), live0);
}

/* kvd_map_pop drains every entry exactly once with its value, while the caller deletes other
 * keys between pops (as a session close does), at fill levels from sparse to the 3/4 bound
 * where probe runs are long and wrap past the end; the scan position never passes the end. */
static void test_map_pop_drains(void **state)
{
    (void)state;
    srand(7);
    for (int round = 0; round < 200; round++) {
        kvd_map_t m;
        kvd_map_init(&m);
        int present[UNIVERSE] = {0}, popped[UNIVERSE] = {0};
        const int n = 1 + rand() % UNIVERSE;
        for (int i = 0; i < n; i++) {
            const int k = rand() % UNIVERSE;
            assert_int_equal(kvd_map_put(&m, (uint64_t)k, (uint64_t)k * 3 + 1), 0);
            present[k] = 1;
        }
        uint64_t pos = 0, k, v, last = 0;
        int left = 0;
        for (int i = 0; i < UNIVERSE; i++)
            left += present[i];
        while (kvd_map_pop(&m, &pos, &k, &v)) {
            assert_true(k < UNIVERSE && present[k] && !popped[k]);
            assert_int_equal(v, k * 3 + 1);
            assert_true(pos >= last && pos < m.cap);
            last = pos;
            popped[k] = 1;
            present[k] = 0;
            left--;
            if (rand() % 4 == 0) { /* the caller deletes another key meanwhile */
                const int o = rand() % UNIVERSE;
                assert_int_equal(kvd_map_del(&m, (uint64_t)o), present[o]);
                left -= present[o];
                present[o] = 0;
            }
            assert_int_equal(m.len, (uint64_t)left);
        }
        assert_int_equal(left, 0);
        assert_int_equal(m.len, 0);
        kvd_map_fini(&m);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_map_random_churn),
        cmocka_unit_test(test_map_pop_drains),
        cmocka_unit_test(test_reserve_and_fail_hook),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
