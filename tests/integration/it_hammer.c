/* it_hammer.c — eight client processes hammer alloc/seal/lookup/release/sequences at once
 * (issue 3, test 6). Prompts come from a small shared set so seals dedupe and lookups hit
 * across processes; each worker also pipelines bursts of allocs. Afterwards every reference is
 * gone and kvctl check passes. RESOURCE_EXHAUSTED is legal under this load (it is the
 * documented back-pressure) and is counted, any other error fails the worker. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"

#define PT 16
#define WORKERS 8
#define ITERS 500
#define PROMPTS 6

static void prompt(uint32_t id, uint32_t *tok, size_t n)
{
    for (size_t i = 0; i < n; i++)
        tok[i] = id * 100000u + (uint32_t)i;
}

static int worker(const itest_kvd_t *k, int w)
{
    kvc_t *c = itest_connect(k, "hammer");
    unsigned seed = (unsigned)(w * 7919 + 1);
    int exhausted = 0;
    for (int it = 0; it < ITERS; it++) {
        uint32_t pid = (uint32_t)(rand_r(&seed) % PROMPTS);
        uint32_t npg = 1 + (uint32_t)(rand_r(&seed) % 4);
        uint32_t tok[4 * PT + 3], pages[4], canon[4], hit[5];
        prompt(pid, tok, sizeof tok / sizeof tok[0]);
        /* lookup what is cached, then build the rest */
        size_t nh = 0;
        kv_err_t e = kvc_lookup(c, tok, npg * PT + 3, NULL, 0, 0, hit, 5, &nh, NULL);
        if (e != KV_ERR_OK)
            return 10;
        uint32_t need = npg - (uint32_t)nh;
        if (need) {
            e = kvc_alloc(c, KV_FMT_FP8, need, pages);
            if (e == KV_ERR_RESOURCE_EXHAUSTED) {
                exhausted++;
                if (nh && kvc_release(c, hit, nh) != KV_ERR_OK)
                    return 11;
                continue;
            }
            if (e != KV_ERR_OK)
                return 12;
            for (uint32_t i = 0; i < need; i++) {
                uint8_t *p = kvc_page_ptr(c, pages[i]);
                if (!p)
                    return 13;
                memset(p, (int)(pid + 1), 64);
                uint32_t idx = (uint32_t)nh + i;
                uint32_t prev = idx ? (i ? canon[i - 1] : hit[nh - 1]) : KVP_NO_PAGE;
                if (kvc_seal(c, pages[i], prev, tok + idx * PT, PT, NULL, 0, &canon[i]) !=
                    KV_ERR_OK) {
                    fprintf(stderr, "worker %d seal: %s\n", w, kvc_errmsg(c));
                    return 14;
                }
            }
        }
        /* half of the time hold them in a sequence, else release loose */
        if (it % 2) {
            uint64_t seq;
            if (kvc_seq_open(c, "s", &seq) != KV_ERR_OK)
                return 15;
            if (nh && kvc_seq_append(c, seq, hit, nh) != KV_ERR_OK)
                return 16;
            if (need && kvc_seq_append(c, seq, canon, need) != KV_ERR_OK)
                return 17;
            if (kvc_seq_close(c, seq) != KV_ERR_OK)
                return 18;
        } else {
            if (nh && kvc_release(c, hit, nh) != KV_ERR_OK)
                return 19;
            if (need && kvc_release(c, canon, need) != KV_ERR_OK)
                return 20;
        }
        /* a pipelined burst: 8 allocs in flight, then release them all */
        if (it % 10 == 0) {
            uint64_t ids[8];
            uint32_t got[8];
            int ok[8];
            for (int j = 0; j < 8; j++)
                if (kvc_alloc_send(c, KV_FMT_FP8, 1, &ids[j]) != KV_ERR_OK)
                    return 21;
            for (int j = 7; j >= 0; j--) { /* receive out of order on purpose */
                e = kvc_alloc_recv(c, ids[j], 1, &got[j]);
                ok[j] = e == KV_ERR_OK;
                if (e == KV_ERR_RESOURCE_EXHAUSTED)
                    exhausted++;
                else if (e != KV_ERR_OK)
                    return 22;
            }
            for (int j = 0; j < 8; j++)
                if (ok[j] && kvc_release(c, &got[j], 1) != KV_ERR_OK)
                    return 23;
        }
    }
    if (kvc_heartbeat(c, 0) != KV_ERR_OK)
        return 24;
    if (exhausted)
        fprintf(stderr, "worker %d: %d RESOURCE_EXHAUSTED replies (back-pressure)\n", w,
                exhausted);
    kvc_close(&c);
    return 0;
}

static void test_eight_processes_hammer(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    pid_t pids[WORKERS];
    for (int w = 0; w < WORKERS; w++) {
        pids[w] = fork();
        assert_true(pids[w] >= 0);
        if (pids[w] == 0)
            _exit(worker(&k, w));
    }
    for (int w = 0; w < WORKERS; w++) {
        int st;
        assert_int_equal(waitpid(pids[w], &st, 0), pids[w]);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            fail_msg("worker %d failed with status %d", w, st);
    }
    assert_true(itest_wait_stat(&k, "sessions", 0, 30000) >= 0);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    assert_int_equal(itest_stat(&k, "pages_open.fp8"), 0);
    assert_true(itest_stat(&k, "lookup_pages_hit") > 0);
    assert_true(itest_stat(&k, "seal_dedupes") + itest_stat(&k, "seals") > 0);
    assert_true(itest_stat(&k, "cache_entries") <= PROMPTS * 4);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_eight_processes_hammer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
