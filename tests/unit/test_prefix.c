/* test_prefix.c — kvd/prefix.c: the keyed chain hash (checked against libsodium directly),
 * seal and longest-prefix lookup, dedupe on seal, the LRU and its eviction order under
 * allocation pressure, the cache quota, pins and operator eviction, a cached page changing
 * format.
 */
#include "core_fixture.h"

#include <sodium.h>

/* Independent reference: BLAKE2b-256 over salt || prev || tokens LE || extra in one buffer
 * (the salt as a secret prefix, docs/core.md). */
static void ref_hash(const uint8_t key[32], const uint8_t *prev, const uint32_t *tok, uint32_t n,
                     const uint8_t *extra, size_t elen, uint8_t out[32])
{
    uint8_t buf[32 + 32 + 4 * 160 + KVD_EXTRA_MAX];
    size_t b = 0;
    memcpy(buf, key, 32);
    memset(buf + 32, 0, 32);
    if (prev)
        memcpy(buf + 32, prev, 32);
    b = 64;
    for (uint32_t i = 0; i < n; i++)
        for (int j = 0; j < 4; j++)
            buf[b++] = (uint8_t)(tok[i] >> (8 * j));
    if (elen)
        memcpy(buf + b, extra, elen);
    b += elen;
    crypto_generichash(out, 32, buf, b, NULL, 0);
}

static void test_chain_hash(void **state)
{
    kvd_core_opts_t o;
    fx_opts(&o);
    kvd_core_t *c = fx_core_opts(&o);
    uint32_t t[FX_PT] = {1, 2, 0xA1B2C3D4u}, t_swapped[FX_PT] = {2, 1, 0xA1B2C3D4u};
    uint8_t h1[32], h2[32], h3[32], r[32], ex[5] = {9, 8, 7, 6, 5};
    kvd_core_chain_hash(c, NULL, t, FX_PT, NULL, 0, h1);
    ref_hash(o.hash_key, NULL, t, FX_PT, NULL, 0, r);
    assert_memory_equal(h1, r, 32);
    kvd_core_chain_hash(c, NULL, t, FX_PT, NULL, 0, h2);
    assert_memory_equal(h1, h2, 32); /* deterministic */
    kvd_core_chain_hash(c, NULL, t_swapped, FX_PT, NULL, 0, h2);
    assert_memory_not_equal(h1, h2, 32); /* order matters */
    kvd_core_chain_hash(c, h1, t, FX_PT, ex, sizeof(ex), h3); /* chained, with extra */
    ref_hash(o.hash_key, h1, t, FX_PT, ex, sizeof(ex), r);
    assert_memory_equal(h3, r, 32);
    kvd_core_chain_hash(c, h1, t, FX_PT, NULL, 0, h2);
    assert_memory_not_equal(h3, h2, 32); /* extra matters */
    kvd_core_chain_hash(c, h2, t, FX_PT, NULL, 0, r);
    assert_memory_not_equal(h2, r, 32); /* prev matters */
    /* pages longer than the one-shot buffer (64 tokens) stream the same bytes: 65 and 160
     * tokens, with and without extra, against the one-buffer reference */
    uint32_t lt[160];
    for (uint32_t i = 0; i < 160; i++)
        lt[i] = 0x9E3779B9u * (i + 1);
    const uint32_t lens[] = {64, 65, 160};
    for (int k = 0; k < 3; k++) {
        kvd_core_chain_hash(c, h1, lt, lens[k], ex, sizeof(ex), h3);
        ref_hash(o.hash_key, h1, lt, lens[k], ex, sizeof(ex), r);
        assert_memory_equal(h3, r, 32);
        kvd_core_chain_hash(c, NULL, lt, lens[k], NULL, 0, h3);
        ref_hash(o.hash_key, NULL, lt, lens[k], NULL, 0, r);
        assert_memory_equal(h3, r, 32);
    }
    /* another namespace salt: different hashes for the same tokens */
    o.hash_key[31] ^= 1;
    kvd_core_t *c2 = fx_core_opts(&o);
    kvd_core_chain_hash(c2, NULL, t, FX_PT, NULL, 0, h2);
    assert_memory_not_equal(h1, h2, 32);
    kvd_core_free(&c2);
    kvd_core_free(&c);
}

