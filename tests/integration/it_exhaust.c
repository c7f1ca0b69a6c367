/* it_exhaust.c — pool exhaustion, eviction order and pinning through the RPC (issue 3,
 * test 5; docs/daemon.md "Exhaustion and eviction").
 *
 * Pool: 256 FP8 pages. Three 4-page prompts P1, P2, P3 are sealed and released (cached,
 * unreferenced, on the LRU), then P1 is looked up again (most recently used); P2's first page
 * is pinned. Filling the pool with open pages then asks for pages the free list does not
 * have: the daemon must evict unreferenced cache entries least-recently-used first, never the
 * pinned page and never P1 before the older ones; when only pinned/referenced pages remain,
 * alloc fails with RESOURCE_EXHAUSTED and a message an engine can act on. An allocation sent in
 * chunks whose reserve the pool cannot provide is refused before its first chunk evicts.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "itest.h"

#define PT 16
#define POOL 256

static void seal_prompt(kvc_t *c, uint32_t base, uint32_t *canon)
{
    uint32_t pages[4], tok[4 * PT];
    for (uint32_t i = 0; i < 4 * PT; i++)
        tok[i] = base + i;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 4, pages), KV_ERR_OK);
    for (int i = 0; i < 4; i++)
        assert_int_equal(kvc_seal(c, pages[i], i ? canon[i - 1] : KVP_NO_PAGE, tok + i * PT, PT,
                                  NULL, 0, &canon[i]),
                         KV_ERR_OK);
    assert_int_equal(kvc_release(c, canon, 4), KV_ERR_OK);
}

static size_t cached_prefix(kvc_t *c, uint32_t base)
{
    uint32_t tok[4 * PT], pages[4];
    for (uint32_t i = 0; i < 4 * PT; i++)
        tok[i] = base + i;
    size_t n = 0;
    assert_int_equal(kvc_lookup(c, tok, 4 * PT, NULL, 0, 1 /* peek */, pages, 4, &n, NULL),
                     KV_ERR_OK);
    return n;
}

/* A fresh daemon and client with prompts P1, P2, P3 (tokens from 1000, 2000, 3000) sealed and
 * released in that order: 12 cached entries on the LRU, P1's oldest. */
static kvc_t *start_with_three_prompts(itest_kvd_t *k, const char *name, uint32_t p1[4],
                                       uint32_t p2[4], uint32_t p3[4])
{
    itest_kvd_start(k, NULL);
    kvc_t *c = itest_connect(k, name);
    seal_prompt(c, 1000, p1);
    seal_prompt(c, 2000, p2);
    seal_prompt(c, 3000, p3);
    return c;
}

static void test_exhaustion_eviction_order_and_pins(void **state)
{
    (void)state;
    itest_kvd_t k;
    uint32_t p1[4], p2[4], p3[4];
    kvc_t *c = start_with_three_prompts(&k, "exhaust", p1, p2, p3);
    /* touch P1: lookup (acquire) + release makes it the most recently used */
    uint32_t tok[4 * PT], got[4];
    for (uint32_t i = 0; i < 4 * PT; i++)
        tok[i] = 1000 + i;
    size_t n;
    assert_int_equal(kvc_lookup(c, tok, 4 * PT, NULL, 0, 0, got, 4, &n, NULL), KV_ERR_OK);
    assert_int_equal(n, 4);
    assert_int_equal(kvc_release(c, got, 4), KV_ERR_OK);
    char out[8192], pg[16];
    snprintf(pg, sizeof pg, "%u", p2[0]);
    const char *pin[] = {"cache", "pin", pg, NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, pin), 0);
    assert_int_equal(itest_stat(&k, "cache_entries"), 12);

    /* fill the free list exactly: no eviction yet */
    static uint32_t open_pages[POOL];
    uint32_t nfree = (uint32_t)itest_stat(&k, "pages_free.fp8");
    assert_int_equal(nfree, POOL - 12);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, nfree, open_pages), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "cache_entries"), 12);
    /* 4 more pages: the 4 least recently used unpinned entries go, i.e. P2's unpinned pages
     * and P3's; P1 (touched last) and the pinned page stay */
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 4, open_pages + nfree), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "cache_entries"), 8);
    assert_int_equal(itest_stat(&k, "evictions_pressure"), 4);
    assert_int_equal(cached_prefix(c, 1000), 4);
    assert_int_equal(cached_prefix(c, 2000), 1); /* the pinned head survives alone */
    /* the rest: P3 (4) then P1 (4) can go; the pinned page never */
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 7, open_pages + nfree + 4), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "cache_entries"), 1);
    assert_int_equal(cached_prefix(c, 3000), 0);
    assert_int_equal(cached_prefix(c, 1000), 0);
    uint32_t one;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, &one), KV_ERR_RESOURCE_EXHAUSTED);
    print_message("exhausted: %s\n", kvc_errmsg(c));
    assert_non_null(strstr(kvc_errmsg(c), "RESOURCE_EXHAUSTED"));
    assert_true(strlen(kvc_errmsg(c)) > 40);
    assert_int_equal(itest_stat(&k, "alloc_exhausted"), 1);
    assert_int_equal(cached_prefix(c, 2000), 1);
    /* unpin: now it can be evicted */
    const char *unpin[] = {"cache", "unpin", pg, NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, unpin), 0);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, &one), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "cache_entries"), 0);
    /* releasing open pages frees them (no cache involvement) */
    assert_int_equal(kvc_release(c, open_pages, nfree + 11), KV_ERR_OK);
    assert_int_equal(kvc_release(c, &one, 1), KV_ERR_OK);
    assert_int_equal(kvc_heartbeat(c, 0), KV_ERR_OK);
    assert_true(itest_wait_stat(&k, "pages_free.fp8", POOL, 30000) >= 0);
    kvc_close(&c);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

