/* it_sessions.c — one process, several sessions: every hello maps the pools.
 *
 * The fd socket knows only the peer's pid (SO_PEERCRED), so the session id it sends with the
 * fds is one of that process's sessions, not necessarily the one that just said hello. libkvc
 * accepts any (the fds are the namespace's, the same for every session). Before session 10 it
 * demanded its own id and refused the handover: a second kvc_t's hello, a rehello of an older
 * kvc_t, and most of a burst of concurrent hellos from worker threads (one kvc_t per thread,
 * the documented thread rule) failed with INTERNAL "fd handover for session N, expected M".
 * Each check below failed then. Also: pages written through one session's mapping are read
 * back through the other's (the same pools).
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "itest.h"

#define THREADS 4
#define ROUNDS 10

static const itest_kvd_t *g_k;

static void *hello_thread(void *arg)
{
    kvc_t *c = NULL;
    if (kvc_connect(&c, g_k->endpoint, 30000) != KV_ERR_OK)
        return NULL;
    if (kvc_hello(c, NULL, (const char *)arg, 1) != KV_ERR_OK) {
        fprintf(stderr, "thread hello: %s\n", kvc_errmsg(c));
        kvc_close(&c);
        return NULL;
    }
    return c; /* mapped: checked and closed by the main thread */
}

static void test_one_process_many_sessions(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    g_k = &k;
    kvc_t *a = itest_connect(&k, "A");
    kvc_t *b = itest_connect(&k, "B"); /* the second session of this pid maps too */
    assert_non_null(kvc_pool_base(b, KV_FMT_FP8));
    assert_true(kvc_session_id(a) != kvc_session_id(b));

    /* one pool behind both: bytes written through A's mapping are B's */
    uint32_t page;
    assert_int_equal(kvc_alloc(a, KV_FMT_FP8, 1, &page), KV_ERR_OK);
    uint8_t *pa = kvc_page_ptr(a, page), *pb = kvc_page_ptr(b, page);
    assert_non_null(pa);
    assert_non_null(pb);
    memset(pa, 0x5a, 64);
    assert_int_equal(memcmp(pa, pb, 64), 0);
    assert_int_equal(kvc_release(a, &page, 1), KV_ERR_OK);

    /* the older kvc_t says hello again (its session is reused, a newer one exists) */
    assert_int_equal(kvc_rehello(a), KV_ERR_OK);
    assert_non_null(kvc_pool_base(a, KV_FMT_FP8));

    /* bursts of concurrent hellos, one kvc_t per thread */
    int failed = 0;
    for (int r = 0; r < ROUNDS; r++) {
        pthread_t t[THREADS];
        char names[THREADS][16];
        for (int i = 0; i < THREADS; i++) {
            snprintf(names[i], sizeof names[i], "t%d.%d", r, i);
            assert_int_equal(pthread_create(&t[i], NULL, hello_thread, names[i]), 0);
        }
        for (int i = 0; i < THREADS; i++) {
            void *ret = NULL;
            assert_int_equal(pthread_join(t[i], &ret), 0);
            kvc_t *c = ret;
            if (!c || !kvc_pool_base(c, KV_FMT_FP8))
                failed++;
            kvc_close(&c);
        }
    }
    assert_int_equal(failed, 0);
    kvc_close(&a);
    kvc_close(&b);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_process_many_sessions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