/* Seal npages pages of prompt `seed` in session s; ids_out [npages]. Returns nothing: fails. */
static void seal_prompt(kvd_core_t *c, uint64_t s, uint32_t seed, uint32_t npages,
                        uint32_t *ids_out)
{
    uint32_t tok[8 * FX_PT];
    fx_tokens(seed, npages, tok);
    FX_OK(kvd_core_alloc(c, s, npages, ids_out));
    uint32_t prev = KVD_NONE;
    for (uint32_t i = 0; i < npages; i++) {
        uint8_t h[32];
        uint32_t canon;
        FX_OK(kvd_core_seal(c, s, ids_out[i], prev, tok + i * FX_PT, FX_PT, NULL, 0, h, &canon));
        assert_int_equal(canon, ids_out[i]);
        prev = ids_out[i];
    }
}

static void test_longest_prefix(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a, b;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t ids[3];
    seal_prompt(c, a, 1, 3, ids);
    FX_OK(kvd_core_release(c, a, ids, 3));
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.cache_entries, 3);
    assert_int_equal(st.pages_lru[KV_FMT_FP8], 3);
    FX_CHECK(c);

    uint32_t tok[4 * FX_PT + 2], out[8], np, nt;
    fx_tokens(1, 4, tok); /* 3 cached pages + 1 uncached page + 2 tokens of a partial page */
    FX_OK(kvd_core_lookup(c, b, tok, 4 * FX_PT + 2, NULL, 0, out, 8, &np, &nt));
    assert_int_equal(np, 3);
    assert_int_equal(nt, 3 * FX_PT);
    assert_memory_equal(out, ids, sizeof(ids));
    st = fx_stats(c);
    assert_int_equal(st.pages_lru[KV_FMT_FP8], 0); /* hits are off the LRU */
    assert_int_equal(st.lookup_pages_hit, 3);
    assert_int_equal(st.lookup_pages_asked, 4);
    assert_int_equal(st.lookup_tokens_asked, 4 * FX_PT + 2);
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, ids[1], &pi));
    assert_int_equal(pi.req_loose, 1);
    FX_CHECK(c);
    /* capped by max */
    FX_OK(kvd_core_lookup(c, b, tok, 3 * FX_PT, NULL, 0, out, 2, &np, &nt));
    assert_int_equal(np, 2);
    /* diverging in page 1: only page 0 hits (page 2's hash chains through page 1) */
    tok[FX_PT + 1] ^= 1;
    FX_OK(kvd_core_lookup(c, b, tok, 3 * FX_PT, NULL, 0, out + 2, 6, &np, &nt));
    assert_int_equal(np, 1);
    assert_int_equal(out[2], ids[0]);
    /* a different extra (another LoRA) misses everything; fewer tokens than a page too */
    uint8_t ex = 1;
    FX_OK(kvd_core_lookup(c, b, tok, 3 * FX_PT, &ex, 1, out, 8, &np, &nt));
    assert_int_equal(np, 0);
    FX_OK(kvd_core_lookup(c, b, tok, FX_PT - 1, NULL, 0, out, 8, &np, &nt));
    assert_int_equal(np, 0);
    assert_int_equal(kvd_core_lookup(c, b, tok, 3, &ex, KVD_EXTRA_MAX + 1, out, 8, &np, &nt),
                     KV_ERR_INVALID_ARGUMENT);
    kvd_session_info_t si;
    FX_OK(kvd_core_session_info(c, b, &si));
    assert_int_equal(si.loose_refs, 3 + 2 + 1);
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* The lookup memo (prefix.c): sealed entries are found without recomputing their hash; a
 * restored entry (a snapshot keeps no tokens) is hashed once and then memoized; eviction
 * forgets; results are exactly those of the hash walk. */
