/* it_lifecycle.c — the lifecycle controller in the real daemon (docs/lifecycle.md).
 *
 * kvd runs with --lifecycle_ms 10 --recent_pages 3 --anchor_pages 2 --retier_batch 4 (so the
 * work spans several ticks). This test process is the client, as a host-backend engine is:
 * it allocates 12 FP8 pages, writes Gaussian K/V into them through its own mapping with the
 * append twin (kv_fp8_append), seals them as one prompt and appends them to a sequence. Then:
 *
 *   1. its read-only directory mapping must come to show pages [A, 12-W) = [2, 9) as TQ3 and
 *      the others FP8, all still VALID|SEALED, and stay so (retiers = 7 exactly);
 *   2. it decodes every page through its own pool mapping with the CPU twin
 *      (kv_page_decode_block) and compares with the floats it wrote: NMSE ≤ 0.06 for TQ3
 *      pages (docs/formats.md measures 0.033 keys / 0.036 values at d = 64 through the same
 *      FP8 → TQ3 path; a page of 2 layers × 2 heads × 16 tokens averages 64 rows, so 0.06 is
 *      ~1.7× the expectation, while a wrong page, layout or rotation gives ≈ 1 or more) and
 *      ≤ 0.002 for FP8 pages (measured 6.4e-4);
 *   3. kvctl check reports no leak;
 *   4. closing the sequence leaves all 12 pages cached, valid and decoding the same, and a
 *      lookup of the prompt returns the same 12 pages;
 *   5. a new sequence holding only the first 4 of them makes pages 2 and 3 Anchor/Recent:
 *      the daemon promotes them back to FP8 (promotes = 2), data still within the TQ3 bound.
 *
 * Also: lifecycle_ms 0 / on / off through kvctl config set, and FP8 pressure halving the
 * window (counted, logged) in a daemon with a small FP8 pool.
 *
 * Every wait polls (the client's own directory mapping, or a status figure) with a generous
 * timeout: CI is a loaded 2-core machine.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "itest.h"
#include "kvkern.h"

#define NP   12
#define PT   16 /* itest geometry: 2 layers, 2 KV heads, head_dim 64, 16 tokens per page */
#define W    3
#define A    2
#define MAXV (2 * 2 * PT * 64) /* floats of one kind of one page: layers × heads × T × d */

