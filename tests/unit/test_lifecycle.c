/* test_lifecycle.c — kvd/lifecycle.c on a real kvdcore (host backend, CPU-twin conversions,
 * injected clock): the Recent window and the Anchor sinks, a window that slides as pages are
 * appended, a page shared by two sequences taking the most protective tier, loose holders
 * protecting a page, OPEN pages never converted, promotion of a cached TQ3 prefix that a new
 * sequence puts at Anchor / Recent positions (data still within the codec bounds), pins, FP8
 * pressure shrinking the window (only when that makes pages Stale, never below 1) and growing
 * it back, a full TQ3 pool (eviction first, then pages left FP8 and counted), no TQ3 pool,
 * idle cache entries, act re-checking pages that an earlier conversion of the same tick
 * evicted, the batch bound with oldest pages first, parameter checks, allocation failure at
 * init, and a tick-time figure.
 *
 * After every act the directory is read the way a client reads it (format and flags of each
 * logical id) and kvd_core_check must find nothing wrong.
 */
#include "core_fixture.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvkern.h"
#include "lifecycle.h"

/* A core with bigger pools than the fixture's default (the policy needs room to show). */
static kvd_core_t *lc_core(uint32_t fp8, uint32_t tq3)
{
    kvd_core_opts_t o;
    fx_opts(&o);
    o.pages[KV_FMT_FP8] = fp8;
    o.pages[KV_FMT_TQ3] = tq3;
    o.cache_quota_pages[KV_FMT_FP8] = fp8;
    o.cache_quota_pages[KV_FMT_TQ3] = tq3;
    return fx_core_opts(&o);
}

static kvd_lc_t *lc_new(const kvd_core_t *c, uint32_t w, uint32_t a, uint32_t batch,
                        uint32_t low_pct)
{
    kvd_lc_params_t p;
    kvd_lc_params_default(&p);
    p.recent_pages = w;
    p.anchor_pages = a;
    p.batch = batch;
    p.fp8_low_pct = low_pct;
    kvd_lc_t *lc = NULL;
    assert_int_equal(kvd_lc_init(&lc, c, &p), KV_ERR_OK);
    return lc;
}

/* Decoded layer-0 K of a page, all heads: [H][T][d]. */
static void decode_k0(kvd_core_t *c, uint32_t lid, float *out)
{
    kvd_backend_t *be = kvd_core_backend(c);
    kv_geom_t g = fx_geom();
    kv_dir_entry_t e = be->dir[lid];
    for (uint32_t h = 0; h < g.kv_heads; h++)
        assert_int_equal(
            kv_page_decode_block(&g, kv_dir_fmt(e),
                                 kvd_backend_host_page(be, kv_dir_fmt(e), kv_dir_phys(e)), 0,
                                 KV_KIND_K, h, out + (uint64_t)h * g.page_tokens * g.head_dim),
            KVK_OK);
}

/* Allocate n pages (optionally filled), seal the first nseal as one chained prompt `seed`,
 * open a sequence and append all n. ids[n] receive the page ids in sequence order. */
static uint64_t mk_seq(kvd_core_t *c, uint64_t sid, uint32_t seed, uint32_t n, uint32_t nseal,
                       uint32_t *ids, int fill)
{
    uint32_t tok[64 * FX_PT];
    uint8_t h[KVD_HASH_BYTES];
    assert_true(n <= 64);
    fx_tokens(seed, n, tok);
    FX_OK(kvd_core_alloc(c, sid, n, ids));
    for (uint32_t i = 0; i < n; i++) {
        if (fill)
            fx_fill_page(c, ids[i], seed * 1000u + i, NULL);
        if (i < nseal) {
            uint32_t canon;
            FX_OK(kvd_core_seal(c, sid, ids[i], i ? ids[i - 1] : KVD_NONE, tok + i * FX_PT, FX_PT,
                                NULL, 0, h, &canon));
            assert_int_equal(canon, ids[i]); /* distinct prompts: no dedupe */
        }
    }
    uint64_t q;
    FX_OK(kvd_core_seq_open(c, sid, &q));
    FX_OK(kvd_core_seq_append(c, sid, q, ids, n));
    return q;
}

static kv_fmt_t fmt_of(kvd_core_t *c, uint32_t lid)
{
    kv_dir_entry_t e = kvd_core_backend(c)->dir[lid];
    assert_true(kv_dir_flags(e) & KV_DIR_VALID);
    return kv_dir_fmt(e);
}

/* Expect the directory to show pages ids[0..n) as the string want ("F" FP8, "T" TQ3). */
static void expect_fmts(kvd_core_t *c, const uint32_t *ids, const char *want)
{
    for (uint32_t i = 0; want[i]; i++) {
        kv_fmt_t f = fmt_of(c, ids[i]);
        if (f != (want[i] == 'T' ? KV_FMT_TQ3 : KV_FMT_FP8)) {
            char got[80];
            uint32_t j;
            for (j = 0; want[j] && j < sizeof(got) - 1; j++)
                got[j] = fmt_of(c, ids[j]) == KV_FMT_TQ3 ? 'T' : 'F';
            got[j] = '\0';
            fail_msg("directory formats %s, want %s (first difference at position %u)", got, want,
                     i);
        }
    }
}