static void test_lookup_memo(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[3], out[8], np, nt, tok[3 * FX_PT];
    seal_prompt(c, a, 1, 3, ids);
    FX_OK(kvd_core_release(c, a, ids, 3));
    fx_tokens(1, 3, tok);
    FX_OK(kvd_core_lookup(c, a, tok, 3 * FX_PT, NULL, 0, out, 8, &np, &nt));
    assert_int_equal(np, 3);
    assert_memory_equal(out, ids, sizeof(ids));
    assert_int_equal(fx_stats(c).lookup_pages_hashed, 0); /* all three from the memo */
    FX_OK(kvd_core_release(c, a, out, np));
    /* same prev and tokens, other extra: the memo compares every input byte */
    uint8_t ex = 7;
    FX_OK(kvd_core_lookup(c, a, tok, 3 * FX_PT, &ex, 1, out, 8, &np, &nt));
    assert_int_equal(np, 0);

    /* a restored copy of page 0 in a second core with the same salt: found by hashing once,
     * memoized, then found from the memo */
    kvd_core_opts_t o;
    fx_opts(&o);
    kvd_core_t *c2 = fx_core_opts(&o);
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, ids[0], &pi));
    size_t len = kvd_core_export(c)->page_bytes[KV_FMT_FP8];
    uint8_t *bytes = malloc(len);
    assert_non_null(bytes);
    FX_OK(kvd_core_page_read(c, ids[0], bytes, len));
    uint32_t r;
    FX_OK(kvd_core_cache_restore(c2, pi.hash, KV_FMT_FP8, bytes, len, &r));
    free(bytes);
    uint64_t b;
    FX_OK(kvd_core_session_open(c2, 2, 0, &b));
    for (int round = 0; round < 2; round++) {
        FX_OK(kvd_core_lookup(c2, b, tok, 3 * FX_PT, NULL, 0, out, 8, &np, &nt));
        assert_int_equal(np, 1);
        assert_int_equal(out[0], r);
        assert_int_equal(fx_stats(c2).lookup_pages_hashed, 1); /* hashed in round 0 only */
        FX_OK(kvd_core_release(c2, b, out, np));
    }
    FX_CHECK(c2);
    /* evicted: the memo forgets it and the lookup misses */
    FX_OK(kvd_core_cache_evict(c2, r));
    FX_OK(kvd_core_lookup(c2, b, tok, 3 * FX_PT, NULL, 0, out, 8, &np, &nt));
    assert_int_equal(np, 0);
    FX_CHECK(c2);
    kvd_core_free(&c2);
    FX_CHECK(c);
    kvd_core_free(&c);
}