/* Deterministic N(0,1) by Box–Muller over a 64-bit LCG: the client regenerates what it wrote. */
static double gauss(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    double u1 = ((double)(*s >> 11) + 1.0) / 9007199254740993.0;
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    double u2 = (double)(*s >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* What page i holds for one layer: k, v [PT][kv_heads][d]; values offset and scaled so that
 * K and V differ. */
static void page_data(const kv_geom_t *g, uint32_t i, uint32_t layer, float *k, float *v)
{
    uint64_t s = 0x9e3779b97f4a7c15ull * (i * 8u + layer + 1u);
    uint64_t n = (uint64_t)g->page_tokens * g->kv_heads * g->head_dim;
    for (uint64_t j = 0; j < n; j++) {
        k[j] = (float)gauss(&s);
        v[j] = (float)(0.5 * gauss(&s) + 0.1);
    }
}

static void write_page(kvc_t *c, uint32_t lid, uint32_t i)
{
    const kv_geom_t *g = kvc_geom(c);
    kv_pools_t pools;
    kvc_pools(c, &pools);
    static float k[MAXV], v[MAXV];
    uint32_t slot_page[PT], slot_idx[PT];
    for (uint32_t t = 0; t < PT; t++)
        slot_page[t] = lid, slot_idx[t] = t;
    for (uint32_t l = 0; l < g->layers; l++) {
        page_data(g, i, l, k, v);
        assert_int_equal(kv_fp8_append(g, &pools, (const kv_dir_entry_t *)kvc_directory(c),
                                       kvc_dir_entries(c), l, PT, slot_page, slot_idx, k, v),
                         KVK_OK);
    }
}

/* NMSE of page lid (written as page i) decoded through this process's mappings, per kind. */
static void page_nmse(kvc_t *c, uint32_t lid, uint32_t i, double nmse[2])
{
    const kv_geom_t *g = kvc_geom(c);
    kv_dir_entry_t e = kvc_directory(c)[lid];
    const uint8_t *page = kvc_page_ptr(c, lid);
    assert_non_null(page);
    static float k[MAXV], v[MAXV], out[PT * 256];
    double num[2] = {0, 0}, den[2] = {0, 0};
    uint32_t H = g->kv_heads, d = g->head_dim;
    for (uint32_t l = 0; l < g->layers; l++) {
        page_data(g, i, l, k, v);
        for (int kind = 0; kind < 2; kind++)
            for (uint32_t h = 0; h < H; h++) {
                assert_int_equal(kv_page_decode_block(g, kv_dir_fmt(e), page, l, kind, h, out),
                                 KVK_OK);
                const float *ref = kind == KV_KIND_K ? k : v;
                for (uint32_t t = 0; t < PT; t++)
                    for (uint32_t x = 0; x < d; x++) {
                        double r = ref[((uint64_t)t * H + h) * d + x], y = out[t * d + x];
                        num[kind] += (r - y) * (r - y);
                        den[kind] += r * r;
                    }
            }
    }
    nmse[0] = num[0] / den[0];
    nmse[1] = num[1] / den[1];
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Wait until the directory shows ids[0..n) with formats want ("F"/"T"), all VALID|SEALED. */
static void wait_formats(kvc_t *c, const uint32_t *ids, const char *want, int timeout_ms)
{
    int64_t t0 = itest_now_us();
    char got[64];
    size_t n = strlen(want);
    assert_true(n < sizeof got);
    for (;;) {
        int same = 1;
        for (size_t i = 0; i < n; i++) {
            kv_dir_entry_t e = kvc_directory(c)[ids[i]];
            assert_int_equal(kv_dir_flags(e), KV_DIR_VALID | KV_DIR_SEALED);
            got[i] = kv_dir_fmt(e) == KV_FMT_TQ3 ? 'T' : 'F';
            same &= got[i] == want[i];
        }
        got[n] = '\0';
        if (same)
            return;
        if (itest_now_us() - t0 > (int64_t)timeout_ms * 1000)
            fail_msg("directory shows %s, want %s after %d ms", got, want, timeout_ms);
        sleep_ms(2);
    }
}

/* Check every page of ids (page i written as content i) against its bound for its format. */
static void check_data(kvc_t *c, const uint32_t *ids, uint32_t n, const char *what)
{
    for (uint32_t i = 0; i < n; i++) {
        double e[2];
        page_nmse(c, ids[i], i, e);
        int tq3 = kv_dir_fmt(kvc_directory(c)[ids[i]]) == KV_FMT_TQ3;
        double bound = tq3 ? 0.06 : 0.002;
        print_message("%s: page %2u %s  NMSE K %.5f  V %.5f\n", what, i, tq3 ? "TQ3" : "FP8", e[0],
                      e[1]);
        if (e[0] > bound || e[1] > bound)
            fail_msg("%s: page %u (%s) decodes with NMSE K %.4f V %.4f > %.3f", what, i,
                     tq3 ? "TQ3" : "FP8", e[0], e[1], bound);
    }
}

/* After promotion a page went FP8 → TQ3 → FP8: the TQ3 error plus one FP8 requantization. */
static void check_promoted(kvc_t *c, const uint32_t *ids, uint32_t i)
{
    double e[2];
    page_nmse(c, ids[i], i, e);
    print_message("promoted page %u: NMSE K %.5f V %.5f\n", i, e[0], e[1]);
    if (e[0] > 0.06 || e[1] > 0.06)
        fail_msg("promoted page %u decodes with NMSE K %.4f V %.4f > 0.06", i, e[0], e[1]);
}

static void test_lifecycle_retiers_and_promotes(void **state)
{
    (void)state;
    itest_kvd_t k;
    // clang-format off
    const char *extra[] = {
        "--lifecycle_ms", "10",
        "--recent_pages", "3",
        "--anchor_pages", "2",
        "--retier_batch", "4",
        NULL};
    // clang-format on
    itest_kvd_start(&k, extra);
    kvc_t *c = itest_connect(&k, "lifecycle-client");
    assert_int_equal(kvc_geom(c)->page_tokens, PT);
    assert_true(kvc_geom(c)->head_dim * kvc_geom(c)->kv_heads * kvc_geom(c)->layers <= 256);

    uint32_t pages[NP], canon[NP], tok[NP * PT];
    for (uint32_t i = 0; i < NP * PT; i++)
        tok[i] = 5000u + i * 3u;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, NP, pages), KV_ERR_OK);
    for (uint32_t i = 0; i < NP; i++)
        write_page(c, pages[i], i);
    for (uint32_t i = 0; i < NP; i++)
        if (kvc_seal(c, pages[i], i ? canon[i - 1] : KVP_NO_PAGE, tok + i * PT, PT, NULL, 0,
                     &canon[i]) != KV_ERR_OK)
            fail_msg("seal %u: %s", i, kvc_errmsg(c));
    for (uint32_t i = 0; i < NP; i++)
        assert_int_equal(canon[i], pages[i]); /* a fresh prompt: no dedupe */
    uint64_t seq;
    assert_int_equal(kvc_seq_open(c, "lifecycle", &seq), KV_ERR_OK);
    assert_int_equal(kvc_seq_append(c, seq, canon, NP), KV_ERR_OK);

    /* 1. [A, NP-W) = [2, 9) go Stale → TQ3, in two ticks or more (batch 4) */
    wait_formats(c, canon, "FFTTTTTTTFFF", 60000);
    assert_true(itest_wait_stat(&k, "lifecycle_backlog", 0, 60000) >= 0);
    assert_int_equal(itest_stat(&k, "retiers"), 7);
    assert_int_equal(itest_stat(&k, "promotes"), 0);
    assert_true(itest_stat(&k, "lifecycle_ticks") >= 2);
    assert_true(itest_stat(&k, "retier_ns") > 0);
    assert_int_equal(itest_stat(&k, "lifecycle_window"), W);
    /* the figures reach the operator through kvctl status (the stats table drives it) */
    static char out[65536];
    const char *status[] = {"status", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, status), 0);
    assert_non_null(strstr(out, "lifecycle_skipped_tq3_full"));
    assert_non_null(strstr(out, "retier_ns"));
    /* 2. the data, decoded by the client through its own mappings */
    check_data(c, canon, NP, "in sequence");
    /* 3. no leak, and the settled state stays settled */
    itest_assert_check(&k);
    wait_formats(c, canon, "FFTTTTTTTFFF", 0);
    assert_int_equal(itest_stat(&k, "retiers"), 7);

    /* 4. finishing the request keeps the prompt cached, valid, and the same bytes */
    assert_int_equal(kvc_seq_close(c, seq), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "cache_entries"), NP);
    wait_formats(c, canon, "FFTTTTTTTFFF", 0);
    check_data(c, canon, NP, "cached");
    uint32_t got[NP];
    size_t n = 0;
    uint32_t matched = 0;
    assert_int_equal(kvc_lookup(c, tok, NP * PT, NULL, 0, 0, got, NP, &n, &matched), KV_ERR_OK);
    assert_int_equal(n, NP);
    assert_memory_equal(got, canon, sizeof(canon));
    itest_assert_check(&k);

    /* 5. a new request reuses the first 4 pages only: 0-1 Anchor, 1-3 Recent → promote 2, 3 */
    uint64_t seq2;
    assert_int_equal(kvc_seq_open(c, "reuse", &seq2), KV_ERR_OK);
    assert_int_equal(kvc_seq_append(c, seq2, got, 4), KV_ERR_OK);
    assert_int_equal(kvc_release(c, got + 4, NP - 4), KV_ERR_OK);
    wait_formats(c, canon, "FFFFTTTTTFFF", 60000);
    assert_true(itest_wait_stat(&k, "promotes", 2, 60000) >= 0);
    check_promoted(c, canon, 2);
    check_promoted(c, canon, 3);
    assert_int_equal(kvc_seq_close(c, seq2), KV_ERR_OK);
    itest_assert_check(&k);

    /* the client leaves: nothing referenced, the cache keeps all 12 */
    kvc_close(&c);
    assert_true(itest_wait_stat(&k, "request_refs", 0, 30000) >= 0);
    assert_int_equal(itest_stat(&k, "cache_entries"), NP);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* lifecycle_ms = 0 turns the controller off; kvctl config set turns it on at run time. */