static kvd_lc_result_t tick(kvd_lc_t *lc, kvd_core_t *c)
{
    kvd_lc_result_t r;
    assert_int_equal(kvd_lc_tick(lc, c, fx_clock, &r), KV_ERR_OK);
    FX_CHECK(c);
    return r;
}

static kvd_stats_t lc_stats(const kvd_core_t *c, const kvd_lc_t *lc)
{
    kvd_stats_t s = fx_stats(c);
    kvd_lc_stats(lc, &s);
    return s;
}

/* ---- window and anchor ------------------------------------------------------------------- */
static void test_window_and_anchor(void **state)
{
    kvd_core_t *c = lc_core(32, 32);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[12];
    uint64_t q = mk_seq(c, a, 1, 10, 10, ids, 0);
    kvd_lc_t *lc = lc_new(c, 3, 2, 64, 0);

    /* Planning is pure: the directory and the core do not change, twice gives the same plan. */
    kv_dir_entry_t before[12];
    for (int i = 0; i < 10; i++)
        before[i] = kvd_core_backend(c)->dir[ids[i]];
    kvd_lc_plan_t p1, p2;
    FX_OK(kvd_lc_plan(lc, c, fx_clock, &p1));
    kvd_lc_action_t saved[8];
    assert_int_equal(p1.n, 5);
    memcpy(saved, p1.act, sizeof(saved[0]) * p1.n);
    FX_OK(kvd_lc_plan(lc, c, fx_clock, &p2));
    assert_int_equal(p2.n, 5);
    assert_memory_equal(saved, p2.act, sizeof(saved[0]) * p2.n);
    for (int i = 0; i < 10; i++)
        assert_true(kvd_core_backend(c)->dir[ids[i]] == before[i]);
    assert_int_equal(fx_stats(c).retiers, 0);
    /* positions 2..6 Stale (anchor 2, window 3), in position order (same append time) */
    for (uint32_t i = 0; i < 5; i++) {
        assert_int_equal(p2.act[i].logical, ids[2 + i]);
        assert_int_equal(p2.act[i].dst, KV_FMT_TQ3);
        assert_int_equal(p2.act[i].why, KVD_LC_WHY_STALE);
    }
    assert_int_equal(p2.window, 3);
    assert_int_equal(p2.backlog, 0);
    assert_false(p2.pressure);

    kvd_lc_result_t r;
    kvd_lc_act(lc, c, &p2, &r);
    FX_CHECK(c);
    assert_int_equal(r.retiered, 5);
    assert_int_equal(r.first_error, KV_ERR_OK);
    expect_fmts(c, ids, "FFTTTTTFFF");
    for (int i = 0; i < 10; i++) /* still sealed, still valid: only format and phys moved */
        assert_int_equal(kv_dir_flags(kvd_core_backend(c)->dir[ids[i]]),
                         KV_DIR_VALID | KV_DIR_SEALED);
    assert_int_equal(fx_stats(c).retiers, 5);
    /* a settled state plans nothing */
    r = tick(lc, c);
    assert_int_equal(r.retiered + r.promoted, 0);

    /* the window slides: two more pages push positions 7 and 8 out of it */
    uint32_t more[2], tok[2 * FX_PT], canon;
    uint8_t h[KVD_HASH_BYTES];
    fx_tokens(77, 2, tok);
    FX_OK(kvd_core_alloc(c, a, 2, more));
    FX_OK(kvd_core_seal(c, a, more[0], ids[9], tok, FX_PT, NULL, 0, h, &canon));
    FX_OK(kvd_core_seal(c, a, more[1], more[0], tok + FX_PT, FX_PT, NULL, 0, h, &canon));
    FX_OK(kvd_core_seq_append(c, a, q, more, 2));
    ids[10] = more[0], ids[11] = more[1];
    r = tick(lc, c);
    assert_int_equal(r.retiered, 2);
    expect_fmts(c, ids, "FFTTTTTTTFFF");
    kvd_stats_t st = lc_stats(c, lc);
    assert_int_equal(st.lifecycle_ticks, 2);
    assert_int_equal(st.lifecycle_window, 3);
    assert_int_equal(st.lifecycle_backlog, 0);
    assert_true(st.lifecycle_tick_ns > 0 && st.lifecycle_tick_ns_max > 0);
    assert_true(st.retier_ns > 0);
    kvd_lc_free(&lc);
    assert_null(lc);
    kvd_core_free(&c);
}