static void test_seal_dedupe(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a, b, q;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t p1;
    seal_prompt(c, a, 5, 1, &p1);
    /* b computes the same page itself, appends it to a sequence, then seals it */
    uint32_t p2, tok[FX_PT], canon;
    uint8_t h1[32], h2[32];
    fx_tokens(5, 1, tok);
    FX_OK(kvd_core_alloc(c, b, 1, &p2));
    FX_OK(kvd_core_seq_open(c, b, &q));
    FX_OK(kvd_core_seq_append(c, b, q, &p2, 1));
    FX_OK(kvd_core_seal(c, b, p2, KVD_NONE, tok, FX_PT, NULL, 0, h2, &canon));
    assert_int_equal(canon, p1);
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, p1, &pi));
    memcpy(h1, pi.hash, 32);
    assert_memory_equal(h1, h2, 32);
    assert_int_equal(pi.req_loose, 1); /* a's */
    assert_int_equal(pi.req_seq, 1);   /* b's sequence now holds p1 at p2's position */
    FX_OK(kvd_core_page_info(c, p2, &pi));
    assert_int_equal(pi.state, KVD_PAGE_RETIRED);
    kvd_seq_page_t sp[2];
    uint32_t n;
    FX_OK(kvd_core_seq_pages(c, q, sp, 2, &n, NULL));
    assert_int_equal(n, 1);
    assert_int_equal(sp[0].logical, p1);
    assert_int_equal(fx_stats(c).seal_dedupes, 1);
    FX_CHECK(c);
    /* seal errors */
    uint32_t p3, p4;
    FX_OK(kvd_core_alloc(c, b, 1, &p3));
    assert_int_equal(kvd_core_seal(c, a, p3, KVD_NONE, tok, FX_PT, NULL, 0, h2, &canon),
                     KV_ERR_FAILED_PRECONDITION); /* not a's page */
    assert_int_equal(kvd_core_seal(c, b, p3, KVD_NONE, tok, FX_PT - 1, NULL, 0, h2, &canon),
                     KV_ERR_INVALID_ARGUMENT); /* partial page */
    assert_int_equal(kvd_core_seal(c, a, p1, KVD_NONE, tok, FX_PT, NULL, 0, h2, &canon),
                     KV_ERR_FAILED_PRECONDITION); /* already sealed */
    FX_OK(kvd_core_alloc(c, b, 1, &p4));
    assert_int_equal(kvd_core_seal(c, b, p3, p4, tok, FX_PT, NULL, 0, h2, &canon),
                     KV_ERR_FAILED_PRECONDITION); /* prev not sealed */
    FX_OK(kvd_core_seq_close(c, b, q));
    assert_int_equal(kvd_core_seal(c, b, p3, p1, tok, FX_PT, NULL, 0, h2, &canon),
                     KV_ERR_FAILED_PRECONDITION); /* prev no longer held by b */
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* A page's request references stop at KVD_PAGE_REFS_MAX: a lookup or a deduplicating seal
 * that would pass it is refused and takes nothing (before session 10, ~2^32 lookups of one
 * cached page wrapped its 32-bit count to 0: the page went back to the LRU, was evicted while
 * referenced, and the next release hit the daemon's "below zero" panic). The count is set
 * near the cap directly rather than by 2^31 lookups. */
static void test_refs_cap(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a, b;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t p1, tok[FX_PT], got, n = 0, hit = 0;
    seal_prompt(c, a, 7, 1, &p1);
    fx_tokens(7, 1, tok);
    const uint32_t had = c->lp[p1].req_loose;
    c->lp[p1].req_loose = KVD_PAGE_REFS_MAX; /* as if 2^31 lookups held it */
    assert_int_equal(kvd_core_lookup(c, b, tok, FX_PT, NULL, 0, &got, 1, &n, &hit),
                     KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvd_core_errmsg(c), "request references"));
    assert_int_equal(c->lp[p1].req_loose, KVD_PAGE_REFS_MAX); /* nothing taken */
    /* b computes the same page and seals it: the dedupe onto p1 is refused too */
    uint32_t p2, canon;
    uint8_t h[32];
    FX_OK(kvd_core_alloc(c, b, 1, &p2));
    assert_int_equal(kvd_core_seal(c, b, p2, KVD_NONE, tok, FX_PT, NULL, 0, h, &canon),
                     KV_ERR_RESOURCE_EXHAUSTED);
    c->lp[p1].req_loose = had;
    FX_CHECK(c);
    FX_OK(kvd_core_lookup(c, b, tok, FX_PT, NULL, 0, &got, 1, &n, &hit));
    assert_int_equal(got, p1);
    FX_OK(kvd_core_seal(c, b, p2, KVD_NONE, tok, FX_PT, NULL, 0, h, &canon));
    assert_int_equal(canon, p1);
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* Seal `n` single-page prompts in session s and release them one by one: LRU order = order. */
static void cache_pages(kvd_core_t *c, uint64_t s, uint32_t n, uint32_t seed0, uint32_t *ids)
{
    for (uint32_t i = 0; i < n; i++) {
        seal_prompt(c, s, seed0 + i, 1, &ids[i]);
        FX_OK(kvd_core_release(c, s, &ids[i], 1));
    }
}

static int cached(kvd_core_t *c, uint32_t lid)
{
    kvd_page_info_t pi;
    kvd_core_page_info(c, lid, &pi);
    return pi.cache;
}

static void test_eviction_order(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[FX_FP8];
    cache_pages(c, a, FX_FP8, 10, ids); /* the whole pool is cache, nothing referenced */
    /* young: a has not reported the epochs of its releases; nothing is evicted */
    uint32_t got[4];
    assert_int_equal(kvd_core_alloc(c, a, 1, got), KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvd_core_errmsg(c), "evictable after epoch reports"));
    assert_int_equal(fx_stats(c).cache_entries, FX_FP8);
    fx_quiesce(c, a);
    FX_OK(kvd_core_pin(c, ids[0])); /* the oldest is pinned: skipped */
    FX_OK(kvd_core_alloc(c, a, 2, got));
    assert_true(cached(c, ids[0]));
    assert_false(cached(c, ids[1]));
    assert_false(cached(c, ids[2]));
    assert_true(cached(c, ids[3]));
    assert_int_equal(fx_stats(c).evictions_pressure, 2);
    FX_CHECK(c);
    /* a lookup hit on ids[3] moves it off the LRU: ids[4] goes next */
    uint32_t tok[FX_PT], one, np, nt;
    fx_tokens(10 + 3, 1, tok);
    FX_OK(kvd_core_lookup(c, a, tok, FX_PT, NULL, 0, &one, 1, &np, &nt));
    assert_int_equal(np, 1);
    FX_OK(kvd_core_alloc(c, a, 1, got + 2));
    assert_true(cached(c, ids[3]));
    assert_false(cached(c, ids[4]));
    /* 2 evictable left (ids[5], ids[6]); asking 3 fails and evicts nothing */
    assert_int_equal(kvd_core_alloc(c, a, 3, got), KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvd_core_errmsg(c), "1 pinned"));
    assert_true(cached(c, ids[5]) && cached(c, ids[6]));
    /* ids[3] released again goes to the MRU end: order is now 5, 6, 3 */
    FX_OK(kvd_core_release(c, a, &one, 1));
    fx_quiesce(c, a);
    FX_OK(kvd_core_alloc(c, a, 2, got));
    assert_true(cached(c, ids[3]));
    assert_false(cached(c, ids[5]) || cached(c, ids[6]));
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* Pools that are all cache still serve allocs by eviction: with no TQ3 pool, and with a TQ3
 * pool full of retiered entries. alloc used to check free logical ids before evicting, and ids
 * equal free pages of both pools, so it refused for good (review, session 11). */