static void test_lifecycle_off_and_on(void **state)
{
    (void)state;
    itest_kvd_t k;
    const char *extra[] = {
        "--lifecycle_ms", "0", "--recent_pages", "1", "--anchor_pages", "0", NULL};
    itest_kvd_start(&k, extra);
    kvc_t *c = itest_connect(&k, "lifecycle-off");
    uint32_t pages[4], canon[4], tok[4 * PT];
    for (uint32_t i = 0; i < 4 * PT; i++)
        tok[i] = 9000u + i;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 4, pages), KV_ERR_OK);
    for (uint32_t i = 0; i < 4; i++)
        write_page(c, pages[i], i);
    for (uint32_t i = 0; i < 4; i++)
        assert_int_equal(kvc_seal(c, pages[i], i ? canon[i - 1] : KVP_NO_PAGE, tok + i * PT, PT,
                                  NULL, 0, &canon[i]),
                         KV_ERR_OK);
    uint64_t seq;
    assert_int_equal(kvc_seq_open(c, "off", &seq), KV_ERR_OK);
    assert_int_equal(kvc_seq_append(c, seq, canon, 4), KV_ERR_OK);
    /* off: a status round trip after the append sees no tick and no conversion. (Not a timed
     * wait for "nothing happens": the counter of ticks is the evidence.) */
    assert_int_equal(itest_stat(&k, "lifecycle_ticks"), 0);
    wait_formats(c, canon, "FFFF", 0);
    char out[4096];
    const char *on[] = {"config", "set", "lifecycle_ms", "5", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, on), 0);
    wait_formats(c, canon, "TTTF", 60000);
    assert_int_equal(itest_stat(&k, "retiers"), 3);
    check_data(c, canon, 4, "after runtime on");
    /* and off again: ticks stop (two status reads 50 ms apart agree) */
    const char *off[] = {"config", "set", "lifecycle_ms", "0", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, off), 0);
    uint64_t t1 = itest_stat(&k, "lifecycle_ticks");
    sleep_ms(50);
    assert_int_equal(itest_stat(&k, "lifecycle_ticks"), t1);
    itest_assert_check(&k);
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* FP8 pressure in the daemon: 20 FP8 pages, watermark 80 % (16 pages), window 8. A 16-page
 * sequence leaves 4 available: the window's own Stale pages (1..7) go first; then, still under
 * pressure with nothing left to do, the window halves to 4 and to 2 (one step per tick), until
 * free + retiring pages reach the watermark. Each shrink is counted and logged. */
