/* test_events.c — the core's index hook (kvd_core_set_index_hook), which kvd/events.c turns
 * into published Event messages. Every way the prefix index changes is driven here and the
 * exact event sequence asserted: seal of a chain (STORED with parent links, tokens, extra),
 * dedupe and unsealed pages (nothing), quota eviction, admin eviction, pressure eviction
 * (REMOVED with its reason and the hash STORED announced), conversions of cached pages
 * (FORMAT both ways) and of unbound pages (nothing), session close (nothing: the cache keeps
 * sealed pages), and removing the hook.
 */
#include "core_fixture.h"

#define REC_MAX 64

typedef struct rec_s {
    kvd_index_ev_kind_t kind;
    uint32_t logical;
    kv_fmt_t fmt;
    uint8_t hash[KVD_HASH_BYTES];
    int has_parent;
    uint8_t parent[KVD_HASH_BYTES];
    uint32_t ntok, tok0;
    size_t extra_len;
    kvd_evict_why_t why;
} rec_t;

static rec_t recs[REC_MAX];
static int nrec;

static void record(const kvd_index_ev_t *ev, void *ud)
{
    int *calls = ud;
    (*calls)++;
    if (nrec >= REC_MAX)
        fail_msg("more than %d events", REC_MAX);
    rec_t *r = &recs[nrec++];
    memset(r, 0, sizeof *r);
    r->kind = ev->kind;
    r->logical = ev->logical;
    r->fmt = ev->fmt;
    memcpy(r->hash, ev->hash, KVD_HASH_BYTES);
    if (ev->parent) {
        r->has_parent = 1;
        memcpy(r->parent, ev->parent, KVD_HASH_BYTES);
    }
    r->ntok = ev->ntok;
    r->tok0 = ev->tokens ? ev->tokens[0] : UINT32_MAX;
    r->extra_len = ev->extra_len;
    r->why = ev->why;
}

static int calls;

static kvd_core_t *ev_core(uint32_t quota_fp8)
{
    kvd_core_opts_t o;
    fx_opts(&o);
    if (quota_fp8)
        o.cache_quota_pages[KV_FMT_FP8] = quota_fp8;
    kvd_core_t *c = fx_core_opts(&o);
    nrec = 0;
    calls = 0;
    kvd_core_set_index_hook(c, record, &calls);
    return c;
}

/* Seal a prompt of n pages named by seed (prev-linked), held by session s; ids[n]. */
static void seal_chain(kvd_core_t *c, uint64_t s, uint32_t seed, uint32_t n, uint32_t *ids,
                       const uint8_t *extra, size_t elen)
{
    uint32_t tok[8 * FX_PT];
    assert_true(n <= 8);
    fx_tokens(seed, n, tok);
    FX_OK(kvd_core_alloc(c, s, n, ids));
    for (uint32_t i = 0; i < n; i++) {
        uint8_t h[KVD_HASH_BYTES];
        uint32_t canon;
        FX_OK(kvd_core_seal(c, s, ids[i], i ? ids[i - 1] : KVD_NONE, tok + i * FX_PT, FX_PT,
                            extra, elen, h, &canon));
        assert_int_equal(canon, ids[i]);
    }
}

static void assert_rec(int i, kvd_index_ev_kind_t kind, uint32_t lid)
{
    if (i >= nrec)
        fail_msg("event %d missing (%d recorded)", i, nrec);
    assert_int_equal(recs[i].kind, kind);
    assert_int_equal(recs[i].logical, lid);
}

static void test_chain_stored(void **state)
{
    kvd_core_t *c = ev_core(0);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[4];
    const uint8_t extra[3] = {1, 2, 3};
    seal_chain(c, a, 7, 4, ids, extra, sizeof extra);
    assert_int_equal(nrec, 4);
    assert_int_equal(calls, 4);
    uint32_t tok[4 * FX_PT];
    fx_tokens(7, 4, tok);
    for (int i = 0; i < 4; i++) {
        assert_rec(i, KVD_INDEX_EV_STORED, ids[i]);
        assert_int_equal(recs[i].fmt, KV_FMT_FP8);
        assert_int_equal(recs[i].ntok, FX_PT);
        assert_int_equal(recs[i].tok0, tok[i * FX_PT]);
        assert_int_equal(recs[i].extra_len, sizeof extra);
        kvd_page_info_t pi;
        FX_OK(kvd_core_page_info(c, ids[i], &pi));
        assert_memory_equal(recs[i].hash, pi.hash, KVD_HASH_BYTES);
        /* the parent of page i is the hash of page i-1; the first page has none */
        assert_int_equal(recs[i].has_parent, i > 0);
        if (i > 0)
            assert_memory_equal(recs[i].parent, recs[i - 1].hash, KVD_HASH_BYTES);
    }
    /* the same content sealed again by another session dedupes: no event */
    uint64_t b;
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t dup[4];
    uint32_t t2[4 * FX_PT];
    fx_tokens(7, 4, t2);
    FX_OK(kvd_core_alloc(c, b, 2, dup));
    uint8_t h[KVD_HASH_BYTES];
    uint32_t canon;
    FX_OK(kvd_core_seal(c, b, dup[0], KVD_NONE, t2, FX_PT, extra, sizeof extra, h, &canon));
    assert_int_equal(canon, ids[0]);
    assert_int_equal(nrec, 4);
    /* an unsealed page released, a session closed holding sealed pages: the index keeps them */
    FX_OK(kvd_core_release(c, b, &dup[1], 1));
    FX_OK(kvd_core_session_close(c, b));
    FX_OK(kvd_core_session_close(c, a));
    assert_int_equal(nrec, 4);
    FX_CHECK(c);
    kvd_core_free(&c);
}