static void test_all_cache_allocates(void **state)
{
    (void)state;
    for (int tq3 = 0; tq3 < 2; tq3++) {
        kvd_core_opts_t o;
        fx_opts(&o);
        kv_geom_t g = fx_geom();
        kvd_core_opts_default(&o, &g, FX_FP8, tq3 ? FX_TQ3 : 0);
        o.now_ns = fx_now;
        for (int i = 0; i < KVD_HASH_KEY_BYTES; i++)
            o.hash_key[i] = (uint8_t)(i * 7 + 1);
        kvd_core_t *c = fx_core_opts(&o);
        uint64_t a;
        FX_OK(kvd_core_session_open(c, 1, 0, &a));
        uint32_t ids[FX_FP8 + FX_TQ3];
        const uint32_t n = FX_FP8 + (tq3 ? FX_TQ3 : 0);
        cache_pages(c, a, FX_FP8, 40, ids);
        if (tq3) { /* five retiered, their FP8 pages refilled with five more entries */
            for (uint32_t i = 0; i < FX_TQ3; i++)
                FX_OK(kvd_core_convert(c, ids[i], KV_FMT_TQ3));
            fx_quiesce(c, a);
            cache_pages(c, a, FX_TQ3, 40 + FX_FP8, ids + FX_FP8);
        }
        fx_quiesce(c, a);
        kvd_core_collect(c);
        assert_int_equal(fx_stats(c).cache_entries, n);
        assert_int_equal(c->nlfree, 0); /* every id is a cache entry's */
        uint32_t got[3];
        FX_OK(kvd_core_alloc(c, a, 3, got));
        assert_int_equal(fx_stats(c).evictions_pressure, 3);
        assert_int_equal(fx_stats(c).cache_entries, n - 3);
        FX_CHECK(c);
        kvd_core_free(&c);
    }
}

/* kvd_core_can_provide adds up what an alloc's eviction would find (free pages, retired ones a
 * collection frees, LRU entries past their epoch) without changing anything, and
 * kvd_core_alloc_reserve refuses a reserve beyond it before evicting: a chunked allocation
 * whose later chunk failed had cost cache entries for nothing (decision 57). */