static void test_admin_evict_all_keeps_pinned(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = itest_connect(&k, "evict");
    uint32_t p1[4], p2[4];
    seal_prompt(c, 1000, p1);
    seal_prompt(c, 2000, p2);
    char out[8192], pg[16];
    snprintf(pg, sizeof pg, "%u", p1[0]);
    const char *pin[] = {"cache", "pin", pg, NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, pin), 0);
    const char *ev[] = {"--json", "cache", "evict", "all", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, ev), 0);
    assert_non_null(strstr(out, "\"evicted\":7"));
    const char *ls[] = {"cache", "ls", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, ls), 0);
    assert_non_null(strstr(out, "1 entries"));
    const char *page[] = {"--json", "page", pg, NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, page), 0);
    assert_non_null(strstr(out, "\"pinned\":true"));
    const char *evp[] = {"cache", "evict", pg, NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, evp), 1); /* pinned: unpin first */
    kvc_close(&c);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* cache_quota is runtime-mutable: lowering it evicts unreferenced entries at once, LRU first,
 * never a pinned or referenced one; raising it (0 = the pool) evicts nothing. */
static void test_runtime_cache_quota(void **state)
{
    (void)state;
    itest_kvd_t k;
    uint32_t p1[4], p2[4], p3[4];
    kvc_t *c = start_with_three_prompts(&k, "quota", p1, p2, p3);
    assert_int_equal(itest_stat(&k, "cache_entries"), 12);
    /* hold P1's first page (referenced: off the LRU) and pin P2's last */
    uint32_t tok[PT], got[1];
    for (uint32_t i = 0; i < PT; i++)
        tok[i] = 1000 + i;
    size_t n = 0;
    assert_int_equal(kvc_lookup(c, tok, PT, NULL, 0, 0, got, 1, &n, NULL), KV_ERR_OK);
    assert_int_equal(n, 1);
    char out[4096], id[16];
    snprintf(id, sizeof id, "%u", p2[3]);
    const char *pin[] = {"cache", "pin", id, NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, pin), 0);

    const char *set4[] = {"config", "set", "cache_quota", "4", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, set4), 0);
    /* 10 entries on the LRU; 8 go, oldest first: P1's pages 2-4, P2's 1-3, P3's first two */
    assert_int_equal(itest_stat(&k, "cache_entries"), 4);
    assert_int_equal(itest_stat(&k, "evictions_quota"), 8);
    assert_int_equal(cached_prefix(c, 1000), 1); /* held page survived, its successor did not */
    assert_int_equal(cached_prefix(c, 2000), 0); /* P2's pinned last page is unreachable... */
    snprintf(id, sizeof id, "%u", p2[3]);
    const char *page[] = {"--json", "page", id, NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, page), 0);
    if (!strstr(out, "cache=1 pins=1")) /* ...but still cached */
        fail_msg("pinned page not cached: %s", out);
    assert_int_equal(cached_prefix(c, 3000), 0); /* P3's head page was evicted */

    const char *set0[] = {"config", "set", "cache_quota", "0", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, set0), 0);
    assert_int_equal(itest_stat(&k, "cache_entries"), 4);
    const char *bad[] = {"config", "set", "cache_quota", "-1", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, bad), 1);
    assert_int_equal(kvc_release(c, got, 1), KV_ERR_OK);
    itest_assert_check(&k);
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* Regression (docs/engine-shim.md, decision 57): an allocation larger than max_alloc is sent in
 * chunks; a chunk that succeeded by evicting unreferenced cache entries, followed by a chunk
 * that failed, cost those prefixes for nothing. Now the first chunk carries the whole count as
 * AllocReq.reserve and the daemon refuses it, evicting nothing, when free + evictable pages
 * cannot cover the reserve. Pool 256, max_alloc 16; 12 cached entries; 10 pages free. */