static void test_quota_admin_pressure(void **state)
{
    kvd_core_t *c = ev_core(2);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[4];
    /* four one-page prompts, each released after its seal: the third and fourth push the
     * oldest unreferenced entry out of the quota of 2 */
    for (uint32_t i = 0; i < 4; i++) {
        seal_chain(c, a, 20 + i, 1, &ids[i], NULL, 0);
        FX_OK(kvd_core_release(c, a, &ids[i], 1));
    }
    assert_int_equal(nrec, 6);
    assert_rec(0, KVD_INDEX_EV_STORED, ids[0]);
    assert_rec(1, KVD_INDEX_EV_STORED, ids[1]);
    assert_rec(2, KVD_INDEX_EV_STORED, ids[2]);
    assert_rec(3, KVD_INDEX_EV_REMOVED, ids[0]);
    assert_rec(4, KVD_INDEX_EV_STORED, ids[3]);
    assert_rec(5, KVD_INDEX_EV_REMOVED, ids[1]);
    assert_int_equal(recs[3].why, KVD_EVICT_QUOTA);
    assert_int_equal(recs[5].why, KVD_EVICT_QUOTA);
    assert_memory_equal(recs[3].hash, recs[0].hash, KVD_HASH_BYTES);
    assert_memory_equal(recs[5].hash, recs[1].hash, KVD_HASH_BYTES);
    assert_false(recs[0].has_parent);
    /* admin evict of ids[2]: exactly one REMOVED with its hash */
    FX_OK(kvd_core_cache_evict(c, ids[2]));
    assert_int_equal(nrec, 7);
    assert_rec(6, KVD_INDEX_EV_REMOVED, ids[2]);
    assert_int_equal(recs[6].why, KVD_EVICT_ADMIN);
    assert_memory_equal(recs[6].hash, recs[2].hash, KVD_HASH_BYTES);
    /* a refused admin evict (not cached) publishes nothing */
    assert_int_equal(kvd_core_cache_evict(c, ids[2]), KV_ERR_NOT_FOUND);
    assert_int_equal(nrec, 7);
    /* pressure: fill the FP8 pool (7 pages, 1 cached) so an alloc must evict ids[3] */
    fx_quiesce(c, a);
    kvd_core_collect(c);
    uint32_t got[FX_FP8];
    FX_OK(kvd_core_alloc(c, a, FX_FP8, got));
    assert_int_equal(nrec, 8);
    assert_rec(7, KVD_INDEX_EV_REMOVED, ids[3]);
    assert_int_equal(recs[7].why, KVD_EVICT_PRESSURE);
    assert_memory_equal(recs[7].hash, recs[4].hash, KVD_HASH_BYTES);
    assert_int_equal(fx_stats(c).evictions_pressure, 1);
    assert_int_equal(fx_stats(c).evictions_quota, 2);
    assert_int_equal(fx_stats(c).evictions_admin, 1);
    FX_CHECK(c);
    kvd_core_free(&c);
}

static void test_convert(void **state)
{
    kvd_core_t *c = ev_core(0);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[2], open;
    seal_chain(c, a, 30, 2, ids, NULL, 0);
    FX_OK(kvd_core_alloc(c, a, 1, &open));
    nrec = 0;
    FX_OK(kvd_core_convert(c, ids[1], KV_FMT_TQ3));
    assert_int_equal(nrec, 1);
    assert_rec(0, KVD_INDEX_EV_FORMAT, ids[1]);
    assert_int_equal(recs[0].fmt, KV_FMT_TQ3);
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, ids[1], &pi));
    assert_memory_equal(recs[0].hash, pi.hash, KVD_HASH_BYTES);
    /* an unsealed page is not in the index: its conversion is invisible to a router */
    FX_OK(kvd_core_convert(c, open, KV_FMT_TQ3));
    assert_int_equal(nrec, 1);
    /* a refused conversion (already TQ3) publishes nothing; the promote back does */
    assert_int_equal(kvd_core_convert(c, ids[1], KV_FMT_TQ3), KV_ERR_INVALID_ARGUMENT);
    FX_OK(kvd_core_convert(c, ids[1], KV_FMT_FP8));
    assert_int_equal(nrec, 2);
    assert_rec(1, KVD_INDEX_EV_FORMAT, ids[1]);
    assert_int_equal(recs[1].fmt, KV_FMT_FP8);
    /* the hook removed: the core goes on, nothing recorded */
    kvd_core_set_index_hook(c, NULL, NULL);
    FX_OK(kvd_core_convert(c, ids[0], KV_FMT_TQ3));
    FX_OK(kvd_core_release(c, a, ids, 2));
    FX_OK(kvd_core_cache_evict(c, ids[0]));
    assert_int_equal(nrec, 2);
    assert_int_equal(calls, 4); /* 2 STORED + 2 FORMAT; nothing after the removal */
    FX_CHECK(c);
    kvd_core_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_stored),
        cmocka_unit_test(test_quota_admin_pressure),
        cmocka_unit_test(test_convert),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