static void test_can_provide_and_reserve(void **state)
{
    (void)state;
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[4], two[2], got[FX_FP8];
    cache_pages(c, a, 4, 20, ids); /* 4 entries, young: a has not reported their epochs */
    FX_OK(kvd_core_alloc(c, a, 2, two));
    FX_OK(kvd_core_release(c, a, two, 2)); /* 2 unsealed pages retired, young too; 1 free */
    FX_OK(kvd_core_can_provide(c, KV_FMT_FP8, 1));
    assert_int_equal(kvd_core_can_provide(c, KV_FMT_FP8, 2), KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvd_core_errmsg(c),
                           "2 pages now: 1 can be had (1 free, 0 retired and freeable, 0 cache "
                           "entries evictable; 4 more evictable after epoch reports) of the 7"));
    /* a's report made safe without the collection a report runs: 2 retired pages freeable */
    kvd__session_get(c, a)->safe_epoch = kvd_core_epoch(c);
    kvd_stats_t s0 = fx_stats(c);
    FX_OK(kvd_core_can_provide(c, KV_FMT_FP8, 7));
    assert_int_equal(kvd_core_can_provide(c, KV_FMT_FP8, 8), KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvd_core_errmsg(c), "(1 free, 2 retired and freeable, 4 cache entries "
                                               "evictable; 0 more"));
    kvd_stats_t s1 = fx_stats(c);
    assert_memory_equal(&s0, &s1, sizeof s0); /* nothing collected, evicted or counted */
    FX_OK(kvd_core_pin(c, ids[0])); /* pinned: not evictable */
    FX_OK(kvd_core_can_provide(c, KV_FMT_FP8, 6));
    assert_int_equal(kvd_core_can_provide(c, KV_FMT_FP8, 7), KV_ERR_RESOURCE_EXHAUSTED);
    assert_int_equal(kvd_core_can_provide(c, (kv_fmt_t)KV_FMT_COUNT, 1),
                     KV_ERR_INVALID_ARGUMENT);
    FX_OK(kvd_core_can_provide(c, KV_FMT_TQ3, FX_TQ3));
    assert_int_equal(kvd_core_can_provide(c, KV_FMT_TQ3, FX_TQ3 + 1), KV_ERR_RESOURCE_EXHAUSTED);
    /* a reserve the pool cannot provide: refused before anything is collected or evicted,
     * counted as a refused alloc; a reserve beyond the pool is refused the same way */
    s0 = fx_stats(c);
    assert_int_equal(kvd_core_alloc_reserve(c, a, 2, 7, got), KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvd_core_errmsg(c), "alloc: 2 pages, reserve 7 refused before "
                                               "allocating or evicting anything: fp8 pool cannot "
                                               "provide 7 pages now: 6 can be had"));
    assert_int_equal(kvd_core_alloc_reserve(c, a, 2, 100, got), KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvd_core_errmsg(c), "of the 7 in the pool"));
    s1 = fx_stats(c);
    assert_int_equal(s1.alloc_calls, s0.alloc_calls + 2);
    assert_int_equal(s1.alloc_exhausted, s0.alloc_exhausted + 2);
    s1.alloc_calls = s0.alloc_calls, s1.alloc_exhausted = s0.alloc_exhausted;
    assert_memory_equal(&s0, &s1, sizeof s0);
    for (int i = 0; i < 4; i++)
        assert_true(cached(c, ids[i]));
    assert_int_equal(kvd_core_alloc_reserve(c, a, 3, 2, got), KV_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvd_core_errmsg(c), "reserve 2 is below the 3 pages asked"));
    /* a reserve that fits: both chunks succeed, the second evicting the 3 unpinned entries */
    FX_OK(kvd_core_alloc_reserve(c, a, 2, 6, got));
    assert_int_equal(fx_stats(c).evictions_pressure, 0);
    FX_OK(kvd_core_alloc(c, a, 4, got + 2));
    assert_int_equal(fx_stats(c).evictions_pressure, 3);
    assert_true(cached(c, ids[0]));
    assert_int_equal(kvd_core_can_provide(c, KV_FMT_FP8, 1), KV_ERR_RESOURCE_EXHAUSTED);
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* A cached page that changes format keeps its age: an idle FP8 entry retiered into a TQ3 list
 * of warmer entries goes to the list's cold end (it went to the warm end, review finding). */