static void test_failed_chunked_alloc_keeps_the_cache(void **state)
{
    (void)state;
    itest_kvd_t k;
    const char *const extra[] = {"--max_alloc", "16", NULL};
    itest_kvd_start(&k, extra);
    kvc_t *c = itest_connect(&k, "chunks");
    uint32_t p[3][4];
    for (uint32_t i = 0; i < 3; i++)
        seal_prompt(c, 1000 * (i + 1), p[i]);
    static uint32_t held[POOL];
    uint32_t nheld = 0;
    while (nheld < POOL - 12 - 10) {
        uint32_t k16 = POOL - 22 - nheld < 16 ? POOL - 22 - nheld : 16;
        assert_int_equal(kvc_alloc(c, KV_FMT_FP8, k16, held + nheld), KV_ERR_OK);
        nheld += k16;
    }
    assert_int_equal(itest_stat(&k, "cache_entries"), 12);
    const uint64_t x0 = itest_stat(&k, "alloc_exhausted");
    assert_int_equal(itest_stat(&k, "evictions_pressure"), 0);
    /* 30 pages asked in chunks of 16 + 14: 10 free + 12 evictable cannot cover them */
    uint32_t got[30];
    assert_int_equal(kvc_alloc_reserve(c, KV_FMT_FP8, 16, 30, got), KV_ERR_RESOURCE_EXHAUSTED);
    print_message("refused: %s\n", kvc_errmsg(c));
    assert_non_null(strstr(kvc_errmsg(c), "reserve 30 refused before allocating or evicting"));
    assert_non_null(strstr(kvc_errmsg(c), "cannot provide 30 pages now: 22 can be had"));
    assert_int_equal(itest_stat(&k, "evictions_pressure"), 0);
    assert_int_equal(itest_stat(&k, "alloc_exhausted"), x0 + 1);
    assert_int_equal(itest_stat(&k, "cache_entries"), 12);
    for (uint32_t i = 0; i < 3; i++)
        assert_int_equal(cached_prefix(c, 1000 * (i + 1)), 4);
    /* more than the pool: the same refusal; below count: a client's error */
    assert_int_equal(kvc_alloc_reserve(c, KV_FMT_FP8, 16, 100000, got),
                     KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvc_errmsg(c), "of the 256 in the pool"));
    assert_int_equal(kvc_alloc_reserve(c, KV_FMT_FP8, 16, 15, got), KV_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvc_errmsg(c), "alloc: reserve 15"));
    assert_int_equal(itest_stat(&k, "cache_entries"), 12);
    /* a reserve that fits: 16 + 6 pages, the chunks evicting the 12 entries as they need */
    assert_int_equal(kvc_alloc_reserve(c, KV_FMT_FP8, 16, 22, got), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "evictions_pressure"), 6);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 6, got + 16), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "evictions_pressure"), 12);
    assert_int_equal(itest_stat(&k, "cache_entries"), 0);
    for (uint32_t i = 0; i < nheld; i += 16)
        assert_int_equal(kvc_release(c, held + i, nheld - i < 16 ? nheld - i : 16), KV_ERR_OK);
    assert_int_equal(kvc_release(c, got, 16), KV_ERR_OK);
    assert_int_equal(kvc_release(c, got + 16, 6), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    kvc_close(&c);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exhaustion_eviction_order_and_pins),
        cmocka_unit_test(test_admin_evict_all_keeps_pinned),
        cmocka_unit_test(test_runtime_cache_quota),
        cmocka_unit_test(test_failed_chunked_alloc_keeps_the_cache),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