static void test_lifecycle_pressure(void **state)
{
    (void)state;
    itest_kvd_t k;
    // clang-format off
    const char *extra[] = {
        "--pages_fp8", "20",
        "--lifecycle_ms", "10",
        "--recent_pages", "8",
        "--anchor_pages", "1",
        "--fp8_low_watermark", "80",
        "--retier_batch", "16",
        NULL};
    // clang-format on
    itest_kvd_start(&k, extra);
    kvc_t *c = itest_connect(&k, "lifecycle-pressure");
    enum { N = 16 };
    uint32_t pages[N], canon[N], tok[N * PT];
    for (uint32_t i = 0; i < N * PT; i++)
        tok[i] = 70000u + i;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, N, pages), KV_ERR_OK);
    for (uint32_t i = 0; i < N; i++)
        write_page(c, pages[i], i);
    for (uint32_t i = 0; i < N; i++)
        assert_int_equal(kvc_seal(c, pages[i], i ? canon[i - 1] : KVP_NO_PAGE, tok + i * PT, PT,
                                  NULL, 0, &canon[i]),
                         KV_ERR_OK);
    uint64_t seq;
    assert_int_equal(kvc_seq_open(c, "squeezed", &seq), KV_ERR_OK);
    assert_int_equal(kvc_seq_append(c, seq, canon, N), KV_ERR_OK);
    wait_formats(c, canon, "FTTTTTTTTTTTTTFF", 60000);
    assert_true(itest_wait_stat(&k, "lifecycle_window_shrinks", 2, 60000) >= 0);
    assert_int_equal(itest_stat(&k, "lifecycle_window"), 2);
    assert_int_equal(itest_stat(&k, "retiers"), 13);
    check_data(c, canon, N, "under pressure");
    /* the shrinks are in the daemon's log (read before stop: stop removes the directory) */
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "grep -q 'under pressure: Recent window 8 -> 4' %s && "
             "grep -q 'under pressure: Recent window 4 -> 2' %s",
             k.log, k.log);
    assert_int_equal(system(cmd), 0);
    itest_assert_check(&k);
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lifecycle_retiers_and_promotes),
        cmocka_unit_test(test_lifecycle_off_and_on),
        cmocka_unit_test(test_lifecycle_pressure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