static void test_converted_page_keeps_its_age(void **state)
{
    (void)state;
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[5];
    cache_pages(c, a, 5, 70, ids); /* ids[0] the oldest */
    fx_quiesce(c, a);
    for (int i = 1; i < 5; i++)
        FX_OK(kvd_core_convert(c, ids[i], KV_FMT_TQ3));
    FX_OK(kvd_core_convert(c, ids[0], KV_FMT_TQ3));
    assert_int_equal(c->pool[KV_FMT_TQ3].lru_head, ids[0]);
    assert_int_equal(c->pool[KV_FMT_TQ3].lru_tail, ids[4]);
    /* a release is a use, whatever the page's acquire time: a page acquired before every
     * entry on the list and released after them joins the warm end (session 11's first form
     * of this fix put it at the head, to be evicted first) */
    uint32_t held, more[2];
    fx_quiesce(c, a); /* the conversions' FP8 sources are free again */
    kvd_core_collect(c);
    seal_prompt(c, a, 90, 1, &held);
    cache_pages(c, a, 2, 91, more);
    FX_OK(kvd_core_release(c, a, &held, 1));
    assert_int_equal(c->pool[KV_FMT_FP8].lru_tail, held);
    assert_int_not_equal(c->pool[KV_FMT_FP8].lru_head, held);
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* A conversion that fails leaves a cached entry where its age puts it. Before, the failure
 * path dropped the conversion ref like a release, so the coldest entry went to the warm end
 * of its LRU and outlived every entry the next pressure evicted for it. */
static void test_failed_conversion_keeps_lru_place(void **state)
{
    (void)state;
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[3];
    cache_pages(c, a, 3, 60, ids); /* LRU head → tail: ids[0], ids[1], ids[2] */
    fx_quiesce(c, a);
    assert_int_equal(c->pool[KV_FMT_FP8].lru_head, ids[0]);
    kvd_core_backend(c)->test_fail_convert = 1;
    assert_int_equal(kvd_core_convert(c, ids[0], KV_FMT_TQ3), KV_ERR_DEVICE);
    assert_int_equal(c->pool[KV_FMT_FP8].lru_head, ids[0]);
    assert_int_equal(c->pool[KV_FMT_FP8].lru_tail, ids[2]);
    FX_CHECK(c);
    kvd_core_free(&c);
}

static void test_quota_pin_admin(void **state)
{
    kvd_core_opts_t o;
    fx_opts(&o);
    o.cache_quota_pages[KV_FMT_FP8] = 2;
    kvd_core_t *c = fx_core_opts(&o);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[4];
    cache_pages(c, a, 4, 40, ids);
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.cache_entries, 2);
    assert_int_equal(st.evictions_quota, 2);
    assert_false(cached(c, ids[0]) || cached(c, ids[1]));
    assert_true(cached(c, ids[2]) && cached(c, ids[3]));
    FX_CHECK(c);
    /* pins */
    assert_int_equal(kvd_core_pin(c, ids[0]), KV_ERR_NOT_FOUND);
    assert_int_equal(kvd_core_pin(c, 9999), KV_ERR_INVALID_ARGUMENT);
    FX_OK(kvd_core_pin(c, ids[2]));
    FX_OK(kvd_core_pin(c, ids[2]));
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, ids[2], &pi));
    assert_int_equal(pi.pins, 2);
    assert_false(pi.on_lru);
    assert_int_equal(kvd_core_cache_evict(c, ids[2]), KV_ERR_FAILED_PRECONDITION);
    FX_OK(kvd_core_unpin(c, ids[2]));
    FX_OK(kvd_core_unpin(c, ids[2]));
    assert_int_equal(kvd_core_unpin(c, ids[2]), KV_ERR_FAILED_PRECONDITION);
    FX_OK(kvd_core_page_info(c, ids[2], &pi));
    assert_true(pi.on_lru);
    /* operator eviction of a referenced entry: stays live and sealed, no longer findable */
    uint32_t tok[FX_PT], got, np, nt;
    fx_tokens(43, 1, tok);
    FX_OK(kvd_core_lookup(c, a, tok, FX_PT, NULL, 0, &got, 1, &np, &nt));
    assert_int_equal(got, ids[3]);
    FX_OK(kvd_core_cache_evict(c, ids[3]));
    FX_OK(kvd_core_page_info(c, ids[3], &pi));
    assert_int_equal(pi.state, KVD_PAGE_SEALED);
    assert_int_equal(pi.cache, 0);
    FX_OK(kvd_core_lookup(c, a, tok, FX_PT, NULL, 0, &got, 1, &np, &nt));
    assert_int_equal(np, 0);
    assert_int_equal(kvd_core_cache_evict(c, ids[3]), KV_ERR_NOT_FOUND);
    uint32_t found;
    assert_int_equal(kvd_core_cache_find(c, pi.hash, &found), KV_ERR_NOT_FOUND);
    FX_OK(kvd_core_page_info(c, ids[2], &pi));
    FX_OK(kvd_core_cache_find(c, pi.hash, &found));
    assert_int_equal(found, ids[2]);
    FX_OK(kvd_core_release(c, a, &ids[3], 1));
    FX_OK(kvd_core_page_info(c, ids[3], &pi));
    assert_int_equal(pi.state, KVD_PAGE_RETIRED);
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* Pin counts are bounded like request refs. Before, kvd_core_pin counted without limit: a
 * 2^32nd pin wrapped the count to 0 and put a page the operator had pinned on the LRU, and the
 * page's total (request refs + pins + cache + conversion) was summed in 32 bits, so request
 * refs and pins at their bounds plus a conversion's ref summed to 0 and retired a live page. */