/* ---- shared pages, loose holders --------------------------------------------------------- */
static void test_shared_page_most_protective(void **state)
{
    kvd_core_t *c = lc_core(32, 32);
    uint64_t a, b;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t A[10];
    mk_seq(c, a, 1, 10, 10, A, 0);
    /* b looks up A's first 4 pages: held loose (position unknown yet) */
    uint32_t tok[10 * FX_PT], got[4], np, nt;
    fx_tokens(1, 10, tok);
    FX_OK(kvd_core_lookup(c, b, tok, 4 * FX_PT, NULL, 0, got, 4, &np, &nt));
    assert_int_equal(np, 4);
    kvd_lc_t *lc = lc_new(c, 3, 2, 64, 0);
    kvd_lc_result_t r = tick(lc, c);
    /* A's Stale positions are 2..6; 2 and 3 are held loose by b, so they wait */
    assert_int_equal(r.retiered, 3);
    expect_fmts(c, A, "FFFFTTTFFF");

    /* b's sequence: A[0..3] then two pages of its own; n = 6, anchor 0-1, Recent 3-5 */
    uint32_t own[2], B[6], canon;
    uint8_t h[KVD_HASH_BYTES];
    uint32_t btok[2 * FX_PT];
    fx_tokens(2, 2, btok);
    FX_OK(kvd_core_alloc(c, b, 2, own));
    FX_OK(kvd_core_seal(c, b, own[0], got[3], btok, FX_PT, NULL, 0, h, &canon));
    FX_OK(kvd_core_seal(c, b, own[1], own[0], btok + FX_PT, FX_PT, NULL, 0, h, &canon));
    memcpy(B, got, sizeof(got));
    B[4] = own[0], B[5] = own[1];
    uint64_t qb;
    FX_OK(kvd_core_seq_open(c, b, &qb));
    FX_OK(kvd_core_seq_append(c, b, qb, B, 6));
    r = tick(lc, c);
    /* A[2] is Stale for both holders → TQ3; A[3] is Recent for b → stays FP8 */
    assert_int_equal(r.retiered, 1);
    expect_fmts(c, A, "FFTFTTTFFF");
    expect_fmts(c, B, "FFTFFF");
    /* b finishes: A[3] is Stale for its only holder now */
    FX_OK(kvd_core_seq_close(c, b, qb));
    r = tick(lc, c);
    assert_int_equal(r.retiered, 1);
    expect_fmts(c, A, "FFTTTTTFFF");
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

/* ---- OPEN pages -------------------------------------------------------------------------- */
static void test_open_pages_never_converted(void **state)
{
    kvd_core_t *c = lc_core(32, 32);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[8];
    mk_seq(c, a, 4, 8, 3, ids, 0); /* pages 3..7 are still being written */
    kvd_lc_t *lc = lc_new(c, 2, 1, 64, 0);
    kvd_lc_result_t r = tick(lc, c);
    assert_int_equal(r.retiered, 2); /* Stale 1..5, only 1 and 2 sealed */
    expect_fmts(c, ids, "FTTFFFFF");
    for (int i = 3; i < 8; i++)
        assert_int_equal(kv_dir_flags(kvd_core_backend(c)->dir[ids[i]]), KV_DIR_VALID);
    /* sealing page 3 makes it eligible */
    uint32_t tok[8 * FX_PT], canon;
    uint8_t h[KVD_HASH_BYTES];
    fx_tokens(4, 8, tok);
    FX_OK(kvd_core_seal(c, a, ids[3], ids[2], tok + 3 * FX_PT, FX_PT, NULL, 0, h, &canon));
    r = tick(lc, c);
    assert_int_equal(r.retiered, 1);
    expect_fmts(c, ids, "FTTTFFFF");
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

/* ---- promotion --------------------------------------------------------------------------- */
static double rel_rms(const float *x, const float *y, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        den += (double)x[i] * x[i];
    }
    return sqrt(num / den);
}

static void test_promote_cached_prefix(void **state)
{
    kvd_core_t *c = lc_core(40, 32);
    uint64_t a, b;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t A[10];
    uint64_t qa = mk_seq(c, a, 1, 10, 10, A, 1);
    enum { N = 2 * FX_PT * 64 }; /* layer-0 K of one page: heads × tokens × d */
    static float fp8v[10][N], dec[N];
    for (int i = 0; i < 10; i++)
        decode_k0(c, A[i], fp8v[i]);
    /* no sinks at first: everything but the last 3 pages goes Stale */
    kvd_lc_t *lc = lc_new(c, 3, 0, 64, 0);
    kvd_lc_result_t r = tick(lc, c);
    assert_int_equal(r.retiered, 7);
    expect_fmts(c, A, "TTTTTTTFFF");
    FX_OK(kvd_core_seq_close(c, a, qa)); /* the prompt stays cached, mostly TQ3 */
    fx_quiesce(c, a);
    r = tick(lc, c);
    assert_int_equal(r.retiered + r.promoted, 0); /* cold cache pages are left alone */

    /* sinks on; b reuses the first 4 cached pages and adds 6 of its own (n = 10) */
    kvd_lc_params_t p;
    kvd_lc_get_params(lc, &p);
    p.anchor_pages = 2;
    FX_OK(kvd_lc_set_params(lc, &p));
    uint32_t tok[4 * FX_PT], B[10], np, nt;
    fx_tokens(1, 4, tok);
    FX_OK(kvd_core_lookup(c, b, tok, 4 * FX_PT, NULL, 0, B, 4, &np, &nt));
    assert_int_equal(np, 4);
    uint32_t own[6], btok[6 * FX_PT], canon;
    uint8_t h[KVD_HASH_BYTES];
    fx_tokens(5, 6, btok);
    FX_OK(kvd_core_alloc(c, b, 6, own));
    for (uint32_t i = 0; i < 6; i++)
        FX_OK(kvd_core_seal(c, b, own[i], i ? own[i - 1] : B[3], btok + i * FX_PT, FX_PT, NULL, 0,
                            h, &canon));
    memcpy(B + 4, own, sizeof(own));
    uint64_t qb;
    FX_OK(kvd_core_seq_open(c, b, &qb));
    FX_OK(kvd_core_seq_append(c, b, qb, B, 10));
    kvd_lc_plan_t pl;
    FX_OK(kvd_lc_plan(lc, c, fx_clock, &pl));
    /* promotes first (the two sinks), then b's Stale pages 4..6 */
    assert_int_equal(pl.n, 5);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(pl.act[i].logical, B[i]);
        assert_int_equal(pl.act[i].dst, KV_FMT_FP8);
        assert_int_equal(pl.act[i].why, KVD_LC_WHY_ANCHOR);
    }
    for (int i = 2; i < 5; i++)
        assert_int_equal(pl.act[i].why, KVD_LC_WHY_STALE);
    kvd_lc_act(lc, c, &pl, &r);
    FX_CHECK(c);
    assert_int_equal(r.promoted, 2);
    assert_int_equal(r.retiered, 3);
    expect_fmts(c, B, "FFTTTTTFFF");
    assert_int_equal(fx_stats(c).promotes, 2);
    assert_true(fx_stats(c).promote_ns > 0);
    /* the data went FP8 → TQ3 → FP8: within the TQ3 bound of what was written (relative RMS
     * ≈ 0.19 for the 3-bit grid after the FP8 step, test_pages' figure; 0.3 still catches a
     * wrong page or layout, which gives ≈ 1), and the TQ3 pages in between decode likewise */
    for (int i = 0; i < 4; i++) {
        decode_k0(c, B[i], dec);
        double e = rel_rms(fp8v[i], dec, N);
        if (e >= 0.3)
            fail_msg("page %d decodes with relative RMS error %.3f", i, e);
    }
    /* a Recent position promotes too: b appends nothing, but a third sequence holding only
     * A[2] (TQ3) makes it Recent (and Anchor) there */
    uint64_t qc;
    FX_OK(kvd_core_lookup(c, b, tok, 3 * FX_PT, NULL, 0, own, 3, &np, &nt));
    FX_OK(kvd_core_release(c, b, own, 2));
    FX_OK(kvd_core_seq_open(c, b, &qc));
    FX_OK(kvd_core_seq_append(c, b, qc, own + 2, 1));
    r = tick(lc, c);
    assert_int_equal(r.promoted, 1);
    assert_int_equal(fmt_of(c, A[2]), KV_FMT_FP8);
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

static void test_pins(void **state)
{
    kvd_core_t *c = lc_core(32, 32);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[6];
    uint64_t q = mk_seq(c, a, 6, 6, 6, ids, 0);
    FX_OK(kvd_core_pin(c, ids[1])); /* pinned before it went Stale: stays FP8 */
    kvd_lc_t *lc = lc_new(c, 1, 0, 64, 0);
    kvd_lc_result_t r = tick(lc, c);
    assert_int_equal(r.retiered, 4);
    expect_fmts(c, ids, "TFTTTF");
    /* pinned while TQ3 (in a sequence): promoted */
    FX_OK(kvd_core_pin(c, ids[2]));
    r = tick(lc, c);
    assert_int_equal(r.promoted, 1);
    expect_fmts(c, ids, "TFFTTF");
    /* pinned while TQ3 and held by no sequence: promoted as well; unpinned cold pages stay */
    FX_OK(kvd_core_seq_close(c, a, q));
    FX_OK(kvd_core_pin(c, ids[3]));
    kvd_lc_plan_t pl;
    FX_OK(kvd_lc_plan(lc, c, fx_clock, &pl));
    assert_int_equal(pl.n, 1);
    assert_int_equal(pl.act[0].logical, ids[3]);
    assert_int_equal(pl.act[0].why, KVD_LC_WHY_PINNED);
    kvd_lc_act(lc, c, &pl, &r);
    FX_CHECK(c);
    expect_fmts(c, ids, "TFFFTF");
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

/* ---- pressure ---------------------------------------------------------------------------- */
static void test_pressure_shrinks_window(void **state)
{
    /* 20 FP8 pages, low watermark 80% = 16 pages, high mark 20 (the whole pool). */
    kvd_core_t *c = lc_core(20, 40);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[16];
    kvd_lc_t *lc = lc_new(c, 8, 1, 64, 80);
    /* pressure with no sequence: shrinking would make nothing Stale, so the window stays */
    uint32_t loose[16];
    FX_OK(kvd_core_alloc(c, a, 16, loose));
    kvd_lc_result_t r = tick(lc, c);
    tick(lc, c);
    assert_int_equal(lc_stats(c, lc).lifecycle_window, 8);
    assert_int_equal(lc_stats(c, lc).lifecycle_window_shrinks, 0);
    FX_OK(kvd_core_release(c, a, loose, 16));
    fx_quiesce(c, a);
    uint64_t q = mk_seq(c, a, 7, 16, 16, ids, 0);
    /* 4 available < 16, but the window of 8 still has Stale work (positions 1..7): do it
     * first, no shrink */
    r = tick(lc, c);
    assert_int_equal(r.retiered, 7);
    expect_fmts(c, ids, "FTTTTTTTFFFFFFFF");
    assert_int_equal(lc_stats(c, lc).lifecycle_window_shrinks, 0);
    /* 4 free + 7 retiring = 11 < 16 and nothing left to do at 8: halve to 4 (8..11 Stale) */
    r = tick(lc, c);
    assert_int_equal(r.retiered, 4);
    expect_fmts(c, ids, "FTTTTTTTTTTTFFFF");
    kvd_stats_t st = lc_stats(c, lc);
    assert_int_equal(st.lifecycle_window, 4);
    assert_int_equal(st.lifecycle_window_shrinks, 1);
    /* 15 < 16: halve to 2; then 17 ≥ 16: no more pressure, < 20: no growth either */
    r = tick(lc, c);
    assert_int_equal(r.retiered, 2);
    r = tick(lc, c);
    assert_int_equal(r.retiered + r.promoted, 0);
    expect_fmts(c, ids, "FTTTTTTTTTTTTTFF");
    st = lc_stats(c, lc);
    assert_int_equal(st.lifecycle_window, 2);
    assert_int_equal(st.lifecycle_window_shrinks, 2);
    /* promotions wait for headroom: a pinned TQ3 page is not promoted below the high mark */
    FX_OK(kvd_core_pin(c, ids[1]));
    fx_quiesce(c, a);
    r = tick(lc, c);
    assert_int_equal(r.promoted, 0);
    assert_int_equal(fmt_of(c, ids[1]), KV_FMT_TQ3);
    /* the request finishes: its FP8 pages are cache-only (evictable), avail = 20 ≥ 20: the
     * window doubles back one step per tick; the pinned page still waits (no headroom above
     * the high mark, which is the whole pool here) */
    FX_OK(kvd_core_seq_close(c, a, q));
    r = tick(lc, c);
    assert_int_equal(lc_stats(c, lc).lifecycle_window, 4);
    r = tick(lc, c);
    assert_int_equal(lc_stats(c, lc).lifecycle_window, 8);
    assert_int_equal(r.promoted, 0);
    kvd_lc_free(&lc);
    kvd_core_free(&c);

    /* a permanent squeeze (low = the whole pool) halves the window tick after tick while that
     * makes pages Stale, down to 1, never 0 */
    c = lc_core(64, 64);
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    mk_seq(c, a, 8, 12, 12, ids, 0);
    lc = lc_new(c, 8, 0, 64, 100);
    for (int i = 0; i < 6; i++)
        tick(lc, c);
    expect_fmts(c, ids, "TTTTTTTTTTTF");
    st = lc_stats(c, lc);
    assert_int_equal(st.lifecycle_window, 1);
    assert_int_equal(st.lifecycle_window_shrinks, 3); /* 8 → 4 → 2 → 1 */
    /* an unrelated change keeps the shrunk window; a new recent_pages restarts from it */
    kvd_lc_params_t p;
    kvd_lc_get_params(lc, &p);
    p.batch = 5;
    FX_OK(kvd_lc_set_params(lc, &p));
    assert_int_equal(lc_stats(c, lc).lifecycle_window, 1);
    p.recent_pages = 6;
    FX_OK(kvd_lc_set_params(lc, &p));
    assert_int_equal(lc_stats(c, lc).lifecycle_window, 6);
    /* bad parameters are refused and change nothing */
    p.recent_pages = 0;
    assert_int_equal(kvd_lc_set_params(lc, &p), KV_ERR_INVALID_ARGUMENT);
    p.recent_pages = 4, p.batch = 0;
    assert_int_equal(kvd_lc_set_params(lc, &p), KV_ERR_INVALID_ARGUMENT);
    p.batch = 1, p.fp8_low_pct = 101;
    assert_int_equal(kvd_lc_set_params(lc, &p), KV_ERR_INVALID_ARGUMENT);
    kvd_lc_get_params(lc, &p);
    assert_int_equal(p.recent_pages, 6);
    assert_int_equal(p.batch, 5);
    assert_int_equal(p.fp8_low_pct, 100);
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

static void test_tq3_full(void **state)
{
    kvd_core_t *c = lc_core(32, 3);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t s1[5], s2[6];
    uint64_t q1 = mk_seq(c, a, 8, 5, 5, s1, 0);
    kvd_lc_t *lc = lc_new(c, 1, 0, 64, 0);
    /* 4 Stale pages, room for 3: the fourth stays FP8, counted once, reported as new */
    kvd_lc_result_t r = tick(lc, c);
    assert_int_equal(r.retiered, 3);
    assert_true(r.tq3_full && r.tq3_full_new);
    assert_int_equal(r.first_error, KV_ERR_RESOURCE_EXHAUSTED);
    expect_fmts(c, s1, "TTTFF");
    kvd_stats_t st = lc_stats(c, lc);
    assert_int_equal(st.lifecycle_skipped_tq3_full, 1);
    assert_int_equal(st.lifecycle_backlog, 0 + 1);
    /* still full: counted again, but not new (the server logs once per episode) */
    r = tick(lc, c);
    assert_true(r.tq3_full && !r.tq3_full_new);
    assert_int_equal(lc_stats(c, lc).lifecycle_skipped_tq3_full, 2);
    /* seq 1 finishes: its TQ3 pages become evictable cache entries (after the epoch) and the
     * core evicts them, LRU first, to make room for seq 2's Stale pages */
    FX_OK(kvd_core_seq_close(c, a, q1));
    fx_quiesce(c, a);
    mk_seq(c, a, 9, 6, 6, s2, 0);
    uint64_t ev0 = fx_stats(c).evictions_pressure;
    r = tick(lc, c);
    assert_int_equal(r.retiered, 3);
    assert_int_equal(fx_stats(c).evictions_pressure - ev0, 3);
    assert_true(r.tq3_full && r.tq3_full_new == 0); /* the episode never ended */
    expect_fmts(c, s2, "TTTFFF");
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

/* ---- cache-only pages -------------------------------------------------------------------- */
static void test_idle_cache_retier(void **state)
{
    kvd_core_t *c = lc_core(32, 32);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[4];
    uint64_t q = mk_seq(c, a, 10, 4, 4, ids, 0);
    FX_OK(kvd_core_seq_close(c, a, q));
    FX_OK(kvd_core_pin(c, ids[3])); /* pinned: off the LRU, never idle */
    uint32_t tok[FX_PT], got, np, nt;
    fx_tokens(10, 1, tok);
    FX_OK(kvd_core_lookup(c, a, tok, FX_PT, NULL, 0, &got, 1, &np, &nt)); /* ids[0] held loose */
    kvd_lc_params_t p;
    kvd_lc_params_default(&p);
    p.cache_retier_ns = 1000000000ull;
    kvd_lc_t *lc = NULL;
    FX_OK(kvd_lc_init(&lc, c, &p));
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, ids[1], &pi));
    fx_clock = pi.last_use_ns + 500000000ull; /* half the threshold */
    kvd_lc_result_t r = tick(lc, c);
    assert_int_equal(r.retiered, 0);
    fx_clock = pi.last_use_ns + 2000000000ull;
    kvd_lc_plan_t pl;
    FX_OK(kvd_lc_plan(lc, c, fx_clock, &pl));
    assert_int_equal(pl.n, 2);
    for (uint32_t i = 0; i < pl.n; i++)
        assert_int_equal(pl.act[i].why, KVD_LC_WHY_IDLE);
    kvd_lc_act(lc, c, &pl, &r);
    FX_CHECK(c);
    assert_int_equal(r.retiered, 2);
    expect_fmts(c, ids, "FTTF");
    /* off (0) by default: a fresh controller leaves cold FP8 entries alone */
    kvd_lc_free(&lc);
    kvd_lc_params_default(&p);
    assert_int_equal(p.cache_retier_ns, 0);
    FX_OK(kvd_lc_init(&lc, c, &p));
    FX_OK(kvd_core_release(c, a, &got, 1));
    fx_clock += 1000000000000ull;
    r = tick(lc, c);
    assert_int_equal(r.retiered, 0);
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

/* A conversion of a tick can evict a page planned later in the same tick: act re-checks. */
static void test_act_rechecks_pages(void **state)
{
    kvd_core_t *c = lc_core(4, 8);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[4];
    uint64_t q = mk_seq(c, a, 13, 4, 4, ids, 0);
    kvd_lc_params_t p;
    kvd_lc_params_default(&p);
    p.recent_pages = 1, p.anchor_pages = 0, p.fp8_low_pct = 0, p.cache_retier_ns = 1;
    kvd_lc_t *lc = NULL;
    FX_OK(kvd_lc_init(&lc, c, &p));
    kvd_lc_result_t r = tick(lc, c);
    assert_int_equal(r.retiered, 3);
    FX_OK(kvd_core_seq_close(c, a, q)); /* 0-2 cached TQ3, 3 cached FP8 on the LRU */
    fx_quiesce(c, a);
    uint32_t open3[3];
    FX_OK(kvd_core_alloc(c, a, 3, open3)); /* FP8: 0 free, 1 evictable (ids[3]) */
    FX_OK(kvd_core_pin(c, ids[0]));
    fx_clock += 1000000;
    kvd_lc_plan_t pl;
    FX_OK(kvd_lc_plan(lc, c, fx_clock, &pl));
    assert_int_equal(pl.n, 2);
    assert_int_equal(pl.act[0].logical, ids[0]);
    assert_int_equal(pl.act[0].why, KVD_LC_WHY_PINNED);
    assert_int_equal(pl.act[1].logical, ids[3]);
    assert_int_equal(pl.act[1].why, KVD_LC_WHY_IDLE);
    /* the promote takes the only FP8 page there is by evicting ids[3]: its retier is skipped */
    kvd_lc_act(lc, c, &pl, &r);
    FX_CHECK(c);
    assert_int_equal(r.promoted, 1);
    assert_int_equal(r.retiered, 0);
    assert_int_equal(r.skipped_changed, 1);
    assert_int_equal(r.first_error, KV_ERR_OK);
    assert_int_equal(fmt_of(c, ids[0]), KV_FMT_FP8);
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, ids[3], &pi));
    assert_int_not_equal(pi.state, KVD_PAGE_SEALED);
    assert_int_equal(fx_stats(c).evictions_pressure, 1);
    /* NULL arguments are refused; a tick without a result pointer still runs */
    assert_int_equal(kvd_lc_plan(NULL, c, 0, &pl), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_lc_plan(lc, NULL, 0, &pl), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_lc_plan(lc, c, 0, NULL), KV_ERR_INVALID_ARGUMENT);
    uint64_t ticks = lc_stats(c, lc).lifecycle_ticks;
    assert_int_equal(kvd_lc_tick(lc, c, fx_clock, NULL), KV_ERR_OK);
    assert_int_equal(lc_stats(c, lc).lifecycle_ticks, ticks + 1);
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

/* ---- batch ------------------------------------------------------------------------------- */
static void test_batch_oldest_first(void **state)
{
    kvd_core_t *c = lc_core(40, 40);
    uint64_t a, b;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t young[6], old[6];
    fx_clock = 1000000;
    mk_seq(c, b, 11, 6, 6, old, 0);
    fx_clock = 9000000000ull;
    mk_seq(c, a, 12, 6, 6, young, 0); /* opened later, appended later */
    kvd_lc_t *lc = lc_new(c, 2, 1, 2, 0);
    /* 3 Stale pages each; 2 per tick, the older sequence's first */
    kvd_lc_result_t r = tick(lc, c);
    assert_int_equal(r.retiered, 2);
    expect_fmts(c, old, "FTTFFF");
    expect_fmts(c, young, "FFFFFF");
    assert_int_equal(lc_stats(c, lc).lifecycle_backlog, 4);
    r = tick(lc, c);
    expect_fmts(c, old, "FTTTFF");
    expect_fmts(c, young, "FTFFFF");
    int ticks = 0;
    while (lc_stats(c, lc).lifecycle_backlog && ticks < 10) {
        tick(lc, c);
        ticks++;
    }
    assert_int_equal(ticks, 1);
    expect_fmts(c, young, "FTTTFF");
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

/* pages_tq3 = 0: a namespace that only has FP8 gets empty plans, not failing conversions */
static void test_no_tq3_pool(void **state)
{
    kvd_core_t *c = lc_core(16, 0);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[10];
    mk_seq(c, a, 12, 10, 10, ids, 0);
    kvd_lc_t *lc = lc_new(c, 2, 1, 64, 90); /* under pressure, too */
    for (int i = 0; i < 3; i++) {
        kvd_lc_result_t r = tick(lc, c);
        assert_int_equal(r.retiered + r.promoted + r.failures, 0);
        assert_int_equal(r.first_error, KV_ERR_OK);
    }
    expect_fmts(c, ids, "FFFFFFFFFF");
    assert_int_equal(fx_stats(c).conversion_failures, 0);
    assert_int_equal(lc_stats(c, lc).lifecycle_window_shrinks, 0);
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

/* ---- construction ------------------------------------------------------------------------ */
static void test_init_errors(void **state)
{
    kvd_core_t *c = lc_core(8, 8);
    kvd_lc_params_t p;
    kvd_lc_params_default(&p);
    kvd_lc_t *lc = (kvd_lc_t *)&p; /* must be overwritten with NULL on failure */
    assert_int_equal(kvd_lc_init(NULL, c, &p), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_lc_init(&lc, NULL, &p), KV_ERR_INVALID_ARGUMENT);
    assert_null(lc);
    assert_int_equal(kvd_lc_init(&lc, c, NULL), KV_ERR_INVALID_ARGUMENT);
    p.recent_pages = 0;
    assert_int_equal(kvd_lc_init(&lc, c, &p), KV_ERR_INVALID_ARGUMENT);
    kvd_lc_params_default(&p);
    /* every allocation of init may fail: NOMEM, NULL, nothing leaked */
    int64_t live = kvd_alloc_live();
    int ok = 0;
    for (uint64_t n = 1; n < 20 && !ok; n++) {
        kvd_alloc_fail_after(n);
        int rc = kvd_lc_init(&lc, c, &p);
        kvd_alloc_fail_after(0);
        if (rc == KV_ERR_OK) {
            ok = 1;
            kvd_lc_free(&lc);
        } else {
            assert_int_equal(rc, KV_ERR_NOMEM);
            assert_null(lc);
        }
        assert_int_equal(kvd_alloc_live(), live);
    }
    assert_true(ok);
    kvd_lc_free(&lc); /* NULL-safe */
    kvd_lc_free(NULL);
    assert_string_equal(kvd_lc_why_name(KVD_LC_WHY_ANCHOR), "anchor");
    assert_string_equal(kvd_lc_why_name(KVD_LC_WHY_IDLE), "idle");
    kvd_core_free(&c);
}

/* ---- a figure: cost of a tick that has nothing to convert --------------------------------- */
static uint64_t real_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void test_tick_time_figure(void **state)
{
    /* 256 sequences × 64 pages = 16384 pages (16384 + 16 logical ids), all Recent (W = 64):
     * the planning walk a daemon does every lifecycle_ms when nothing needs converting. */
    enum { NSEQ = 256, NPG = 64 };
    kvd_core_t *c = lc_core(NSEQ * NPG + 16, 16);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[NPG];
    for (uint32_t s = 0; s < NSEQ; s++)
        mk_seq(c, a, 100 + s, NPG, NPG, ids, 0);
    kvd_lc_t *lc = lc_new(c, NPG, 1, 8, 0); /* no pressure: the pool is full by design */
    kvd_lc_result_t r = tick(lc, c);
    assert_int_equal(r.retiered + r.promoted, 0);
    uint64_t t0 = real_ns();
    for (int i = 0; i < 20; i++)
        assert_int_equal(kvd_lc_tick(lc, c, fx_clock, &r), KV_ERR_OK);
    uint64_t per = (real_ns() - t0) / 20;
    print_message("lifecycle tick, nothing to convert, %d sequences x %d pages: %.1f us\n", NSEQ,
                  NPG, (double)per / 1e3);
    /* the same with the window at 8: 56 Stale pages per sequence, 8 converted per tick */
    kvd_lc_params_t p;
    kvd_lc_get_params(lc, &p);
    p.recent_pages = 8;
    FX_OK(kvd_lc_set_params(lc, &p));
    t0 = real_ns();
    assert_int_equal(kvd_lc_tick(lc, c, fx_clock, &r), KV_ERR_OK);
    per = real_ns() - t0;
    assert_int_equal(r.retiered, 8);
    assert_int_equal(lc_stats(c, lc).lifecycle_backlog, NSEQ * (NPG - 9) - 8);
    print_message("lifecycle tick, 8 retiers of %d-byte pages + plan of %d Stale: %.1f us "
                  "(retier mean %.1f us)\n",
                  (int)fx_stats(c).page_bytes[KV_FMT_FP8], NSEQ * (NPG - 9), (double)per / 1e3,
                  (double)fx_stats(c).retier_ns / 8 / 1e3);
    FX_CHECK(c);
    kvd_lc_free(&lc);
    kvd_core_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_and_anchor),
        cmocka_unit_test(test_shared_page_most_protective),
        cmocka_unit_test(test_open_pages_never_converted),
        cmocka_unit_test(test_promote_cached_prefix),
        cmocka_unit_test(test_pins),
        cmocka_unit_test(test_pressure_shrinks_window),
        cmocka_unit_test(test_tq3_full),
        cmocka_unit_test(test_idle_cache_retier),
        cmocka_unit_test(test_act_rechecks_pages),
        cmocka_unit_test(test_batch_oldest_first),
        cmocka_unit_test(test_no_tq3_pool),
        cmocka_unit_test(test_init_errors),
        cmocka_unit_test(test_tick_time_figure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