static void test_pin_count_bounded(void **state)
{
    (void)state;
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[1];
    cache_pages(c, a, 1, 50, ids); /* cached, unreferenced */
    uint32_t lid = ids[0];
    /* as if KVD_PAGE_REFS_MAX - 1 pins had been taken (the counter agrees, for the checker) */
    FX_OK(kvd_core_pin(c, lid));
    c->lp[lid].pins = KVD_PAGE_REFS_MAX - 1;
    c->st.pins = KVD_PAGE_REFS_MAX - 1;
    FX_OK(kvd_core_pin(c, lid)); /* the last one allowed */
    assert_int_equal(kvd_core_pin(c, lid), KV_ERR_RESOURCE_EXHAUSTED);
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, lid, &pi));
    assert_int_equal(pi.pins, KVD_PAGE_REFS_MAX);
    assert_false(pi.on_lru);
    FX_CHECK(c);
    /* request refs at their bound too: as if the session had looked it up that many times */
    uint32_t tok[FX_PT], got, np, nt;
    fx_tokens(50, 1, tok);
    FX_OK(kvd_core_lookup(c, a, tok, FX_PT, NULL, 0, &got, 1, &np, &nt));
    assert_int_equal(got, lid);
    kvd_session_t *s = kvd__session_get(c, a);
    uint64_t extra = KVD_PAGE_REFS_MAX - 1;
    *kvd_map_get(&s->loose, lid) += extra;
    *kvd_map_get(&s->held, lid) += extra;
    s->loose_total += extra;
    c->lp[lid].req_loose += (uint32_t)extra;
    FX_CHECK(c);
    /* a conversion's ref on top: the page stays live (a 32-bit total wrapped to 0 here) */
    FX_OK(kvd_core_convert(c, lid, KV_FMT_TQ3));
    FX_OK(kvd_core_page_info(c, lid, &pi));
    assert_int_equal(pi.state, KVD_PAGE_SEALED);
    assert_int_equal(pi.fmt, KV_FMT_TQ3);
    FX_CHECK(c);
    kvd_core_free(&c);
}

static void count_cb(const kvd_page_info_t *p, void *ud)
{
    uint32_t *v = ud;
    v[v[0] + 1] = p->logical;
    v[0]++;
}

/* A cached page retiered to TQ3 stays findable, joins the TQ3 LRU; listing shows LRU first. */
static void test_cached_page_changes_format(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[3];
    cache_pages(c, a, 3, 70, ids);
    FX_OK(kvd_core_convert(c, ids[1], KV_FMT_TQ3));
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.pages_cached[KV_FMT_FP8], 2);
    assert_int_equal(st.pages_cached[KV_FMT_TQ3], 1);
    assert_int_equal(st.pages_lru[KV_FMT_TQ3], 1);
    FX_CHECK(c);
    uint32_t list[8] = {0};
    kvd_core_cache_foreach(c, count_cb, list);
    assert_int_equal(list[0], 3);
    assert_int_equal(list[1], ids[0]); /* FP8 LRU head first, then TQ3 */
    assert_int_equal(list[2], ids[2]);
    assert_int_equal(list[3], ids[1]);
    uint32_t tok[FX_PT], got, np, nt;
    fx_tokens(71, 1, tok);
    FX_OK(kvd_core_lookup(c, a, tok, FX_PT, NULL, 0, &got, 1, &np, &nt));
    assert_int_equal(np, 1);
    assert_int_equal(got, ids[1]);
    assert_int_equal(kv_dir_fmt(kvd_core_backend(c)->dir[got]), KV_FMT_TQ3);
    assert_int_equal(kv_dir_flags(kvd_core_backend(c)->dir[got]), KV_DIR_VALID | KV_DIR_SEALED);
    FX_CHECK(c);
    kvd_core_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_hash),
        cmocka_unit_test(test_longest_prefix),
        cmocka_unit_test(test_lookup_memo),
        cmocka_unit_test(test_seal_dedupe),
        cmocka_unit_test(test_refs_cap),
        cmocka_unit_test(test_eviction_order),
        cmocka_unit_test(test_all_cache_allocates),
        cmocka_unit_test(test_can_provide_and_reserve),
        cmocka_unit_test(test_converted_page_keeps_its_age),
        cmocka_unit_test(test_failed_conversion_keeps_lru_place),
        cmocka_unit_test(test_quota_pin_admin),
        cmocka_unit_test(test_pin_count_bounded),
        cmocka_unit_test(test_cached_page_changes_format),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
